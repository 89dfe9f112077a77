#!/usr/bin/env python
"""Aggregate size benchmark: what every peer downloads per window, plain and re-compressed.

    python scripts/bench_aggregate.py                    # table; LLaMA-shaped preset "tiny" (3.3 M)
    python scripts/bench_aggregate.py --json             # one JSON object
    python scripts/bench_aggregate.py --model small --n 16,64 --overlap 0.3

Contributions are synthetic with the Top-k overlap of honest peers: contributor ``j`` sends the
codec's Top-k + 2-bit encoding of ``x_j = √ρ·s + √(1−ρ)·n_j`` per tensor, with ``s`` shared by
all and ``n_j`` its own (standard normal). ``ρ = --overlap`` sets how much their Top-k sets agree;
the default 0.27 reproduces the union densities measured on honest peers of real runs (0.20 at
N = 16, 0.49–0.53 at 64, 0.65 at 128); the table reports the densities it got. The first N
contributions are aggregated as the validator does (median-norm clip, mean over contributors),
and Δ̄ is published:

* ``v1``: the previous format — varint-coded index gaps and a float32 value per kept position
  (sized from its definition, not written);
* ``plain``: the current aggregate — per tensor the smaller of a Golomb-coded index set and a
  bitmap, and bfloat16 values (``protocol.wire.delta``), a real signed object;
* ``recompressed``: ``outer.recompress`` — Top-k (``--recompress-k``) + 2-bit codes of the
  validator's error-feedback buffer, a real signed object (the buffer starts empty; its size does
  not depend on what the buffer holds: k values per chunk are sent);
* ``N contributions``: downloading the N signed contributions instead — the exact alternative
  (the aggregate as the contributors' codes and scales recombined) — and ``dense``: a float32 Δ.

``peer_download_bytes_per_param`` is what one peer downloads per window in steady state: the one
aggregate (checkpoints are read only when joining or resynchronising); ``upload`` is one
contribution. "at 1B" multiplies by 10⁹ parameters. Every signed aggregate is decoded again and
checked to give exactly the Δ̄ the validator applies.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from protocol.aggregate import SparseDict, aggregate, sparse_of
from protocol.broadcast import applied, publishable
from protocol.caps import object_caps
from protocol.chain import delta_of
from protocol.codec import Encoded, encode
from protocol.config import MODEL_PRESETS, CodecConfig, OuterConfig, RunSpec, model_config
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import param_schema
from protocol.wire import GENESIS, Aggregate, Contribution, ManifestEntry, decode_aggregate, encode_aggregate
from protocol.wire import encode_contribution as encode_contrib

RUN = "0" * 64
VALIDATOR = Identity.from_seed(b"bench-aggregate validator key 32")
GIGA = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"a model preset: {sorted(MODEL_PRESETS)}")
    p.add_argument("--n", default="16,64,256", help="contributor counts (comma-separated)")
    p.add_argument("--overlap", type=float, default=0.27, help="ρ: the shared part of every contribution")
    p.add_argument("--k", type=int, default=64, help="contributions: Top-k per 4096")
    p.add_argument(
        "--recompress-k", default="64,128,256", help="re-compressed aggregate: Top-k per 4096 (comma-separated)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- contributions
@dataclass(frozen=True)
class Contributions:
    sparse: list[SparseDict]  # what the validator aggregates, in peer order
    upload_bytes: list[int]  # each one's signed size


def make_contributions(
    schema: dict[str, tuple[int, ...]], n: int, rho: float, cfg: CodecConfig, seed: int, log: Console
) -> Contributions:
    g = torch.Generator().manual_seed(seed)
    shared = {name: torch.randn(shape, generator=g) for name, shape in sorted(schema.items())}
    a, b = math.sqrt(rho), math.sqrt(1.0 - rho)
    sparse, sizes = [], []
    t0 = time.perf_counter()
    for j in range(n):
        tensors: dict[str, Encoded] = {}
        for name, s in shared.items():
            tensors[name] = encode(a * s + b * torch.randn(s.shape, generator=g), cfg)
        sender = Identity.from_seed(j.to_bytes(4, "big") * 8)
        sizes.append(len(encode_contrib(Contribution(RUN, 0, GENESIS, cfg, tensors, {}), sender)))
        sparse.append(sparse_of(tensors))
        if (j + 1) % 32 == 0:
            log.log(f"  {j + 1}/{n} contributions ({time.perf_counter() - t0:.0f} s)")
    return Contributions(sparse, sizes)


# ----------------------------------------------------------------------------- sizes
def v1_nbytes(delta: SparseDict) -> int:
    """Payload of the previous aggregate format: varint index gaps + float32 values."""
    total = 0
    for idx, _ in delta.values():
        i = idx.numpy().astype(np.int64)
        gaps = np.diff(i, prepend=np.int64(-1)) - 1
        nbytes = np.ones(gaps.size, dtype=np.int64)
        for p in range(1, 6):
            nbytes += gaps >= (1 << (7 * p))
        total += int(nbytes.sum()) + 4 * i.size
    return total


def publish(
    delta: SparseDict, schema: dict[str, tuple[int, ...]], outer: OuterConfig, cfg: CodecConfig, n: int
) -> dict[str, Any]:
    """Sign Δ̄'s published form, decode it as a peer does and check it is what the validator applies."""
    t0 = time.perf_counter()
    steady = outer.warmup_windows  # the first window at codec.k, after any Top-k warm-up
    tensors, _ = publishable(delta, schema, outer, cfg, FeedbackState(), contributors=n, window=steady)
    manifest = tuple(ManifestEntry(Identity.from_seed(j.to_bytes(4, "big") * 8).peer_id, RUN, 1.0) for j in range(n))
    blob = encode_aggregate(Aggregate(RUN, 0, GENESIS, 1.0, RUN, manifest, tensors, 1.0), VALIDATOR)
    t1 = time.perf_counter()
    received = decode_aggregate(blob, run_hash=RUN, max_bytes=len(blob), allowed_signers=None, schema=schema)
    t2 = time.perf_counter()
    mine, theirs = applied(tensors), delta_of(received.value)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k][0], theirs[k][0]) and torch.equal(mine[k][1], theirs[k][1]) for k in mine)
    return {"bytes": len(blob), "encode_s": t1 - t0, "decode_s": t2 - t1, "applied": mine}


def rel_error(delta: SparseDict, applied_delta: SparseDict, schema: dict[str, tuple[int, ...]]) -> float:
    """‖Δ̄ − applied‖ / ‖Δ̄‖ over all tensors (dense)."""
    num = den = 0.0
    for name, shape in schema.items():
        ref = torch.zeros(math.prod(shape), dtype=torch.float64)
        got = torch.zeros_like(ref)
        if name in delta:
            ref[delta[name][0]] = delta[name][1].double()
        if name in applied_delta:
            got[applied_delta[name][0]] = applied_delta[name][1].double()
        num += float((ref - got).square().sum())
        den += float(ref.square().sum())
    return math.sqrt(num / den) if den else 0.0


def measure(args: argparse.Namespace, log: Console) -> dict[str, Any]:
    cfg = CodecConfig(k=args.k)
    mcfg = model_config(args.model)
    schema = param_schema(mcfg)
    params = sum(math.prod(s) for s in schema.values())
    counts = sorted(int(x) for x in args.n.split(",") if x)
    log.log(f"{args.model}: {params / 1e6:.2f} M parameters, {len(schema)} tensors; {max(counts)} contributions")
    contribs = make_contributions(schema, max(counts), args.overlap, cfg, args.seed, log)
    plain_outer = OuterConfig(recompress=False)
    recompress_ks = [int(k) for k in args.recompress_k.split(",") if k]
    rows = []
    for n in counts:
        t0 = time.perf_counter()
        delta = aggregate(contribs.sparse[:n], "contributors", "median")
        agg_s = time.perf_counter() - t0
        nnz = sum(len(i) for i, _ in delta.values())
        plain = publish(delta, schema, plain_outer, cfg, n)
        upload = sum(contribs.upload_bytes[:n]) / n
        spec = RunSpec.from_dict(
            {"model": {"preset": args.model}, "codec": {"k": args.k}, "validator": {"max_contributors": n}}
        )
        recompressed = {}
        for k in recompress_ks:
            got = publish(delta, schema, OuterConfig(recompress=True, recompress_from=1, recompress_k=k), cfg, n)
            spec_re = spec.replace(outer={"recompress": True, "recompress_k": k})
            recompressed[str(k)] = {
                "aggregate_bytes_per_param": got["bytes"] / params,
                "peer_download_bytes_per_param": got["bytes"] / params,
                "encode_seconds": got["encode_s"],
                "decode_seconds": got["decode_s"],
                "value_rel_error_one_window": rel_error(delta, got["applied"], schema),
                "cap_bytes_per_param": object_caps(spec_re).aggregate / params,
            }
        row = {
            "n": n,
            "union_density": nnz / params,
            "aggregate_seconds": agg_s,
            "upload_bytes_per_param": upload / params,
            "v1": {"aggregate_bytes_per_param": v1_nbytes(delta) / params},
            "plain": {
                "aggregate_bytes_per_param": plain["bytes"] / params,
                "peer_download_bytes_per_param": plain["bytes"] / params,
                "encode_seconds": plain["encode_s"],
                "decode_seconds": plain["decode_s"],
                "value_rel_error": rel_error(delta, plain["applied"], schema),
                "cap_bytes_per_param": object_caps(spec).aggregate / params,
            },
            "recompressed": recompressed,
            "n_contributions": {"peer_download_bytes_per_param": upload * n / params},
            "dense_fp32": {"peer_download_bytes_per_param": 4.0},
        }
        rows.append(row)
        log.log(f"N={n}: density {row['union_density']:.3f}, plain {plain['bytes'] / params:.3f} B/param")
    config = {
        "model": args.model,
        "params": params,
        "tensors": len(schema),
        "k": args.k,
        "recompress_k": recompress_ks,
        "overlap": args.overlap,
        "seed": args.seed,
    }
    return {"config": config, "rows": rows}


def render(out: dict[str, Any], console: Console) -> None:
    c = out["config"]
    table = Table(
        title=f"aggregate per window: {c['model']} ({c['params'] / 1e6:.2f} M params, {c['tensors']} tensors), "
        f"contributions k = {c['k']}, overlap ρ = {c['overlap']}"
    )
    cols = (
        "N",
        "union density",
        "encoding",
        "aggregate B/param",
        "download per peer at 1B",
        "vs plain",
        "vs v1",
        "cap B/param",
        "decode s",
        "rel. error (one window)",
    )
    for col in cols:
        table.add_column(col, justify="right" if col != "encoding" else "left")
    for r in out["rows"]:
        plain = r["plain"]["aggregate_bytes_per_param"]
        v1 = r["v1"]["aggregate_bytes_per_param"]
        entries = [
            ("v1: varint + float32", v1, None, None, None),
            (
                "plain: coded indices + bf16",
                plain,
                r["plain"]["cap_bytes_per_param"],
                r["plain"]["decode_seconds"],
                r["plain"]["value_rel_error"],
            ),
        ]
        for k, e in r["recompressed"].items():
            entries.append(
                (
                    f"re-compressed k={k}",
                    e["aggregate_bytes_per_param"],
                    e["cap_bytes_per_param"],
                    e["decode_seconds"],
                    e["value_rel_error_one_window"],
                )
            )
        entries.append(("N contributions", r["n_contributions"]["peer_download_bytes_per_param"], None, None, 0.0))
        entries.append(("dense float32 Δ", 4.0, None, None, None))
        for i, (name, bpp, cap, dec_s, err) in enumerate(entries):
            table.add_row(
                str(r["n"]) if i == 0 else "",
                f"{r['union_density']:.3f}" if i == 0 else "",
                name,
                f"{bpp:.4f}",
                f"{bpp * GIGA / 1e9:.3f} GB",
                f"{plain / bpp:.1f}× smaller" if bpp < plain else f"{bpp / plain:.2f}× larger" if bpp > plain else "–",
                f"{v1 / bpp:.2f}×" if name != "v1: varint + float32" else "–",
                "" if cap is None else f"{cap:.3f}",
                "" if dec_s is None else f"{dec_s:.2f}",
                "" if err is None else f"{err:.1e}" if err < 0.01 else f"{err:.2f}",
            )
        table.add_section()
    console.print(table)
    console.print(f"upload per peer (one signed contribution): {out['rows'][0]['upload_bytes_per_param']:.4f} B/param")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Console(stderr=True)
    out = measure(args, log)
    if args.json:
        print(json.dumps(out))
    else:
        render(out, Console(width=200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
