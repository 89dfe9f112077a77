"""Storage growth of a run per window, with and without the validator's retention policy.

    python scripts/bench_storage.py                       # rich table: 1b projected from "small"
    python scripts/bench_storage.py --json                # one JSON object
    python scripts/bench_storage.py --measure tiny --target 1b --peers 8,32,128 --retain-windows 16

Measured on the ``--measure`` model (its parameter shapes, Student-t (ν = 3) values as in
``bench_codec.py``), as bytes per parameter of the objects as they lie in a store:

* a contribution: the whole signed envelope of ``protocol.wire.encode_contribution`` with the
  RunSpec's default codec (chunk-wise Top-k, 2-bit values, Rice-coded indices);
* an aggregate of n contributions: ``validator.publish.encode_window_aggregate`` of the mean over
  contributors of n peers' decoded contributions in its plain published form
  (``protocol.broadcast.plain``: coded index sets, bfloat16 values; ``outer.recompress`` makes it
  contribution-sized, see ``scripts/bench_aggregate.py``) (their Top-k picks are independent here, so the
  union of their indices, and the aggregate, is as large as it gets; real peers overlap more);
* a checkpoint: ``validator.publish.weights_bytes`` (fp32 safetensors) plus its signed manifest.

Projected to the ``--target`` model's parameter count: per window, N contributions, one
aggregate of N and a checkpoint every ``checkpoint_every`` windows (amortised). Aggregates for N
beyond the measured ones use the measured bytes per kept coordinate and the expected union of N
independent picks, 1 − (1 − ρ)^N (ρ: one contribution's density); the JSON holds the check of that
model against the measured n.

With retention (``validator.retain_windows`` K, ``retain_checkpoint_every`` M; checkpoint_every
E), a run keeps at most K windows of contributions, K + E − 1 aggregates (from the anchor
checkpoint on), the checkpoints from the anchor on (at most ⌊(K + E − 1)/E⌋ + 1) plus genesis, and
every M-th checkpoint: the only growth left is one archived checkpoint per M windows.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from protocol import codec, wire
from protocol.aggregate import aggregate, sparse_of
from protocol.broadcast import plain
from protocol.config import CodecConfig, WindowConfig, model_config
from protocol.identity import Identity
from protocol.model import param_schema
from validator.publish import encode_window_aggregate, weights_bytes

HEX = "ab" * 32


def student_t(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Heavy-tailed pseudo-gradient stand-ins, a per-tensor scale each (as bench_codec.py)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        scale = 1e-3 * float(torch.empty(1).uniform_(0.3, 3.0, generator=gen))
        normal = torch.randn(shape, generator=gen)
        chi2 = torch.randn((3, *shape), generator=gen).square().sum(0) / 3
        out[name] = normal / chi2.sqrt() * scale
    return out


def measure(preset: str, max_n: int) -> dict[str, Any]:
    """Bytes of a contribution, aggregates of 1, 2, 4 … ``max_n`` contributions and a checkpoint
    of the ``preset`` model, per parameter."""
    shapes = param_schema(model_config(preset))
    n_params = sum(math.prod(s) for s in shapes.values())
    cfg = CodecConfig()
    peers = [Identity.generate() for _ in range(max_n)]
    contribs, sparse, sizes = [], [], []
    for i, peer in enumerate(peers):
        encoded = {n: codec.encode(t, cfg) for n, t in student_t(shapes, seed=i).items()}
        c = wire.Contribution(HEX, 7, HEX, cfg, encoded, {"tokens": 123456, "loss": 3.25})
        sizes.append(len(wire.encode_contribution(c, peer)))
        contribs.append(c)
        sparse.append(sparse_of(encoded))
    nnz_one = sum(int(idx.numel()) for idx, _ in sparse[0].values())
    validator = Identity.generate()
    aggregates = {}
    n = 1
    while n <= max_n:
        delta = aggregate(sparse[:n], mode="contributors", clip="none")
        blob = encode_window_aggregate(
            run_hash=HEX,
            window=7,
            base=HEX,
            alpha=1.0,
            tensors=dict(plain(delta, shapes)),
            manifest=[(p.peer_id, HEX, 1.0) for p in peers[:n]],
            fingerprint_next=HEX,
            published_at=1.7e9,
            metadata={"secret": HEX, "commitment": HEX, "root": HEX, "accepted": n, "rejected": 0, "val_loss": 3.2},
            identity=validator,
        )
        nnz = sum(int(idx.numel()) for idx, _ in delta.values())
        aggregates[n] = {"bytes": len(blob), "nnz": nnz}
        n *= 2
    theta = student_t(shapes, seed=10_000)
    ckpt = len(weights_bytes(theta, window=7))
    manifest = _manifest_bytes(validator, ckpt)
    return {
        "preset": preset,
        "params": n_params,
        "density": nnz_one / n_params,
        "contribution_bytes_per_param": sum(sizes) / len(sizes) / n_params,
        "aggregate": {
            str(k): {**v, "bytes_per_param": v["bytes"] / n_params, "bytes_per_nnz": v["bytes"] / max(v["nnz"], 1)}
            for k, v in aggregates.items()
        },
        "checkpoint_bytes_per_param": ckpt / n_params,
        "checkpoint_manifest_bytes": manifest,
    }


def _manifest_bytes(identity: Identity, weights: int) -> int:
    files = (wire.CheckpointFile("0123456789abcdef/checkpoint/00000007/model.safetensors", HEX, weights),)
    m = wire.CheckpointManifest(HEX, 7, HEX, HEX, files, 1.7e9, launch=HEX)
    return len(wire.encode_checkpoint(m, identity))


def aggregate_per_param(measured: Mapping[str, Any], n: int) -> float:
    """Bytes per parameter of an aggregate of ``n``: measured when it was, else the measured bytes
    per kept coordinate (of the largest n measured) times the expected union of n picks."""
    agg = measured["aggregate"]
    if str(n) in agg:
        return float(agg[str(n)]["bytes_per_param"])
    largest = agg[max(agg, key=int)]
    union = 1 - (1 - measured["density"]) ** n
    return float(largest["bytes_per_nnz"]) * union


def project(
    measured: Mapping[str, Any], target: str, peers: list[int], retain_windows: int, archive_every: int, every: int
) -> dict[str, Any]:
    """Per-window growth and steady footprint at ``target`` for each N in ``peers``."""
    n_params = sum(math.prod(s) for s in param_schema(model_config(target)).values())
    contribution = measured["contribution_bytes_per_param"] * n_params
    checkpoint = measured["checkpoint_bytes_per_param"] * n_params + measured["checkpoint_manifest_bytes"]
    rows = []
    for n in peers:
        agg = aggregate_per_param(measured, n) * n_params
        per_window = n * contribution + agg + checkpoint / every
        kept_aggregates = retain_windows + every - 1
        kept_checkpoints = (retain_windows + every - 1) // every + 1 + 1  # from the anchor on, and genesis
        steady = retain_windows * n * contribution + kept_aggregates * agg + kept_checkpoints * checkpoint
        growth = checkpoint / archive_every if archive_every else 0.0
        rows.append(
            {
                "peers": n,
                "contributions_per_window": n * contribution,
                "aggregate_per_window": agg,
                "checkpoint_amortised_per_window": checkpoint / every,
                "growth_per_window": per_window,
                "after_1000_windows": 1000 * per_window,
                "retained_growth_per_window": growth,
                "retained_steady_bytes": steady,
                "retained_after_1000_windows": steady + 1000 * growth,
            }
        )
    return {
        "target": target,
        "params": n_params,
        "contribution_bytes": contribution,
        "checkpoint_bytes": checkpoint,
        "checkpoint_every": every,
        "retain_windows": retain_windows,
        "retain_checkpoint_every": archive_every,
        "rows": rows,
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def table(result: Mapping[str, Any]) -> Table:
    p = result["projection"]
    t = Table(
        title=f"storage per window at {p['target']} ({p['params'] / 1e9:.2f} B params), checkpoint every "
        f"{p['checkpoint_every']}; retention: last {p['retain_windows']} windows, every "
        f"{p['retain_checkpoint_every']}-th checkpoint"
    )
    for col in (
        "peers N",
        "contribs × N",
        "aggregate",
        "checkpoint (amortised)",
        "growth / window",
        "after 1000 windows",
        "retained: growth / window",
        "retained: steady",
        "retained: after 1000",
    ):
        t.add_column(col, justify="right")
    for r in p["rows"]:
        t.add_row(
            str(r["peers"]),
            _gib(r["contributions_per_window"]),
            _gib(r["aggregate_per_window"]),
            _gib(r["checkpoint_amortised_per_window"]),
            _gib(r["growth_per_window"]),
            _gib(r["after_1000_windows"]),
            _gib(r["retained_growth_per_window"]),
            _gib(r["retained_steady_bytes"]),
            _gib(r["retained_after_1000_windows"]),
        )
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", default="small", help="model preset measured (protocol.config presets)")
    ap.add_argument("--target", default="1b", help="model preset projected to")
    ap.add_argument("--peers", default="8,32,128", help="contributors per window, comma-separated")
    ap.add_argument("--max-measured-peers", type=int, default=8, help="largest aggregate measured (a power of 2)")
    ap.add_argument("--checkpoint-every", type=int, default=WindowConfig().checkpoint_every)
    ap.add_argument("--retain-windows", type=int, default=16)
    ap.add_argument("--retain-checkpoint-every", type=int, default=100)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(1)
    measured = measure(args.measure, args.max_measured_peers)
    check = {
        n: {
            "measured": v["bytes_per_param"],
            "union_model": measured["aggregate"][max(measured["aggregate"], key=int)]["bytes_per_nnz"]
            * (1 - (1 - measured["density"]) ** int(n)),
        }
        for n, v in measured["aggregate"].items()
    }
    peers = [int(x) for x in args.peers.split(",")]
    result = {
        "measured": measured,
        "aggregate_model_check": check,
        "projection": project(
            measured, args.target, peers, args.retain_windows, args.retain_checkpoint_every, args.checkpoint_every
        ),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    console = Console(width=200)
    console.print(
        f"measured on {measured['preset']} ({measured['params'] / 1e6:.1f} M params): contribution "
        f"{measured['contribution_bytes_per_param']:.4f} B/param (density {measured['density']:.4f}), "
        f"checkpoint {measured['checkpoint_bytes_per_param']:.4f} B/param, aggregate of n: "
        + ", ".join(f"{n}: {v['bytes_per_param']:.4f}" for n, v in measured["aggregate"].items())
        + " B/param"
    )
    console.print(table(result))


if __name__ == "__main__":
    main()
