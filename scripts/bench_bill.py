"""What a run costs its operator per day in the bucket: R2 and S3 Standard at list prices.

    python scripts/bench_bill.py --demo summary.json --json       # counts from a `sparseloco demo --store s3 --json` line
    python scripts/bench_bill.py --run-demo                       # run that demo first (3 peers, 6 windows, minutes)
    python scripts/bench_bill.py --requests GET=94,HEAD=1,LIST=17,PUT=1 --validator-requests GET=460,LIST=1420
    python scripts/bench_bill.py --model 1b --peers 256 --window-minutes 20 --retain-windows 16

The requests a peer sends per window (by kind) are measured, at the demo's scale: its
``requests_per_peer_per_window`` (what each peer's granted store sent to the bucket) and the
validator's share of ``store_requests_per_window`` (SeaweedFS's count of every request, less the
peers'; it counts a HEAD as a GET, which bills the same). The sizes are the target's: θ in fp32
for a checkpoint; a contribution and an aggregate of ``--peers`` contributions at their bounds
(:mod:`protocol.caps`, the RunSpec's default codec; the aggregate re-compressed, ``outer.recompress``
from ``recompress_from`` contributions on, like a contribution of ``recompress_k``); what a peer reads per
window is the aggregate, with ``outer.eager`` (the default) every other trusted peer's contribution
for the forecast (the peers of the last aggregate: at most ``validator.max_contributors``), and its training data (inner steps × batch × (sequence + 1) tokens). The
projection is :func:`validator.bill.project_day`; JSON with ``--json``, else a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol.broadcast import recompress_codec, recompresses  # noqa: E402
from protocol.caps import aggregate_bound, contribution_bound  # noqa: E402
from protocol.config import RunSpec  # noqa: E402
from protocol.model import param_schema  # noqa: E402
from protocol.settings import ValidatorSettings  # noqa: E402
from validator.bill import R2, S3_STANDARD, Usage, project_day  # noqa: E402

KINDS = ("GET", "HEAD", "LIST", "PUT")


def parse_counts(text: str) -> dict[str, float]:
    """``GET=94,LIST=17`` → {"GET": 94.0, "LIST": 17.0}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, n = part.partition("=")
        if kind not in (*KINDS, "other") or not n:
            raise SystemExit(f"bad request count {part!r}: KIND=N with KIND one of {', '.join(KINDS)}, other")
        out[kind] = float(n)
    return out


def demo_counts(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A demo summary's requests per peer and window, and the validator's per window (the store's
    count less every peer's; a HEAD is a GET at the store)."""
    per_peer = {k: float(v) for k, v in summary["requests_per_peer_per_window"].items()}
    store = summary["store_requests_per_window"]
    peers = summary["peers"]
    peers_get = peers * (per_peer.get("GET", 0.0) + per_peer.get("HEAD", 0.0))
    validator = {"GET": max(0.0, store.get("GET", 0) + store.get("HEAD", 0) - peers_get)}
    for kind in ("LIST", "PUT"):
        validator[kind] = max(0.0, store.get(kind, 0) - peers * per_peer.get(kind, 0.0))
    return per_peer, validator


def run_demo() -> dict[str, Any]:
    """``sparseloco demo --store s3 --json`` with this checkout; its summary (the last line)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", "from client.tools import main; main()", "demo", "--store", "s3", "--json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary


def sizes(model: str, peers: int, eager: bool | None = None) -> dict[str, float]:
    """Bytes of the target run's objects and of a peer's reads per window (module docstring);
    ``eager`` None: the RunSpec's default ``outer.eager``."""
    spec = RunSpec.from_dict({"model": {"preset": model}})
    if eager is not None:
        spec = spec.replace(outer={"eager": eager})
    schema = param_schema(spec.model)
    params = sum(math.prod(s) for s in schema.values())
    contribution = contribution_bound(schema, spec.codec)
    # An aggregate takes at most max_contributors contributions, and the forecast reads those of
    # the peers of the last aggregate only (client/forecast.py): neither grows past that cap.
    contributors = min(peers, spec.validator.max_contributors)
    if recompresses(spec.outer, contributors):  # Δ̄ of that many is published Top-k coded, contribution-like
        aggregate = contribution_bound(schema, recompress_codec(spec.outer, spec.codec))
    else:
        aggregate = aggregate_bound(schema, spec, contributors)
    token_bytes = 2 if spec.model.vocab_size <= 1 << 16 else 4
    data = spec.inner.steps * spec.data.batch_size * (spec.data.seq_len + 1) * token_bytes
    forecast = (contributors - 1) * contribution if spec.outer.eager else 0
    return {
        "params": params,
        "contribution_bytes": contribution,
        "aggregate_bytes": aggregate,
        "data_bytes_per_window": data,
        "bytes_down_per_peer_per_window": aggregate + forecast + data,
        "checkpoint_every": spec.windows.checkpoint_every,
        "eager": spec.outer.eager,
        "contributors": contributors,
    }


def project(
    per_peer: dict[str, float],
    validator: dict[str, float],
    *,
    model: str = "1b",
    peers: int = 256,
    window_minutes: float = 20.0,
    retain_windows: int = ValidatorSettings().retain_windows,
    day: int = 1,
    eager: bool | None = None,
) -> dict[str, Any]:
    """The day's bill of the target run (``model`` × ``peers`` × ``window_minutes``) from measured
    requests per peer and per validator window, with the prices as inputs (``prices``)."""
    sz = sizes(model, peers, eager)
    usage = Usage(
        params=int(sz["params"]),
        peers=peers,
        window_minutes=window_minutes,
        requests_per_peer_per_window=per_peer,
        bytes_down_per_peer_per_window=sz["bytes_down_per_peer_per_window"],
        contribution_bytes=sz["contribution_bytes"],
        aggregate_bytes=sz["aggregate_bytes"],
        validator_requests_per_window=validator,
        checkpoint_every=int(sz["checkpoint_every"]),
        retain_windows=retain_windows,
        day=day,
    )
    return {
        "model": model,
        "peers": peers,
        "window_minutes": window_minutes,
        "retain_windows": retain_windows,
        "day": day,
        "requests_per_peer_per_window": per_peer,
        "validator_requests_per_window": validator,
        "sizes": sz,
        "prices": {p.name: dataclasses.asdict(p) for p in (R2, S3_STANDARD)},
        "projection": project_day(usage),
    }


def table(result: dict[str, Any]) -> Table:
    t = Table(
        title=f"bucket bill per day: {result['model']} × {result['peers']} peers × {result['window_minutes']} min"
    )
    t.add_column("item")
    for name in ("r2", "s3"):
        t.add_column(f"{name} USD/day", justify="right")
    bills = result["projection"]["breakdown"]
    for item in ("class_a", "class_b", "storage", "egress"):
        t.add_row(item, *(f"{bills[n]['usd'][item]:,.2f}" for n in ("r2", "s3")))
    t.add_row("total", *(f"{result['projection'][n]:,.2f}" for n in ("r2", "s3")))
    for label, key in (
        ("class A requests a day", "class_a_requests_per_day"),
        ("class B requests a day", "class_b_requests_per_day"),
        ("GB stored", "stored_gb"),
        ("GB read out a day", "egress_gb_per_day"),
    ):
        t.add_row(label, *(f"{bills[n][key]:,.1f}" for n in ("r2", "s3")))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b", help="model preset of the projected run")
    ap.add_argument("--peers", type=int, default=256)
    ap.add_argument("--window-minutes", type=float, default=20.0)
    ap.add_argument("--retain-windows", type=int, default=ValidatorSettings().retain_windows)
    ap.add_argument("--day", type=int, default=1, help="which day of the run (storage grows without retention)")
    ap.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="outer.eager: each peer reads every other contribution for its forecast [default: the RunSpec's]",
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--demo", type=Path, help="a JSON summary of `sparseloco demo --store s3 --json`")
    src.add_argument("--run-demo", action="store_true", help="run that demo now (minutes)")
    src.add_argument("--requests", help="requests per peer per window: GET=N,HEAD=N,LIST=N,PUT=N")
    ap.add_argument("--validator-requests", default="", help="the validator's per window, as --requests")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    if args.demo or args.run_demo:
        summary = run_demo() if args.run_demo else json.loads(args.demo.read_text().strip().splitlines()[-1])
        per_peer, validator = demo_counts(summary)
        source = "demo"
    elif args.requests:
        per_peer, validator, source = parse_counts(args.requests), parse_counts(args.validator_requests), "arguments"
    else:
        raise SystemExit("give --demo FILE, --run-demo or --requests")
    result = project(
        per_peer,
        validator,
        model=args.model,
        peers=args.peers,
        window_minutes=args.window_minutes,
        retain_windows=args.retain_windows,
        day=args.day,
        eager=args.eager,
    ) | {"requests_from": source}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    Console(width=160).print(table(result))


if __name__ == "__main__":
    main()
