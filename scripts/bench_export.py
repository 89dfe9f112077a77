#!/usr/bin/env python
"""Cost of ``sparseloco export`` per parameter, projected to a 1B-parameter model.

For each model size, a checkpoint is published into a directory store exactly as the validator
publishes one (``validator.publish.publish_checkpoint``: fp32 safetensors + signed manifest), then
the two phases of an export are timed separately, ``--repeats`` times each (median):

  verify   ``client.checkpoints.load_checkpoint``: read the manifest and check its signature, read
           the weights file and check its size and sha256, parse it, check θ's fingerprint
  write    ``client.export.export_hf``: map θ to Llama names, cast (fp32 or bf16), write
           ``model.safetensors`` (temporary file + rename), config and tokenizer files

The cost is linear in the parameter count (hashing, parsing, casting and writing bytes), so the
projection to 1B parameters is the least-squares line through the measured sizes, evaluated at
10⁹: seconds = intercept + slope · 10⁹. Wall time on this machine; the disk is the store's and
the export's (a page-cache read of a file written just before: no cold-disk reads).

    python scripts/bench_export.py                       # sizes 10m,50m,150m; ~2 min on 2 CPU cores
    python scripts/bench_export.py --sizes 10m,50m --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from client.checkpoints import load_checkpoint, locate
from client.export import export_hf
from protocol import layout
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.model import build_model, param_schema
from protocol.store import open_store
from validator.publish import publish_checkpoint

BILLION = 1_000_000_000
# Byte-token LLaMA shapes (vocab 256 keeps the tokenizer files trivial; the cost is per parameter).
SIZES: dict[str, dict[str, Any]] = {
    "10m": dict(dim=512, n_layers=3, n_heads=8, ffn_dim=1376, max_seq_len=512),
    "50m": dict(dim=768, n_layers=7, n_heads=12, ffn_dim=2048, max_seq_len=1024),
    "150m": dict(dim=1024, n_layers=12, n_heads=16, ffn_dim=2816, max_seq_len=1024),
    "300m": dict(dim=1280, n_layers=16, n_heads=16, ffn_dim=3456, max_seq_len=1024),
}
VALIDATOR = Identity.from_seed(bytes(range(32)))


def measure(name: str, repeats: int, workdir: Path) -> dict[str, Any]:
    """Median verify and write seconds of one model size."""
    spec = RunSpec.from_dict(
        {
            "model": {"preset": "tiny", **SIZES[name]},
            "validator": {"public_keys": [VALIDATOR.public_key_hex]},
        }
    )
    store_url = f"file://{workdir / name / 'store'}"
    n_params = sum(_numel(s) for s in param_schema(spec.model).values())
    params = {n: p.detach() for n, p in build_model(spec.model).named_parameters()}
    with open_store(store_url) as store:
        publish_checkpoint(
            store,
            layout.run_id(spec.hash()),
            spec.hash(),
            1,
            aggregate="ab" * 32,  # a checkpoint after window 0 names its aggregate and launch
            launch="cd" * 32,
            params=params,
            identity=VALIDATOR,
            published_at=time.time(),
        )
    del params
    loc = locate(spec, None, store_url=store_url, window=1)
    verify, write = [], {"fp32": [], "bf16": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        ckpt = load_checkpoint(spec, loc)
        verify.append(time.perf_counter() - t0)
        for dtype, times in write.items():
            out = workdir / name / f"hf-{dtype}"
            t0 = time.perf_counter()
            export_hf(ckpt, spec, out, dtype=dtype)
            times.append(time.perf_counter() - t0)
            shutil.rmtree(out)
        del ckpt
    shutil.rmtree(workdir / name)
    return {
        "size": name,
        "parameters": n_params,
        "verify_s": statistics.median(verify),
        "write_fp32_s": statistics.median(write["fp32"]),
        "write_bf16_s": statistics.median(write["bf16"]),
    }


def project(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Least-squares seconds = a + b · parameters; the value at 10⁹ parameters."""
    xs = [r["parameters"] for r in rows]
    ys = [r[key] for r in rows]
    if len(rows) == 1:
        slope, intercept = ys[0] / xs[0], 0.0
    else:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
    return {"ns_per_param": slope * 1e9, "intercept_s": intercept, "per_billion_s": intercept + slope * BILLION}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10m,50m,150m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        sys.exit(f"unknown size(s) {unknown}; known: {', '.join(SIZES)}")
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        rows = [measure(s, args.repeats, Path(tmp)) for s in sizes]
    for r in rows:
        r["total_fp32_s"] = r["verify_s"] + r["write_fp32_s"]
        r["total_bf16_s"] = r["verify_s"] + r["write_bf16_s"]
    keys = ("verify_s", "write_fp32_s", "write_bf16_s", "total_fp32_s", "total_bf16_s")
    result = {
        "sizes": rows,
        "projection_1b": {k.removesuffix("_s"): project(rows, k) for k in keys},
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    t = Table(title="sparseloco export: median seconds per phase")
    for c in ("size", "parameters", "verify", "write fp32", "write bf16", "total fp32", "total bf16"):
        t.add_column(c, justify="left" if c == "size" else "right")
    for r in rows:
        t.add_row(r["size"], f"{r['parameters']:,}", *(f"{r[k]:.3f}" for k in keys))
    p = result["projection_1b"]
    t.add_row("1B (projected)", f"{BILLION:,}", *(f"{p[k.removesuffix('_s')]['per_billion_s']:.1f}" for k in keys))
    t.add_row("ns / parameter", "", *(f"{p[k.removesuffix('_s')]['ns_per_param']:.2f}" for k in keys))
    Console(highlight=False, width=140).print(t)
    print(json.dumps(result))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
