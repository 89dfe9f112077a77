#!/usr/bin/env python
"""False rejections of honest work: a grid of batch sizes × inner steps × corpora, honest peers only.

Every peer is honest (the :class:`Honest` peers of ``bench_robustness.py``: real AdamW on their
assigned batches, error feedback, the run's codec, signed contributions) and every upload goes
through the real :class:`validator.node.Validator`. Whatever is rejected here is rejected wrongly.
Per configuration: honest contributions, rejected ones by reason (``probation`` — a new identity
not scored in its first window — is a deferral, counted apart), peers ever excluded, windows
that accepted nothing, and the validation loss after the last window.

    python scripts/bench_honest.py --quick --baseline        # 3 corners + batch 8/H 10, both rules
    python scripts/bench_honest.py --baseline --json         # the full grid, one JSON object on stdout

``--baseline`` runs every configuration twice: with ``validator.eval_confidence_z`` = 0 (the rule
without error bars: an update is harmful whenever its point estimate says so) and with the
default, side by side. Corpora: ``demo`` (the built-in corpus the demo and the other benchmarks
use) and ``repetitive`` (4 KiB of the standard library's ``json`` package source repeated to
1 MiB, put into the run's store as a signed dataset, as ``sparseloco-validator init`` does): a
small corpus a model soon knows by heart, where gains shrink to the size of their noise.
Nothing is downloaded. The model and sequence length are ``bench_robustness.py``'s (8 scored
sequences of 32 tokens), but *every* contribution is scored (``eval_peers_per_window`` = the
number of peers: the most chances to reject honest work); the peers' learning rate is 0.01
(``--lr``; 3e-3 there), at which single updates of the small model are large and noisy: the
regime in which the point estimates rejected honest work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_robustness import LOCAL, Honest, LaunchClock, Swarm, _measure, bench_spec
from rich.console import Console
from rich.table import Table

from protocol.config import RunSpec
from protocol.data.tokenizer import load_tokenizer
from protocol.identity import Identity
from protocol.settings import DataSettings
from protocol.store.memory import MemoryStore
from validator.dataset import BuiltDataset, build_dataset, publish_dataset
from validator.node import Validator

CORPORA = ("demo", "repetitive")
FULL = [(b, h) for b in (4, 8, 16, 32) for h in (5, 10, 30)]
QUICK = [(4, 5), (4, 30), (8, 10), (32, 5)]  # three corners and the operator's batch 8 / H 10
LR = 1e-2  # the peers' AdamW rate: large, noisy updates, the regime where noise decided verdicts


@dataclass(frozen=True)
class Config:
    corpus: str
    batch: int
    steps: int
    z: float | None  # None: the RunSpec's default
    lr: float = LR

    @property
    def name(self) -> str:
        return f"{self.corpus} b{self.batch} H{self.steps}"


def repetitive_text(path: Path, *, piece: int = 4096, total: int = 1 << 20) -> Path:
    """A few KiB of real text (the standard library's ``json/__init__.py``) repeated to ``total``."""
    src = Path(json.__file__).read_bytes()[:piece]
    path.write_bytes(src * (total // len(src)))
    return path


def repetitive_dataset(work: Path, corpora: Sequence[str]) -> BuiltDataset | None:
    """The ``repetitive`` corpus built under ``work`` when ``corpora`` names it (None otherwise)."""
    if "repetitive" not in corpora:
        return None
    text = repetitive_text(work / "repetitive.txt")
    return build_dataset([str(text)], load_tokenizer("bytes"), val_fraction=0.02, work=work / "built")


def spec_for(cfg: Config, vkey: Identity, peers: int, dataset: str = "") -> RunSpec:
    spec = bench_spec(vkey, max_contributors=32)
    validator: dict[str, object] = {"eval_peers_per_window": peers}  # every contribution is scored
    if cfg.z is not None:
        validator["eval_confidence_z"] = cfg.z
    data = {"batch_size": cfg.batch, **({"dataset": dataset} if dataset else {})}
    return spec.replace(data=data, inner={"steps": cfg.steps, "lr": cfg.lr}, validator=validator)


@contextmanager
def swarm_for(cfg: Config, vkey: Identity, peers: int, built: BuiltDataset | None) -> Iterator[Swarm]:
    """The swarm of ``cfg``: on the built-in corpus, or on ``built`` published into its store."""
    if built is None:
        sw = Swarm(spec_for(cfg, vkey, peers))
    else:
        sw = Swarm(spec_for(cfg, vkey, peers, built.digest), built.local)
        publish_dataset(sw.store, sw.run, sw.run_hash, built, vkey)
    try:
        yield sw
    finally:
        sw.close()


def run_config(
    cfg: Config, *, honest_ids: list[Identity], vkey: Identity, windows: int, built: BuiltDataset | None, cache: Path
) -> dict[str, Any]:
    """``windows`` windows of honest peers through the real validator; what it rejected."""
    state_dir = tempfile.mkdtemp(prefix="bench-honest-")
    local = LOCAL if built is None else dataclasses.replace(LOCAL, data=DataSettings(cache_dir=str(cache)))
    with swarm_for(cfg, vkey, len(honest_ids), built) as sw:
        honest = [Honest(i) for i in honest_ids]
        for h in honest:
            sw.announce(h.identity)
        v = Validator(sw.spec, MemoryStore(sw.name), vkey, state_dir, local=local, clock=LaunchClock())
        v.resume()
        try:
            for t in range(windows):
                st = v.state
                assert st is not None
                for h in honest:
                    sw.upload(h.identity.peer_id, t, h.blob(sw, st.params, t, st.base)[0])
                v.run_window()
            out = _measure(v, sw, honest, [], windows)
            rows = v.log.rows(windows=(0, windows - 1))
            out["contributions"] = len(rows)
            out["rejected"] = sum(not r.accepted and r.reason != "probation" for r in rows)
            out["scored"] = sum(r.loss_own_before is not None for r in rows)
            out["empty_windows"] = sum(
                1 for t in range(windows) if (rec := v.log.window(t)) is not None and rec.accepted == 0
            )
        finally:
            v.close()
            shutil.rmtree(state_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 corners and batch 8 / H 10 (under 5 minutes on 2 cores)")
    ap.add_argument("--baseline", action="store_true", help="also run every configuration with eval_confidence_z = 0")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    ap.add_argument("--windows", type=int, default=None, help="windows per configuration (quick 8, full 12)")
    ap.add_argument("--honest", type=int, default=None, help="honest peers (default 6)")
    ap.add_argument("--corpora", default=",".join(CORPORA), help="comma-separated: demo, repetitive")
    ap.add_argument("--lr", type=float, default=LR, help=f"the honest peers' AdamW learning rate (default {LR:g})")
    args = ap.parse_args()
    corpora = args.corpora.split(",")
    if set(corpora) - set(CORPORA):
        ap.error(f"unknown corpora: {', '.join(sorted(set(corpora) - set(CORPORA)))}")
    windows = args.windows or (8 if args.quick else 12)
    n_honest = args.honest or 6
    grid = QUICK if args.quick else FULL
    rules: list[float | None] = [0.0, None] if args.baseline else [None]
    honest_ids = [Identity.generate() for _ in range(n_honest)]
    vkey = Identity.generate()
    work = Path(tempfile.mkdtemp(prefix="bench-honest-data-"))
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        built = repetitive_dataset(work, corpora)
        for corpus in corpora:
            for batch, steps in grid:
                for z in rules:
                    cfg = Config(corpus, batch, steps, z, args.lr)
                    t0 = time.monotonic()
                    data = built if corpus == "repetitive" else None
                    r = run_config(cfg, honest_ids=honest_ids, vkey=vkey, windows=windows, built=data, cache=work)
                    r.update(corpus=corpus, batch=batch, steps=steps, rule="z=0" if z == 0.0 else "default")
                    r["seconds"] = round(time.monotonic() - t0, 1)
                    results.append(r)
                    print(
                        f"{cfg.name} {r['rule']}: {r['rejected']}/{r['contributions']}, {r['seconds']} s",
                        file=sys.stderr,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    z_default = RunSpec().validator.eval_confidence_z
    meta = {"windows": windows, "honest": n_honest, "z": z_default, "lr": args.lr}
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["totals"] = totals(results)
    console = Console(file=sys.stderr if args.json else sys.stdout, width=200)
    console.print(table(results, meta))
    if args.json:
        print(json.dumps({"configs": results, "setup": meta}, indent=1))


def totals(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rule, over the grid: contributions, rejected (share), excluded peers, empty windows."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        t = out.setdefault(r["rule"], {"contributions": 0, "rejected": 0, "excluded": 0, "empty_windows": 0})
        t["contributions"] += r["contributions"] - r["honest_deferred"]
        t["rejected"] += r["rejected"]
        t["excluded"] += r["honest_excluded"]
        t["empty_windows"] += r["empty_windows"]
    for t in out.values():
        t["rejected_share"] = round(t["rejected"] / max(1, t["contributions"]), 4)
    return out


def table(results: list[dict[str, Any]], meta: dict[str, Any]) -> Table:
    t = Table(title=f"honest rejections: {meta['honest']} honest peers, {meta['windows']} windows per configuration")
    rules = sorted({r["rule"] for r in results}, key=lambda s: s != "z=0")
    t.add_column("config")
    for rule in rules:
        label = f"z={meta['z']:g}" if rule == "default" else rule
        for c in ("rejected", "by reason", "excl", "empty w", "loss"):
            t.add_column(f"{label} {c}", justify="right")
    by: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in results:
        by.setdefault((r["corpus"], r["batch"], r["steps"]), {})[r["rule"]] = r
    for (corpus, batch, steps), cells in by.items():
        row = [f"{corpus} b{batch} H{steps}"]
        for rule in rules:
            r = cells.get(rule)
            if r is None:
                row += ["–"] * 5
                continue
            reasons = {k: v for k, v in r["honest_reasons"].items() if k != "probation"}
            n = r["contributions"] - r["honest_deferred"]
            row += [
                f"{r['rejected']}/{n}",
                ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "–",
                str(r["honest_excluded"]),
                str(r["empty_windows"]),
                f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else "–",
            ]
        t.add_row(*row)
    for rule in rules:
        tot = meta["totals"][rule]
        label = f"z={meta['z']:g}" if rule == "default" else rule
        t.caption = (t.caption + "; " if t.caption else "") + (
            f"{label}: {tot['rejected']}/{tot['contributions']} rejected ({100 * tot['rejected_share']:.1f} %), "
            f"{tot['excluded']} excluded, {tot['empty_windows']} empty windows"
        )
    return t


if __name__ == "__main__":
    main()
