"""Codec benchmark: size of a whole signed contribution, speed, and value error, with baselines.

    python scripts/bench_codec.py                  # rich table, LLaMA-shaped preset "small" (25.6 M)
    python scripts/bench_codec.py --json           # one JSON object
    python scripts/bench_codec.py --params 150m --k 128 --device cuda --repeats 7

Tensors: the parameter shapes of ``protocol.model`` for a preset of ``protocol.config`` (or a
parameter count, reached by adding layers to ``small``), filled with Student-t (ν = 3) noise — the
heavy tails of real pseudo-gradients — with a per-tensor scale. ``value_rel_error_pseudograd`` is
measured on a real pseudo-gradient too: θ₀ − θ after H = 15 AdamW steps of the ``tiny`` model on
the interpreter's ``json`` and ``argparse`` sources (byte tokens).

Every variant is measured in the same run on the same tensors and the same Top-k selection:

* ``ours``: 2-bit sign + level codes, Golomb-Rice gap-coded indices (``index_coding = "rice"``);
* ``12bit``: the same codes with 12-bit packed indices (``index_coding = "packed12"``);
* ``production``: Templar as deployed, 12-bit indices + one byte per code (4-bin quantizer around the
  mean, bin width 1.5σ, bin-mean lookup table) — sized from its definition, errors measured.

Sizes are whole signed envelopes built by ``protocol.wire.encode_contribution`` with an Ed25519
identity (headers, tensor table, scales and signature included); the production size adds its code
and index bytes to the same envelope overhead. Timings are medians over ``--repeats`` repetitions of
the total over all tensors; ours and 12-bit run back to back on every tensor, the first one
alternating, so machine load and cache warmth hit both alike. "encode" is ``encode`` + ``pack`` of
every tensor, "pack" the coding stage alone (``pack`` of an encoded tensor: the only encoding code
the two variants do not share), "decode" is ``unpack`` + ``decode``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from protocol import wire
from protocol.codec import Encoded, decode, encode, pack, to_sparse, unpack
from protocol.codec.indexcoding import encode_rice
from protocol.config import MODEL_PRESETS, CodecConfig, model_config
from protocol.identity import Identity
from protocol.model import build_model, lm_loss, param_schema

STDLIB = Path(sysconfig.get_paths()["stdlib"])  # fixed text: the interpreter's own sources


# ----------------------------------------------------------------------------- the comparison
def production_roundtrip(values: torch.Tensor) -> torch.Tensor:
    """Templar's 2-bit quantizer on one tensor's kept values (comparison only; never on the wire).

    shift = mean, σ = std of the kept values; code = clamp(round((v − shift)/1.5σ + 2), 0, 3);
    decoded as the mean of the values that fell in each bin (a 4-entry table) — equivalently
    table + shift with the table holding the bin means of v − shift.
    """
    v = values.double()
    if v.numel() == 0:
        return values.float()
    shift = v.mean()
    sigma = v.std(unbiased=False)
    if float(sigma) == 0.0:
        return v.float()
    codes = torch.clamp(torch.round((v - shift) / (1.5 * sigma) + 2), 0, 3).long()
    sums = torch.zeros(4, dtype=torch.float64).index_add_(0, codes, v - shift)
    counts = torch.bincount(codes, minlength=4).clamp_min(1)
    return ((sums / counts)[codes] + shift).float()


def production_payload_bytes(nnz: int) -> int:
    """12-bit index pairs (k even per chunk in production; rounded up here) + 1 byte per code
    + the 4-entry float32 table and the shift."""
    return math.ceil(nnz * 12 / 8) + nnz + 5 * 4


def rel_error(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """‖v̂ − v‖ / ‖v‖ pooled over every kept value of every tensor."""
    num = sum(float((a.double() - b.double()).square().sum()) for a, b in pairs)
    den = sum(float(b.double().square().sum()) for _, b in pairs)
    return math.sqrt(num / den) if den else 0.0


# ----------------------------------------------------------------------------- inputs
def shapes_for(params: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    """Parameter shapes of a preset, or of ``small`` with enough layers for a parameter count."""
    if params in MODEL_PRESETS:
        return params, param_schema(model_config(params))
    target = int(float(params.lower().rstrip("m")) * (1e6 if params.lower().endswith("m") else 1))
    base = param_schema(model_config("small", n_layers=1))
    per_layer = sum(math.prod(s) for s in param_schema(model_config("small", n_layers=2)).values()) - sum(
        math.prod(s) for s in base.values()
    )
    layers = max(1, math.ceil((target - sum(math.prod(s) for s in base.values())) / per_layer) + 1)
    return f"small×{layers} layers", param_schema(model_config("small", n_layers=layers))


def student_t(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        scale = 1e-3 * float(torch.empty(1).uniform_(0.3, 3.0, generator=gen))
        normal = torch.randn(shape, generator=gen)
        chi2 = torch.randn((3, *shape), generator=gen).square().sum(0) / 3
        out[name] = normal / chi2.sqrt() * scale
    return out


def real_pseudo_gradient(steps: int = 15, seed: int = 0) -> dict[str, torch.Tensor]:
    """θ₀ − θ after ``steps`` AdamW steps of the ``tiny`` model on fixed stdlib source bytes."""
    torch.manual_seed(seed)
    cfg = model_config("tiny")
    model = build_model(cfg)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    text = b"".join(p.read_bytes() for p in sorted(STDLIB.glob("json/*.py")) + [STDLIB / "argparse.py"])
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - 129, (8,), generator=gen)
        batch = torch.stack([tokens[s : s + 129] for s in starts.tolist()])
        opt.zero_grad()
        lm_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {n: start[n] - p.detach() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- measurements
def paired_medians(
    items: list[Any],
    fns: tuple[Callable[[Any], Any], Callable[[Any], Any]],
    repeats: int,
    sync: Callable[[], None],
    clock: Callable[[], float],
) -> tuple[float, float]:
    """Median over ``repeats`` of the total time each of two functions takes over ``items``.

    The two variants run back to back on every item (every tensor), the first one alternating from
    item to item and from repeat to repeat, so load drift on the shared machine and cache warmth
    hit both alike; each repeat's total is the sum over items.
    """
    totals: tuple[list[float], list[float]] = ([], [])
    for rep in range(repeats):
        acc = [0.0, 0.0]
        for i, item in enumerate(items):
            for which in (0, 1) if (i + rep) % 2 == 0 else (1, 0):
                sync()
                start = clock()
                fns[which](item)
                sync()
                acc[which] += clock() - start
        totals[0].append(acc[0])
        totals[1].append(acc[1])
    return statistics.median(totals[0]), statistics.median(totals[1])


def envelope_bytes(encoded: dict[str, Encoded], cfg: CodecConfig, ident: Identity) -> int:
    c = wire.Contribution("ab" * 32, 7, wire.GENESIS, cfg, encoded, {"tokens": 123456, "loss": 3.25})
    return len(wire.encode_contribution(c, ident))


def value_errors(tensors: dict[str, torch.Tensor], cfg: CodecConfig) -> tuple[float, float]:
    """(ours, production) relative error on the kept values of ``tensors``."""
    ours, prod = [], []
    for t in tensors.values():
        flat, vals = to_sparse(encode(t, cfg))
        kept = t.reshape(-1).float()[flat.to(t.device)]
        ours.append((vals, kept))
        prod.append((production_roundtrip(kept.cpu()), kept.cpu()))
    return rel_error(ours), rel_error(prod)


def index_bits(encoded: dict[str, Encoded]) -> tuple[float, float]:
    """(bits per index of the Golomb-Rice streams, information bound per index) over all tensors."""
    bits = bound = 0.0
    for e in encoded.values():
        g = e.geometry
        ks = g.chunk_ks().numpy()
        bits += 8 * len(encode_rice(e.indices.cpu().numpy(), ks))
        bound += sum(math.log2(math.comb(int(s), int(k))) for s, k in zip(g.chunk_sizes().tolist(), ks.tolist()))
    nnz = sum(e.nnz for e in encoded.values())
    return bits / nnz, bound / nnz


def run(params: str, k: int, device: str, repeats: int, pg_steps: int = 15) -> dict[str, Any]:
    phase = time.perf_counter()
    label, shapes = shapes_for(params)
    tensors = {n: t.to(device) for n, t in student_t(shapes).items()}
    n_params = sum(t.numel() for t in tensors.values())
    ours, base12 = CodecConfig(k=k), CodecConfig(k=k, index_coding="packed12")
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # On the CPU with one thread, the process's CPU time is the wall time of an idle machine and is
    # not inflated by other processes (the 2-core development machine is shared); on CUDA: wall.
    single = not cuda and torch.get_num_threads() == 1
    clock = time.process_time if single else time.perf_counter
    encoded = {n: encode(x, ours) for n, x in tensors.items()}  # doubles as the warm-up
    encoded12 = {n: encode(x, base12) for n, x in tensors.items()}
    blobs = {"ours": {n: pack(e) for n, e in encoded.items()}, "12bit": {n: pack(e) for n, e in encoded12.items()}}
    names = list(tensors)
    enc, enc12 = paired_medians(
        names,
        (lambda n: pack(encode(tensors[n], ours)), lambda n: pack(encode(tensors[n], base12))),
        repeats,
        sync,
        clock,
    )
    # The coding stage alone (pack of an already encoded tensor): the only code the variants do not share.
    pk, pk12 = paired_medians(names, (lambda n: pack(encoded[n]), lambda n: pack(encoded12[n])), repeats, sync, clock)
    dec, dec12 = paired_medians(
        names,
        (
            lambda n: decode(unpack(blobs["ours"][n], shapes[n], ours)),
            lambda n: decode(unpack(blobs["12bit"][n], shapes[n], base12)),
        ),
        repeats,
        sync,
        clock,
    )
    ident = Identity.generate()
    env_ours, env_12 = envelope_bytes(encoded, ours, ident), envelope_bytes(encoded12, base12, ident)
    payload_ours = sum(len(b) for b in blobs["ours"].values())
    overhead = env_ours - payload_ours  # envelope header, tensor table, signature
    nnz = sum(e.nnz for e in encoded.values())
    prod_bytes = overhead + sum(production_payload_bytes(e.nnz) for e in encoded.values())
    err, err_prod = value_errors(tensors, ours)
    err_pg = err_pg_prod = float("nan")  # pg_steps = 0 skips the training (quick smoke runs)
    if pg_steps:
        err_pg, err_pg_prod = value_errors({n: x.to(device) for n, x in real_pseudo_gradient(pg_steps).items()}, ours)
    bpi, bound_pi = index_bits(encoded)
    bound_bits = sum(
        math.log2(math.comb(int(s), int(kk))) + 2 * int(kk)
        for e in encoded.values()
        for s, kk in zip(e.geometry.chunk_sizes().tolist(), e.geometry.chunk_ks().tolist())
    )
    return {
        "model": label,
        "params": n_params,
        "tensors": len(tensors),
        "k": k,
        "device": device,
        "repeats": repeats,
        "nnz": nnz,
        "bits_per_param": 8 * env_ours / n_params,
        "bits_per_param_12bit": 8 * env_12 / n_params,
        "bits_per_param_production": 8 * prod_bytes / n_params,
        "bits_per_param_bound": bound_bits / n_params,
        "bits_per_param_envelope_overhead": 8 * overhead / n_params,
        "envelope_bytes": env_ours,
        "bits_per_index": bpi,
        "bits_per_index_bound": bound_pi,
        "bits_per_index_12bit": 12.0,
        "encode_params_per_s": n_params / enc,
        "encode_params_per_s_12bit": n_params / enc12,
        "encode_seconds": enc,
        "encode_seconds_12bit": enc12,
        "pack_seconds": pk,
        "pack_seconds_12bit": pk12,
        "decode_params_per_s": n_params / dec,
        "decode_params_per_s_12bit": n_params / dec12,
        "value_rel_error": err,
        "value_rel_error_production": err_prod,
        "value_rel_error_pseudograd": err_pg,
        "value_rel_error_pseudograd_production": err_pg_prod,
        "size_method": "protocol.wire.encode_contribution, Ed25519-signed",
        "clock": "process CPU time (1 thread)" if single else "wall time",
        "timing": "variants back to back per tensor, alternating first; median of per-repeat totals",
        "threads": torch.get_num_threads(),
        "bench_seconds": time.perf_counter() - phase,
    }


def show(r: dict[str, Any]) -> None:
    table = Table(
        title=f"codec: {r['model']}, {r['params'] / 1e6:.1f} M params, k={r['k']}/4096, {r['device']}",
        caption="bits/param: whole signed contribution · encode = encode+pack, pack = coding stage alone, "
        "decode = unpack+decode "
        f"({r['clock']}, median of {r['repeats']}) · rel. error on kept values: t3 = Student-t ν=3 set, "
        "Δ = real pseudo-gradient",
    )
    for col in ("variant", "bits/param", "bits/index", "enc Mp/s", "pack ms", "dec Mp/s", "err t3", "err Δ"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    mp = lambda v: f"{v / 1e6:.0f}"  # noqa: E731
    table.add_row(
        "ours: 2-bit + Golomb",
        f"{r['bits_per_param']:.4f}",
        f"{r['bits_per_index']:.3f}",
        mp(r["encode_params_per_s"]),
        f"{r['pack_seconds'] * 1e3:.2f}",
        mp(r["decode_params_per_s"]),
        f"{r['value_rel_error']:.3f}",
        f"{r['value_rel_error_pseudograd']:.3f}",
    )
    table.add_row(
        "12-bit + 2-bit",
        f"{r['bits_per_param_12bit']:.4f}",
        "12",
        mp(r["encode_params_per_s_12bit"]),
        f"{r['pack_seconds_12bit'] * 1e3:.2f}",
        mp(r["decode_params_per_s_12bit"]),
        f"{r['value_rel_error']:.3f}",
        f"{r['value_rel_error_pseudograd']:.3f}",
    )
    table.add_row(
        "production",
        f"{r['bits_per_param_production']:.4f}",
        "12",
        "",
        "",
        "",
        f"{r['value_rel_error_production']:.3f}",
        f"{r['value_rel_error_pseudograd_production']:.3f}",
    )
    table.add_row("bound", f"{r['bits_per_param_bound']:.4f}", f"{r['bits_per_index_bound']:.3f}", "", "", "", "", "")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="small", help="model preset or a parameter count (e.g. 40M)")
    parser.add_argument("--k", type=int, default=64, help="values kept per 4096")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.params, args.k, args.device, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        show(result)


if __name__ == "__main__":
    main()
