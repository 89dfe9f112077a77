"""Decode allocation: the peak memory each decode path allocates for one object, × its size.

    python scripts/bench_decode_alloc.py            # rich table
    python scripts/bench_decode_alloc.py --json     # one JSON object

Inputs, each a valid signed object: the densest contribution there is (one tensor of 16,384,000
values, every chunk keeping positions 0–63: 3 bits per value, ~101 KiB), as a vector and as a
tiled 8000 × 2048 matrix; an honest contribution of the ``small`` preset (Student-t noise, 25.6 M
parameters); a plain aggregate holding every second position of a 1,638,400-value tensor.

Paths: ``decode`` (:func:`protocol.wire.decode_object`: envelope, tables, codec payloads),
``to_sparse`` (flat positions and values of every tensor, after ``decode``), ``screen`` (the
validator's per-contribution checks on the raw bytes, with the tensor's schema), ``inspect``
(:func:`client.inspect.inspect_bytes`). Peaks are tracemalloc's (numpy and Python allocations;
torch's own allocator is invisible to it, which is why the CPU paths build their results in numpy).
The parser fuzz tests (tests/test_fuzz_parsers.py) assert ≤ 96 × input + 1 MiB on every path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from wire_samples import BASE, CODEC, PEER, RUN, VALIDATOR, aggregate

from client.inspect import inspect_bytes
from protocol import codec
from protocol.codec.chunking import geometry
from protocol.config import model_config
from protocol.model import param_schema
from protocol.wire import Contribution, SparseDelta, decode_object, encode_aggregate, encode_contribution
from protocol.wire.delta import round_values
from validator import checks

CAP = 1 << 30
NUMEL = 16_384_000


def crafted(shape: tuple[int, ...]) -> tuple[bytes, dict[str, tuple[int, ...]]]:
    g = geometry(shape, CODEC)
    idx = torch.arange(g.k_full).repeat(g.n_chunks)
    codes = torch.arange(g.nnz).remainder(4).to(torch.uint8)
    enc = codec.Encoded(shape, CODEC, idx, codes, torch.full((g.n_chunks, 2), 200, dtype=torch.uint8), 1.0)
    return encode_contribution(Contribution(RUN, 7, BASE, CODEC, {"w": enc}, {}), PEER), {"w": shape}


def honest() -> tuple[bytes, dict[str, tuple[int, ...]]]:
    schema = {n: tuple(s) for n, s in param_schema(model_config("small")).items()}
    gen = torch.Generator().manual_seed(0)
    t = torch.distributions.StudentT(3.0)
    tensors = {}
    for name, shape in schema.items():
        torch.manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
        tensors[name] = codec.encode(t.sample(shape), CODEC)
    return encode_contribution(Contribution(RUN, 7, BASE, CODEC, tensors, {}), PEER), schema


def plain_aggregate() -> bytes:
    idx = torch.arange(0, 1_638_400, 2)
    tensors = {"w": SparseDelta((1_638_400,), idx, round_values(torch.full((idx.numel(),), 0.5)))}
    return encode_aggregate(dataclasses.replace(aggregate(), tensors=tensors), VALIDATOR)


def peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return top


def measure(name: str, data: bytes, schema: dict[str, tuple[int, ...]] | None) -> dict[str, Any]:
    obj = decode_object(data, max_bytes=CAP)
    paths: dict[str, Callable[[], Any]] = {"decode": lambda: decode_object(data, max_bytes=CAP)}
    if schema is not None:
        tensors = obj.value.tensors
        paths["to_sparse"] = lambda: [codec.to_sparse(e) for e in tensors.values()]
        ctx = checks.Context(
            run_hash=RUN,
            window=7,
            expected_base=BASE,
            codec=CODEC,
            schema=schema,
            max_bytes=CAP,
            registered=frozenset({PEER.peer_id}),
        )
        paths["screen"] = lambda: checks.screen(PEER.peer_id, data, ctx)
    paths["inspect"] = lambda: inspect_bytes(data, max_bytes=CAP)
    out: dict[str, Any] = {"input": name, "bytes": len(data), "bound": 96 * len(data) + (1 << 20)}
    for path, fn in paths.items():
        top = min(peak(fn) for _ in range(2))
        out[path] = {"peak_bytes": top, "x_input": round(top / len(data), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [
        measure("crafted vector 16,384,000", *crafted((NUMEL,))),
        measure("crafted tiled 8000x2048", *crafted((8000, 2048))),
        measure("honest small (25.6 M)", *honest()),
        measure("plain aggregate, 1/2 dense", plain_aggregate(), None),
    ]
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decode allocation: peak bytes (× input)")
    for col in ("input", "bytes", "decode", "to_sparse", "screen", "inspect", "bound ×"):
        table.add_column(col, justify="left" if col == "input" else "right")
    for r in rows:
        cells = [
            f"{r[p]['peak_bytes']:,} ({r[p]['x_input']}×)" if p in r else "-"
            for p in ("decode", "to_sparse", "screen", "inspect")
        ]
        table.add_row(r["input"], f"{r['bytes']:,}", *cells, f"{math.floor(r['bound'] / r['bytes'])}")
    Console().print(table)


if __name__ == "__main__":
    main()
