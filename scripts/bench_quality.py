#!/usr/bin/env python
"""Quality benchmark: SparseLoCo vs DiLoCo vs AdamW DDP at equal tokens and equal H.

Every method runs in the in-process simulator (client/simulator.py), which goes through the code
real peers and the validator run (inner trainer, error feedback, codec bytes, aggregation, outer
step). Learning rates are tuned per method over a grid; the best of each is reported with the grid.

    python scripts/bench_quality.py --preset quick                # < 10 min on 2 idle CPU cores
    python scripts/bench_quality.py --preset quick --json > q.json --plot q.png
    python scripts/bench_quality.py --methods diloco,sparseloco --inner-steps 30 --rounds 12 \\
        --lr-grid 1e-3,2e-3 --outer-lr-grid 0.3,0.5,0.7,1.0 --seeds 0,1

Methods: ``ddp``, ``diloco``, ``sparseloco`` (mean over contributors, median-norm clip, the
production rule, synchronous schedule, Δ̄ published as the defaults publish it: with bfloat16
values below ``outer.recompress_from`` contributors, re-compressed from there on),
``sparseloco-all`` (mean over all R), ``sparseloco-plain`` (Δ̄ always with bfloat16 values) and
``sparseloco-recompress`` (Δ̄ always re-compressed: the validator publishes Top-k
(``--recompress-k``) + 2-bit codes of its own error-feedback buffer, decay ``--recompress-beta``). The overlapped schedule (``outer.delay = 1``: a window starts from
θ_{t−1} while aggregate t−1 is in flight, see client/simulator.py), at the same tokens and H as
``sparseloco``:

* ``sparseloco-overlap``: the aggregate reaches the peer after ``--arrival`` of the window's inner
  steps (the validator's time per window over the peer's) and the peer moves its working model by
  it — what peers do without ``outer.eager``;
* ``sparseloco-overlap-eager``: the same with ``outer.eager``, the peers' default: until it
  arrives the peer trains from θ_{t−1} less the forecast of the aggregate from the contributions in
  the store (its own only until ``--forecast-at`` of the window, every peer's after that), after
  waiting for every peer's up to ``--forecast-wait`` of the window (``outer.forecast_wait``; the
  time waited is the method's ``waited``, a share of H spent idle);
* ``sparseloco-delayed``: the aggregate arrives only after the window (the outer step applied one
  window late); ``sparseloco-delayed-own``: the same with a forecast that never sees more than the
  peer's own contribution (the eager update of arXiv 2502.12996).

``--k`` changes the codec of every SparseLoCo variant; ``--warmup-k`` and ``--warmup-windows`` set
its Top-k warm-up (``outer.warmup_k``, ``outer.warmup_windows``: k falls linearly from
``--warmup-k`` at round 0 to ``--k`` at round ``--warmup-windows``), which the bytes per round include.
Both default to the RunSpec default (512 over 4 rounds); ``--warmup-k 0`` runs without a warm-up.

Bytes per replica and round: ``upload`` is what one replica sends, ``download`` what it receives —
the signed aggregate for SparseLoCo (``protocol.wire.encode_aggregate``), the dense float32 mean for
DiLoCo, one float32 gradient per inner step for DDP.

    python scripts/bench_quality.py --preset delay               # synchronous vs the overlapped variants
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import struct
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from client.simulator import SimConfig, SimResult, Simulator
from protocol.config import MODEL_PRESETS, CodecConfig, DataConfig, InnerConfig, OuterConfig, model_config
from protocol.data.assignment import open_dataset
from protocol.model import param_schema

# "1m" ≈ 0.9 M parameters, "300k" ≈ 0.25 M: small enough for a grid of runs on a 2-core CPU
# machine (BENCHMARKS.md records both).
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "1m": dict(dim=128, n_layers=4, n_heads=4, ffn_dim=384, max_seq_len=256),
    "300k": dict(dim=64, n_layers=4, n_heads=4, ffn_dim=192, max_seq_len=256),
}
# SparseLoCo variants: (aggregation, outer.delay, outer.eager, arrival, forecast_at); None: the flag's value
SPARSE_VARIANTS: dict[str, tuple[str, int, bool, float | None, float | None]] = {
    "sparseloco": ("contributors", 0, False, 0.0, 0.0),
    "sparseloco-all": ("all", 0, False, 0.0, 0.0),
    "sparseloco-recompress": ("contributors", 0, False, 0.0, 0.0),
    "sparseloco-plain": ("contributors", 0, False, 0.0, 0.0),
    "sparseloco-overlap": ("contributors", 1, False, None, 0.0),
    "sparseloco-overlap-eager": ("contributors", 1, True, None, None),
    "sparseloco-delayed": ("contributors", 1, False, 1.0, 0.0),
    "sparseloco-delayed-own": ("contributors", 1, True, 1.0, 1.0),
}
VARIANTS = ("ddp", "diloco", *SPARSE_VARIANTS)
PRESETS: dict[str, dict[str, Any]] = {
    # The best learning rates of the grid recorded in BENCHMARKS.md (H = 15, 2 seeds); one seed, no grid.
    # ~35 CPU-seconds per method on one idle core of machine A (measured); about 3 min for the five methods.
    "quick": dict(
        model="300k",
        replicas=4,
        inner_steps=15,
        rounds=24,
        batch_size=8,
        seq_len=64,
        methods="ddp,diloco,sparseloco,sparseloco-all,sparseloco-recompress",
        seeds="0",
        lr_ddp="4e-3",
        lr_diloco="4e-3",
        lr_sparseloco="4e-3",
        outer_lr_grid="0.3",
    ),
    # The cost of overlapping: the synchronous schedule against the one-window-delayed outer step,
    # without and with the eager start, at the quick preset's point (same tokens, same H), 2 seeds.
    "delay": dict(
        model="300k",
        replicas=4,
        inner_steps=15,
        rounds=24,
        batch_size=8,
        seq_len=64,
        methods="sparseloco,sparseloco-overlap,sparseloco-overlap-eager,sparseloco-delayed,sparseloco-delayed-own",
        seeds="0,1",
        lr_sparseloco="4e-3",
        arrival=0.2,
        forecast_at=0.1,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (flags given override it)")
    p.add_argument("--data", default="builtin:stdlib", help="shard directory, text file/dir, or builtin:stdlib")
    p.add_argument("--model", default="1m", help=f"one of {sorted(BENCH_MODELS) + sorted(MODEL_PRESETS)}")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--pages", type=int, default=DataConfig.pages, help="data.pages: pages per replica per window")
    p.add_argument("--seeds", default="0", help="comma-separated; results are averaged over seeds")
    p.add_argument("--seed", type=int, help="a single seed (same as --seeds N)")
    p.add_argument("--methods", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--lr-grid", default="2e-3", help="inner lr grid for every method (comma-separated)")
    p.add_argument("--lr-ddp", help="inner lr grid for ddp only (overrides --lr-grid)")
    p.add_argument("--lr-diloco", help="inner lr grid for diloco only")
    p.add_argument("--lr-sparseloco", help="inner lr grid for every sparseloco variant")
    p.add_argument("--outer-lr-grid", default="0.3,0.5,0.7,1.0", help="DiLoCo outer lr grid")
    p.add_argument("--alpha", type=float, default=OuterConfig.alpha, help="SparseLoCo outer lr α")
    p.add_argument("--beta", type=float, default=OuterConfig.beta, help="SparseLoCo error-feedback decay")
    p.add_argument("--k", type=int, default=CodecConfig.k, help="Top-k per 4096 values")
    p.add_argument(
        "--warmup-k",
        type=int,
        default=OuterConfig.warmup_k,
        help="outer.warmup_k: Top-k of window 0 (default: the RunSpec default, %(default)s; 0: no warm-up)",
    )
    p.add_argument(
        "--warmup-windows",
        type=int,
        default=OuterConfig.warmup_windows,
        help="outer.warmup_windows: windows k takes to fall to --k (default: the RunSpec default, %(default)s)",
    )
    p.add_argument(
        "--forecast-wait",
        type=float,
        default=OuterConfig.forecast_wait,
        help="outer.forecast_wait: longest wait for every peer's contribution before a window's first step",
    )
    p.add_argument("--recompress-k", type=int, default=OuterConfig.recompress_k, help="the validator's Top-k")
    p.add_argument("--recompress-beta", type=float, default=OuterConfig.recompress_beta, help="its feedback decay")
    p.add_argument(
        "--arrival",
        type=float,
        default=0.2,
        help="overlap variants: fraction of a window's inner steps trained before the aggregate in flight arrives",
    )
    p.add_argument(
        "--forecast-at",
        type=float,
        default=0.1,
        help="eager variants: fraction of a window after which every peer's contribution is in the forecast",
    )
    p.add_argument("--aggregate", choices=("contributors", "all"), help="only this SparseLoCo aggregation")
    p.add_argument("--warmup", type=int, default=0, help="warm-up inner steps (0 = 10%% of the run)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy box)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--verbose", action="store_true", help="log every round to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--jsonl", help="append one JSON line per finished run to this file")
    p.add_argument("--plot", help="write validation-loss curves to this PNG")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.preset:  # preset values unless the flag was given explicitly
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        for key, value in PRESETS[args.preset].items():
            if key not in given:
                setattr(args, key, value)
    if args.seed is not None:
        args.seeds = str(args.seed)
    if args.aggregate:
        keep = {m for m, (agg, *_) in SPARSE_VARIANTS.items() if agg == args.aggregate}
        args.methods = ",".join(m for m in args.methods.split(",") if m not in SPARSE_VARIANTS or m in keep)
    unknown = sorted(set(args.methods.split(",")) - set(VARIANTS) - {""})
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    return args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def grid_for(method: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(inner lr, outer lr) pairs to try for one method."""
    own = {"ddp": args.lr_ddp, "diloco": args.lr_diloco}.get(method, args.lr_sparseloco)
    inner = _floats(own or args.lr_grid)
    outer = _floats(args.outer_lr_grid) if method == "diloco" else [args.alpha]
    return [(i, o) for i in inner for o in outer]


def sim_config(method: str, inner_lr: float, outer_lr: float, seed: int, args: argparse.Namespace) -> SimConfig:
    total = args.inner_steps * args.rounds
    inner = InnerConfig(
        steps=args.inner_steps, lr=inner_lr, warmup_steps=args.warmup or max(1, total // 10), total_steps=total
    )
    if method == "diloco":
        outer = OuterConfig(alpha=outer_lr, momentum=0.9, delay=0)
    elif method == "ddp":
        outer = OuterConfig(delay=0)
    else:
        agg, delay, eager, _, _ = SPARSE_VARIANTS[method]
        outer = OuterConfig(
            alpha=outer_lr,
            beta=args.beta,
            aggregation=agg,
            clip="median",
            delay=delay,
            eager=eager,
            recompress=method != "sparseloco-plain",
            recompress_from=1 if method == "sparseloco-recompress" else OuterConfig.recompress_from,
            recompress_k=args.recompress_k,
            recompress_beta=args.recompress_beta,
            warmup_k=args.warmup_k,
            warmup_windows=args.warmup_windows,
            forecast_wait=args.forecast_wait,
        )
    return SimConfig(
        method=method.split("-")[0],
        replicas=args.replicas,
        rounds=args.rounds,
        inner=inner,
        outer=outer,
        codec=CodecConfig(k=args.k),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        pages=args.pages,
        seed=seed,
        arrival=_timing(method, args)[0],
        forecast_at=_timing(method, args)[1],
    )


def _timing(method: str, args: argparse.Namespace) -> tuple[float, float]:
    """(arrival, forecast_at) of an overlapped variant (client/simulator.py); zeros otherwise."""
    if method not in SPARSE_VARIANTS:
        return 0.0, 0.0
    _, _, _, arrival, forecast_at = SPARSE_VARIANTS[method]
    return (
        float(args.arrival) if arrival is None else arrival,
        float(args.forecast_at) if forecast_at is None else forecast_at,
    )


def run_grid(method: str, args: argparse.Namespace, dataset: Any, mcfg: Any, log: Console) -> dict[str, Any]:
    """Every grid point on every seed; the best point by mean final validation loss."""
    seeds = [int(s) for s in args.seeds.split(",")]
    points = []
    for inner_lr, outer_lr in grid_for(method, args):
        runs: list[SimResult] = []
        cpu: list[float] = []
        for seed in seeds:
            t0, c0 = time.perf_counter(), time.process_time()
            sim = Simulator(mcfg, dataset, sim_config(method, inner_lr, outer_lr, seed, args), args.device)
            res = sim.run(
                on_round=(lambda r: log.log(f"  round {r.round}: val {r.val_loss:.4f}")) if args.verbose else None
            )
            runs.append(res)
            cpu.append(time.process_time() - c0)
            if args.jsonl:  # one line per finished run: partial results survive an interruption
                with open(args.jsonl, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "method": method,
                                "inner_lr": inner_lr,
                                "outer_lr": outer_lr,
                                "arrival": _timing(method, args)[0],
                                "forecast_at": _timing(method, args)[1],
                                "seed": seed,
                                "inner_steps": args.inner_steps,
                                "rounds": args.rounds,
                                "beta": args.beta,
                                "k": args.k,
                                "warmup_k": args.warmup_k,
                                "warmup_windows": args.warmup_windows,
                                "forecast_wait": args.forecast_wait,
                                "waited": res.waited,
                                "pages": args.pages,
                                "replicas": args.replicas,
                                "alpha": args.alpha,
                                "final_val_loss": res.final_val_loss,
                                "loss_curve": [r.val_loss for r in res.rounds],
                                "bytes_per_replica_per_round": res.bytes_per_replica_per_round,
                                "download_per_replica_per_round": res.download_per_replica_per_round,
                                "seconds": res.seconds,
                                "cpu_seconds": cpu[-1],
                            }
                        )
                        + "\n"
                    )
            log.log(
                f"{method:15s} lr={inner_lr:g} outer={outer_lr:g} seed={seed}: "
                f"val {res.final_val_loss:.4f} ({time.perf_counter() - t0:.0f} s)"
            )
        points.append({**summarize(inner_lr, outer_lr, seeds, runs), "cpu_seconds": statistics.fmean(cpu)})
    best = min(points, key=lambda p: p["final_val_loss"])
    grid = [{k: p[k] for k in ("inner_lr", "outer_lr", "final_val_loss", "final_val_loss_per_seed")} for p in points]
    return {**best, "grid": grid}


def summarize(inner_lr: float, outer_lr: float, seeds: list[int], runs: list[SimResult]) -> dict[str, Any]:
    curves = [[r.val_loss for r in res.rounds] for res in runs]
    curve = [statistics.fmean(vals) for vals in zip(*curves)]
    per_round = statistics.fmean(r.bytes_per_replica_per_round for r in runs)
    download = statistics.fmean(r.download_per_replica_per_round for r in runs)
    return {
        "inner_lr": inner_lr,
        "outer_lr": outer_lr,
        "seeds": seeds,
        "final_val_loss": curve[-1],
        "final_val_loss_per_seed": [c[-1] for c in curves],
        "initial_val_loss": statistics.fmean(r.initial_val_loss for r in runs),
        "loss_curve": curve,
        "bytes_per_replica_per_round": per_round,
        "total_bytes_per_replica": per_round * len(curve),
        "download_per_replica_per_round": download,
        "seconds": statistics.fmean(r.seconds for r in runs),
        "waited": statistics.fmean(r.waited for r in runs),
        "fingerprints": [r.fingerprint for r in runs],
    }


def render(out: dict[str, Any], console: Console) -> None:
    methods = out["methods"]
    dil = methods.get("diloco", {}).get("bytes_per_replica_per_round")
    plain = methods.get("sparseloco")
    table = Table(title=f"quality: {out['config']['summary']}")
    for col in (
        "method",
        "inner lr",
        "outer lr",
        "final val loss",
        "per seed",
        "vs sparseloco loss",
        "upload/replica/round",
        "vs DiLoCo upload",
        "download/replica/round",
        "vs sparseloco download",
        "waited",
        "s/run",
        "cpu s/run",
    ):
        table.add_column(col, justify="right" if col != "method" else "left")
    for name, m in methods.items():
        ratio = f"{dil / m['bytes_per_replica_per_round']:.3g}× fewer" if dil else "-"
        loss_vs = f"{100 * (m['final_val_loss'] / plain['final_val_loss'] - 1):+.2f} %" if plain else "-"
        down_vs = (
            f"{plain['download_per_replica_per_round'] / m['download_per_replica_per_round']:.3g}× fewer"
            if plain
            else "-"
        )
        table.add_row(
            name,
            f"{m['inner_lr']:g}",
            f"{m['outer_lr']:g}",
            f"{m['final_val_loss']:.4f}",
            " ".join(f"{v:.3f}" for v in m["final_val_loss_per_seed"]),
            loss_vs,
            f"{m['bytes_per_replica_per_round']:,.0f}",
            ratio,
            f"{m['download_per_replica_per_round']:,.0f}",
            down_vs,
            f"{100 * m['waited']:.0f} % of H",
            f"{m['seconds']:.0f}",
            f"{m['cpu_seconds']:.0f}",
        )
    console.print(table)
    grid = Table(title="grid (mean final val loss over seeds)")
    for col in ("method", "inner lr", "outer lr", "final val loss"):
        grid.add_column(col)
    for name, m in methods.items():
        for g in m["grid"]:
            grid.add_row(name, f"{g['inner_lr']:g}", f"{g['outer_lr']:g}", f"{g['final_val_loss']:.4f}")
    console.print(grid)
    curves = Table(title="validation loss per round (best configuration, mean over seeds)")
    curves.add_column("round")
    for name in methods:
        curves.add_column(name, justify="right")
    n = len(next(iter(methods.values()))["loss_curve"])
    for i in range(n):
        curves.add_row(str(i + 1), *(f"{m['loss_curve'][i]:.4f}" for m in methods.values()))
    console.print(curves)


# ----------------------------------------------------------------------------- PNG without matplotlib
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75)]


def write_png(path: str, curves: dict[str, list[float]], width: int = 640, height: int = 400) -> list[str]:
    """Line plot of the curves (no text: returns the legend lines, colour per method)."""
    img = [[255, 255, 255] * width for _ in range(height)]
    lo = min(min(c) for c in curves.values())
    hi = max(max(c) for c in curves.values())
    n = max(len(c) for c in curves.values())
    pad = 30

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            img[y][3 * x : 3 * x + 3] = list(rgb)

    def xy(i: int, v: float) -> tuple[float, float]:
        fx = pad + (width - 2 * pad) * i / max(1, n - 1)
        fy = height - pad - (height - 2 * pad) * (v - lo) / max(hi - lo, 1e-9)
        return fx, fy

    for x in range(pad, width - pad):
        put(x, height - pad, (0, 0, 0))
    for y in range(pad, height - pad):
        put(pad, y, (0, 0, 0))
    legend = []
    for (name, curve), rgb in zip(curves.items(), COLORS):
        legend.append(f"{name}: rgb{rgb}")
        for i in range(len(curve) - 1):
            (x0, y0), (x1, y1) = xy(i, curve[i]), xy(i + 1, curve[i + 1])
            steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
            for s in range(steps + 1):
                x, y = x0 + (x1 - x0) * s / steps, y0 + (y1 - y0) * s / steps
                for dy in (0, 1):
                    put(int(x), int(y) + dy, rgb)
    raw = b"".join(b"\x00" + bytes(row) for row in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)
    return legend


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Console(stderr=True)
    overrides = BENCH_MODELS.get(args.model)
    mcfg = model_config("tiny", **overrides) if overrides else model_config(args.model)
    mcfg = replace(mcfg, max_seq_len=max(mcfg.max_seq_len, args.seq_len))
    data = DataConfig(seq_len=args.seq_len, batch_size=args.batch_size)
    dataset = open_dataset(data, args.data)
    n_params = sum(math.prod(shape) for shape in param_schema(mcfg).values())
    summary = (
        f"model {args.model} ({n_params / 1e6:.2f} M params), R={args.replicas}, H={args.inner_steps}, "
        f"{args.rounds} rounds, {args.batch_size}×{args.seq_len} tokens/replica/step, {args.pages} pages/replica/window, "
        f"seeds {args.seeds}"
    )
    if args.warmup_k:
        summary += f", Top-k warm-up k={args.warmup_k}→{args.k} over {args.warmup_windows} rounds"
    if "sparseloco-recompress" in args.methods:
        summary += f", re-compression k={args.recompress_k} β={args.recompress_beta:g}"
    t0 = time.perf_counter()
    methods = {m: run_grid(m, args, dataset, mcfg, log) for m in args.methods.split(",") if m}
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    out = {
        "config": {**config, "params": n_params, "summary": summary, "data_digest": dataset.digest},
        "methods": methods,
        "seconds": time.perf_counter() - t0,
    }
    if args.plot:
        legend = write_png(args.plot, {n: m["loss_curve"] for n, m in methods.items()})
        out["plot"] = {"path": args.plot, "legend": legend}
        log.log(f"wrote {args.plot}: " + ", ".join(legend))
    if args.json:
        print(json.dumps(out))
    else:
        render(out, Console(width=160))
    return 0


if __name__ == "__main__":
    sys.exit(main())
