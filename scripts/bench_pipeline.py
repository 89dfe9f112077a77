#!/usr/bin/env python
"""Pipeline replicas and selective activation compression, at equal tokens (in-process, CPU).

R replicas train SparseLoCo rounds through the code peers and the validator run (inner AdamW
trainer, error feedback, codec bytes, strict unpacking, sparse aggregation over the contributions
that hold each tensor, outer step). Replicas 0..R-3 are full replicas; the last two are pipeline
replicas of 2 and 4 stages. A pipeline replica is simulated in one process by
``BoundaryTransformer``, which applies at each stage boundary exactly the encode/decode the
multi-process stages apply (tests/test_pipeline.py checks the two agree); each of its stages sends
its own partial contribution.

Runs (same data, same tokens, same seeds):
  full             every replica full, nothing compressed
  pipeline         2 replicas are pipelines, activations sent uncompressed
  all-<r>x         compression d/k = r applied to ALL replicas (full ones at a virtual 2-stage split)
  selective-<r>x   compression d/k = r only on the pipeline replicas (the paper's choice)

Reported: final validation loss of the function the run's full replicas train (the plain global
θ; for ``all-*`` its compressed 2-stage view, which every replica runs — both are also reported as
``plain_val_loss`` and ``compressed_view_val_loss``), activation bytes per token per boundary (fp32,
forward; the gradient going back is the same size), and the reconstruction error at the pipeline
replicas' boundaries measured on the final θ (after the drift handling it is fp32 rounding; the
naive variant without it is shown beside), plus how much the drift handling changes the function.

    python scripts/bench_pipeline.py                   # default: 5-8 min on 2 busy CPU cores
    python scripts/bench_pipeline.py --json > p.json
    python scripts/bench_pipeline.py --rounds 6 --inner-steps 8   # 1.5-4.5 min; too short for the ordering
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from client.pipeline.boundary import Boundary, BoundaryTransformer
from client.pipeline.constrained import ConstrainedReplica
from client.pipeline.stage import plan_stages
from client.pipeline.subspace import EMBEDDING, Subspace, constrained_names, localize, out_of_span_ratio
from client.simulator import compress_and_pack, unpack_sparse
from client.trainer import InnerTrainer, load_params, pseudo_gradient, snapshot
from protocol.aggregate import aggregate, apply_outer
from protocol.config import CodecConfig, DataConfig, InnerConfig, ModelConfig, OuterConfig, model_config
from protocol.data.assignment import TokenDataset, assigned_batches, open_dataset, validation_batches
from protocol.feedback import FeedbackState
from protocol.model import Transformer, build_model, eval_loss, parameters_of

RUN_HASH = "bench-pipeline"  # seeds U; any fixed string works for a benchmark


@dataclass(frozen=True)
class Setup:
    model: ModelConfig
    replicas: int
    rounds: int
    inner: InnerConfig
    outer: OuterConfig
    codec: CodecConfig
    batch_size: int
    seq_len: int
    eval_sequences: int
    pipeline_stages: tuple[int, ...]  # stages of the last replicas (the others are full)
    virtual_stages: int  # boundaries a full replica gets when compression is not selective


@dataclass
class Replica:
    index: int
    stages: int  # 1 = full replica (it sends one contribution)
    compress: bool
    body: ConstrainedReplica  # the model and the boundaries it trains behind
    trainer: InnerTrainer
    feedback: FeedbackState


def build_replicas(s: Setup, ratio: int, selective: bool | None) -> tuple[list[Replica], Subspace | None]:
    """``ratio`` 1 = no compression; ``selective`` None = no pipelines at all (run "full")."""
    sub = Subspace.for_run(RUN_HASH, s.model.dim, ratio) if ratio > 1 else None
    out = []
    n_full = s.replicas - (0 if selective is None else len(s.pipeline_stages))
    for r in range(s.replicas):
        stages = 1 if r < n_full else s.pipeline_stages[r - n_full]
        compress = sub is not None and (stages > 1 or not selective)
        # An uncompressed pipeline computes exactly what the unsplit model does (no boundary op).
        body = ConstrainedReplica(s.model, stages if stages > 1 else s.virtual_stages, sub if compress else None)
        trainer = InnerTrainer(body.model, s.inner, "cpu")
        out.append(Replica(r, stages, compress, body, trainer, FeedbackState()))
    return out, sub


def train_replica(rep: Replica, base: dict[str, torch.Tensor], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """H inner steps from θ_t (localized into the subspace when compressing); returns Δ."""
    start = rep.body.start_window(base)
    for batch in batches:  # one step at a time: the projection follows every inner step
        rep.trainer.train_window([batch])
        rep.body.after_step()
    return pseudo_gradient(start, rep.body.model)


def contributions(rep: Replica, delta: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A full replica sends one contribution; each stage of a pipeline sends its own slice."""
    return rep.body.split(delta) if rep.stages > 1 else [delta]


def run(
    s: Setup, data: TokenDataset, val: list[torch.Tensor], name: str, ratio: int, selective: bool | None
) -> dict[str, Any]:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    reps, sub = build_replicas(s, ratio, selective)
    glob = build_model(s.model)
    params = parameters_of(glob)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    sent = 0
    for t in range(s.rounds):
        base = snapshot(glob)
        contribs = []
        for rep in reps:
            batches = assigned_batches(
                data, 0, rep.index, t, s.inner.steps, s.batch_size, s.seq_len, pages=DataConfig.pages
            )
            delta = train_replica(rep, base, batches)
            for part in contributions(rep, delta):
                payloads, rep.feedback = compress_and_pack(rep.feedback, part, s.outer.beta, s.codec)
                sent = max(sent, sum(len(p) for p in payloads.values()))
                contribs.append(unpack_sparse(payloads, shapes, s.codec))
        apply_outer(params, aggregate(contribs, s.outer.aggregation, s.outer.clip), s.outer.alpha)
    plain = eval_loss(glob, val)
    view = eval_loss(compressed_view(s, glob, sub), val) if sub is not None else plain
    # The model a run trains is the function its full replicas run: the plain θ, or — when every
    # replica compresses — the compressed 2-stage view of θ (out-of-span parts of the constrained
    # weights never receive an update then, and the plain θ still carries their θ₀ values).
    final = view if sub is not None and selective is False else plain
    pipes = [r for r in reps if r.stages > 1]
    compressed_pipes = any(r.compress for r in pipes)
    row: dict[str, Any] = {
        "name": name,
        "compression_ratio": ratio if sub is not None else 1,
        "selective": bool(selective) if sub is not None else None,
        "final_val_loss": final,
        "plain_val_loss": plain,
        "compressed_view_val_loss": view,
        "activation_bytes_per_token": (4 * (sub.rank if compressed_pipes and sub else s.model.dim)) if pipes else 0,
        "uncompressed_bytes_per_token": 4 * s.model.dim,
        "subspace_rank": sub.rank if sub is not None else s.model.dim,
        "pipeline_replicas": [r.stages for r in pipes],
        "compressing_replicas": sum(r.compress for r in reps),
        "max_contribution_bytes": sent,
        "seconds": time.perf_counter() - t0,
    }
    if sub is not None:
        row.update(boundary_errors(s, glob, sub, val[0]))
    return row


def compressed_view(s: Setup, glob: Transformer, sub: Subspace) -> BoundaryTransformer:
    """θ as a 2-stage compressing replica runs it: localized, with the boundary applied."""
    cut = plan_stages(s.model.n_layers, 2)[1].start
    theta = {n: p.detach().clone() for n, p in glob.named_parameters()}
    local, fixed = localize(theta, sub, constrained_names(s.model.n_layers, cut))
    view = BoundaryTransformer.wrap(glob, [cut], Boundary(sub), fixed)
    load_params(view, local)
    return view


@torch.no_grad()
def boundary_errors(s: Setup, glob: Transformer, sub: Subspace, tokens: torch.Tensor) -> dict[str, float]:
    """Reconstruction error at the boundaries of a 2-stage replica, on the final global θ."""
    plans = plan_stages(s.model.n_layers, 2)
    names = constrained_names(s.model.n_layers, plans[-1].start)
    theta = {n: p.detach().clone() for n, p in glob.named_parameters()}
    local, fixed = localize(theta, sub, names)
    inputs = tokens[:, :-1]
    cut = plans[1].start

    def hidden(params: dict[str, torch.Tensor], fixed_emb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = build_model(s.model)
        load_params(m, params)
        rows = (
            torch.zeros(*inputs.shape, s.model.dim)
            if fixed_emb is None
            else torch.nn.functional.embedding(inputs, fixed_emb)
        )
        h = m.forward_slice(m.embed(inputs) + rows, 0, cut)
        return h, rows

    h, rows = hidden(local, fixed)
    rebuilt = sub.decompress(sub.compress(h, rows), rows)
    in_span = sub.project(h - rows) + rows
    h_naive, zero = hidden(theta, None)  # no drift handling: the global θ sent as is
    naive = sub.decompress(sub.compress(h_naive, zero), zero)
    only_emb, fixed_e = localize(theta, sub, [EMBEDDING])
    moved = BoundaryTransformer.wrap(glob, [], Boundary(None), fixed_e)
    load_params(moved, only_emb)
    plain_logits = glob(inputs)
    return {
        # The k coefficients travel bit-exact (fp32), so the receiver rebuilds exactly the sender's
        # in-subspace part: this is 0.0, and recon_error is all there is (fp32 rounding of a projection).
        "recon_error_in_subspace": float((rebuilt - in_span).norm() / in_span.norm()),
        "recon_error": float((rebuilt - h).norm() / h.norm()),
        "recon_error_without_drift_handling": float((naive - h_naive).norm() / h_naive.norm()),
        "out_of_span_global_embedding": out_of_span_ratio(theta[EMBEDDING], sub),
        "embedding_move_max_logit_change": float((moved(inputs) - plain_logits).abs().max()),
    }


def setup_from(args: argparse.Namespace) -> Setup:
    model = model_config(
        "tiny",
        dim=args.dim,
        n_layers=4,
        n_heads=4,
        ffn_dim=args.dim * 8 // 3 // 8 * 8,
        max_seq_len=max(64, args.seq_len),
    )
    inner = InnerConfig(
        steps=args.inner_steps, lr=args.lr, warmup_steps=args.inner_steps, total_steps=args.inner_steps * args.rounds
    )
    return Setup(
        model=model,
        replicas=args.replicas,
        rounds=args.rounds,
        inner=inner,
        outer=OuterConfig(),
        codec=CodecConfig(),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        eval_sequences=args.eval_sequences,
        pipeline_stages=(2, 4),
        virtual_stages=2,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratios", default="8,32,128", help="compression ratios d/k")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--replicas", type=int, default=4, help="the last 2 are pipelines (2 and 4 stages)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-sequences", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    if args.replicas < 3:
        ap.error("--replicas must be >= 3 (two pipelines and at least one full replica)")
    torch.set_num_threads(args.threads)
    s = setup_from(args)
    data = open_dataset(DataConfig(seq_len=s.seq_len, batch_size=s.batch_size))
    val = validation_batches(data, s.eval_sequences, s.batch_size, s.seq_len)
    ratios = [int(r) for r in args.ratios.split(",") if r]
    plan: list[tuple[str, int, bool | None]] = [("full", 1, None), ("pipeline", 1, True)]
    for r in ratios:
        plan += [(f"all-{r}x", r, False), (f"selective-{r}x", r, True)]
    console = Console(stderr=True)
    rows = []
    for name, ratio, selective in plan:
        rows.append(run(s, data, val, name, ratio, selective))
        console.print(f"  {name}: val {rows[-1]['final_val_loss']:.4f} ({rows[-1]['seconds']:.0f} s)")
    config = {
        "model": {
            "dim": s.model.dim,
            "n_layers": s.model.n_layers,
            "ffn_dim": s.model.ffn_dim,
            "params": sum(p.numel() for p in build_model(s.model).parameters()),
        },
        "replicas": s.replicas,
        "pipeline_stages": list(s.pipeline_stages),
        "rounds": s.rounds,
        "inner_steps": s.inner.steps,
        "batch_size": s.batch_size,
        "seq_len": s.seq_len,
        "tokens": s.replicas * s.rounds * s.inner.steps * s.batch_size * s.seq_len,
        "codec_k": s.codec.k,
        "argv": sys.argv[1:],
    }
    if args.json:
        print(json.dumps({"config": config, "runs": rows}, indent=1))
    else:
        print_table(rows, config)
    return 0


def print_table(rows: list[dict[str, Any]], config: dict[str, Any]) -> None:
    table = Table(title=f"pipeline replicas, {config['tokens']:,} tokens, {config['model']['params']:,} params")
    cols = (
        "run",
        "d/k",
        "selective",
        "val loss",
        "plain θ",
        "compressed view",
        "act B/tok",
        "recon err",
        "in-span err",
        "err, no drift fix",
        "emb move Δlogit",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        fmt = lambda k: f"{r[k]:.1e}" if k in r else "-"  # noqa: E731
        table.add_row(
            r["name"],
            str(r["compression_ratio"]),
            "-" if r["selective"] is None else str(r["selective"]),
            f"{r['final_val_loss']:.4f}",
            f"{r['plain_val_loss']:.4f}",
            f"{r['compressed_view_val_loss']:.4f}",
            str(r["activation_bytes_per_token"]),
            fmt("recon_error"),
            fmt("recon_error_in_subspace"),
            fmt("recon_error_without_drift_handling"),
            fmt("embedding_move_max_logit_change"),
        )
    Console(width=max(Console().width, 160)).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
