#!/usr/bin/env python
"""How similar honest uploads are to each other, and near-copies to their originals.

The copy check (:mod:`validator.copies`) lowers a later upload's weight when it resembles an
earlier one beyond ``validator.copy_overlap_lower`` / ``validator.copy_rare_lower``; those bounds
must sit beyond what honest peers share. Here honest peers (the :class:`Honest` peers of
``bench_robustness.py``: real AdamW on their assigned batches, error feedback, the run's codec) of
``bench_honest.py``'s grid (batch × inner steps × corpus, ``repetitive`` being the corpus where
honest uploads overlap most) train window after window from a θ that moves by the plain mean of
their uploads; every pair of different peers in the same window is compared exactly as the
validator compares them (index overlap, rare positions, sign agreement; all pairs, not only each
peer's closest candidates), and so is a near-copy of each honest upload at every level of
``NearCopies.LEVELS`` (the largest share of its values plus noise, re-encoded) against the window's
honest uploads. Per configuration: the largest and 99th-percentile honest similarities, the share
of honest uploads that would lose any weight (each pair taken as ordered, the later losing: the
worst case), and each copy level's similarity and weight.

    python scripts/bench_copy_similarity.py --quick          # 4 configurations × 2 corpora
    python scripts/bench_copy_similarity.py --json           # the full grid, one JSON object on stdout
    python scripts/bench_copy_similarity.py --cost 256       # the copy check's cost at 256 peers

``--cost N`` times the copy check of one window of N synthetic samples of
:data:`validator.sketch.SKETCH_VALUES` entries each (what every upload of a 1B model is sampled
to; positions drawn from 64 × that many, the density of a 1B contribution's Top-k, 1.6 %, so that
a position is selected by 4 of 256 uploads on average; every eighth upload a near-copy of another
at a share from 0.2 to 0.9): the whole check with weights
(:func:`validator.copies.assess`), beside, in the same run, its pass without them (the rare-position
pairs and the candidates' exact similarity, what the check cost before weights).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_honest import CORPORA, FULL, QUICK, Config, repetitive_dataset, swarm_for
from bench_robustness import Honest, NearCopies, near_copy
from rich.console import Console
from rich.table import Table

from protocol.aggregate import aggregate, apply_outer, sparse_of
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.model import param_schema
from validator.copies import (
    MIN_BACKGROUND,
    CopyRule,
    Similarity,
    _candidates,
    _rare_pairs,
    assess,
    influence,
    rare_evidence,
    similarity,
)
from validator.dataset import BuiltDataset
from validator.sketch import SKETCH_VALUES, global_entries, offsets

torch.set_num_threads(1)


def all_pairs(entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[tuple[str, str], Similarity]:
    """Every pair's similarity, rare positions counted over all of ``entries``."""
    peers = sorted(entries)
    shared, rare_of = _rare_pairs(peers, entries)
    out = {}
    for a in range(len(peers)):
        for b in range(a + 1, len(peers)):
            out[(peers[a], peers[b])] = similarity(
                entries[peers[a]], entries[peers[b]], shared.get((a, b), 0), int(rare_of[a]), int(rare_of[b])
            )
    return out


def run_config(cfg: Config, *, ids: list[Identity], windows: int, built: BuiltDataset | None) -> dict[str, Any]:
    vkey = Identity.generate()
    with swarm_for(cfg, vkey, len(ids), built) as sw:
        rule, schema = CopyRule.of(sw.spec.validator), param_schema(sw.spec.model)
        offs = offsets(schema)
        honest = [Honest(i) for i in ids]
        params = {n: p.detach().clone() for n, p in _initial(sw.spec).items()}
        gen = torch.Generator().manual_seed(5)
        sims: list[Similarity] = []
        lost, uploads = 0, 0
        copies: dict[float, list[tuple[Similarity, float]]] = {lvl: [] for lvl in NearCopies.LEVELS}
        for t in range(windows):
            encs = {h.identity.peer_id: h.blob(sw, params, t, "0" * 64)[1] for h in honest}
            entries = {p: global_entries(sparse_of(e), offs) for p, e in encs.items()}
            pairs = all_pairs(entries)
            background = len(entries) >= MIN_BACKGROUND
            sims += pairs.values()
            for p in entries:
                uploads += 1
                lost += any(influence(s, rule, background) < 1.0 for k, s in pairs.items() if p in k)
            victim = sorted(encs)[t % len(encs)]
            for lvl in NearCopies.LEVELS:
                copy = sw.encode(near_copy(params, encs[victim], lvl, gen), t)
                with_copy = {**entries, "~copy": global_entries(sparse_of(copy), offs)}
                s = all_pairs(with_copy)[(victim, "~copy") if victim < "~copy" else ("~copy", victim)]
                copies[lvl].append((s, influence(s, rule, True)))
            delta = aggregate([sparse_of(e) for e in encs.values()], clip="median")
            apply_outer(params, delta, sw.spec.outer.alpha)
    return summary(sims, lost, uploads, copies, rule)


def _initial(spec: RunSpec) -> dict[str, torch.Tensor]:
    from protocol.model import build_model, parameters_of

    return dict(parameters_of(build_model(spec.model)))


def summary(
    sims: list[Similarity],
    lost: int,
    uploads: int,
    copies: dict[float, list[tuple[Similarity, float]]],
    rule: CopyRule,
) -> dict[str, Any]:
    ov = np.array([s.overlap for s in sims])
    rare = np.array([s.rare for s in sims])
    evid = np.array([rare_evidence(s, rule) for s in sims])
    signs = np.array([s.signs for s in sims])
    return {
        "pairs": len(sims),
        "overlap_max": round(float(ov.max()), 4),
        "overlap_p99": round(float(np.quantile(ov, 0.99)), 4),
        "overlap_median": round(float(np.median(ov)), 4),
        "rare_max": round(float(rare.max()), 4),
        "rare_evidence_max": round(float(evid.max()), 4),
        "rare_evidence_p99": round(float(np.quantile(evid, 0.99)), 4),
        "signs_median": round(float(np.median(signs)), 4),
        "uploads": uploads,
        "honest_losing_weight": lost,
        "copies": {
            f"{lvl:g}": {
                "overlap": round(float(np.mean([s.overlap for s, _ in xs])), 3),
                "rare_evidence": round(float(np.mean([rare_evidence(s, rule) for s, _ in xs])), 3),
                "weight": round(float(np.mean([w for _, w in xs])), 3),
            }
            for lvl, xs in copies.items()
        },
    }


def cost(n: int, values: int = SKETCH_VALUES, repeats: int = 3) -> dict[str, Any]:
    """CPU seconds of the copy check on ``n`` synthetic samples (least of ``repeats``)."""
    rng = np.random.default_rng(0)
    universe = 64 * values
    entries: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(n):
        if i % 8 == 7:  # a near-copy of the upload before it: a share of its positions, its signs
            src_idx, src_val = entries[f"p{i - 1:04d}"]
            share = 0.2 + 0.7 * rng.random()
            keep = rng.random(len(src_idx)) < share
            fresh = rng.choice(universe, size=int((~keep).sum()), replace=False)
            idx = np.concatenate([src_idx[keep], fresh])
            val = np.concatenate([src_val[keep], rng.standard_normal(len(fresh)).astype(np.float32)])
        else:
            idx = rng.choice(universe, size=values, replace=False)
            val = rng.standard_normal(values).astype(np.float32)
        idx, first = np.unique(idx, return_index=True)
        entries[f"p{i:04d}"] = (idx.astype(np.int64), val[first])
    read_at = {p: float(i) for i, p in enumerate(entries)}
    peers = sorted(entries, key=lambda p: read_at[p])
    with_w, without = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        shared, rare_of = _rare_pairs(peers, entries)
        _candidates(peers, entries, shared, rare_of)
        without.append(time.thread_time() - t0)
        t0 = time.thread_time()
        found = assess(entries, read_at, CopyRule.of(RunSpec().validator))
        with_w.append(time.thread_time() - t0)
    return {
        "peers": n,
        "values_per_peer": values,
        "check_s": round(min(with_w), 3),
        "pass_without_weights_s": round(min(without), 3),
        "copiers": sum(not v.tie for v in found.verdicts.values()),
        "weighted": sum(0.0 < w < 1.0 for w in found.weights.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="bench_honest.py's quick grid")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    ap.add_argument("--windows", type=int, default=6, help="windows per configuration (default 6)")
    ap.add_argument("--honest", type=int, default=6, help="honest peers (default 6)")
    ap.add_argument("--corpora", default=",".join(CORPORA), help="comma-separated: demo, repetitive")
    ap.add_argument("--cost", type=int, default=0, help="time the copy check at this many peers instead")
    args = ap.parse_args()
    if args.cost:
        c = cost(args.cost)
        t = Table(title=f"copy check, one window: {c['peers']} peers × {c['values_per_peer']} sampled entries")
        for col in ("check with weights, CPU s", "pass without weights, CPU s", "copiers", "weighted"):
            t.add_column(col, justify="right")
        t.add_row(f"{c['check_s']:.3f}", f"{c['pass_without_weights_s']:.3f}", str(c["copiers"]), str(c["weighted"]))
        Console(file=sys.stderr if args.json else sys.stdout).print(t)
        if args.json:
            print(json.dumps(c, indent=1))
        return
    corpora = args.corpora.split(",")
    grid = QUICK if args.quick else FULL
    ids = [Identity.generate() for _ in range(args.honest)]
    work = Path(tempfile.mkdtemp(prefix="bench-copysim-"))
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        built = repetitive_dataset(work, corpora)
        for corpus in corpora:
            for batch, steps in grid:
                cfg = Config(corpus, batch, steps, None)
                t0 = time.monotonic()
                r = run_config(cfg, ids=ids, windows=args.windows, built=built if corpus == "repetitive" else None)
                r.update(config=cfg.name, seconds=round(time.monotonic() - t0, 1))
                results.append(r)
                print(f"{cfg.name}: overlap max {r['overlap_max']}, {r['seconds']} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rule = CopyRule.of(RunSpec().validator)
    meta = {
        "windows": args.windows,
        "honest": args.honest,
        "rule": rule.__dict__,
        "seconds": round(time.monotonic() - started, 1),
        "honest_losing_weight": sum(r["honest_losing_weight"] for r in results),
        "uploads": sum(r["uploads"] for r in results),
    }
    console = Console(file=sys.stderr if args.json else sys.stdout, width=220)
    console.print(table(results, meta))
    if args.json:
        print(json.dumps({"configs": results, "setup": meta}, indent=1))


def table(results: list[dict[str, Any]], meta: dict[str, Any]) -> Table:
    r0 = meta["rule"]
    t = Table(
        title=f"copy similarity: {meta['honest']} honest peers, {meta['windows']} windows; full weight up to overlap "
        f"{r0['overlap_lower']} / rare {r0['rare_lower']}, copy at {r0['overlap']} / {r0['rare']}",
        caption=f"honest uploads losing any weight (worst case): {meta['honest_losing_weight']}/{meta['uploads']}",
    )
    for c in ("config", "overlap med / p99 / max", "rare max", "rare·signs p99 / max", "signs med", "honest lose"):
        t.add_column(c, justify="left" if c == "config" else "right")
    t.add_column("copy level: overlap, rare·signs → weight")
    for r in results:
        levels = " ".join(
            f"{lvl}: {c['overlap']:.2f},{c['rare_evidence']:.2f}→{c['weight']:.2f}" for lvl, c in r["copies"].items()
        )
        t.add_row(
            r["config"],
            f"{r['overlap_median']:.3f} / {r['overlap_p99']:.3f} / {r['overlap_max']:.3f}",
            f"{r['rare_max']:.3f}",
            f"{r['rare_evidence_p99']:.3f} / {r['rare_evidence_max']:.3f}",
            f"{r['signs_median']:.3f}",
            f"{r['honest_losing_weight']}/{r['uploads']}",
            levels,
        )
    return t


if __name__ == "__main__":
    main()
