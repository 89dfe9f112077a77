"""A whole replica in one process, trained under the subspace constraint of an S-stage split.

Two users: a full replica of a run with ``pipeline.selective = false`` (compression applied to every
replica, at virtual boundaries of a ``pipeline.stages``-way split), and the in-process simulation of
a pipeline replica (``scripts/bench_pipeline.py``). Either way the window is the same as a real
pipeline's: localize θ_t into the subspace (re-project the residual writers, move the embedding's
out-of-span part into T_fix), train with the boundaries applied, re-project after every optimizer
step, and take Δ against the localized start.

    rep = ConstrainedReplica(spec.model, stages=2, subspace=sub)
    trainer = InnerTrainer(rep.model, spec.inner)
    start = rep.start_window(theta_t)
    for batch in batches:
        trainer.train_window([batch])
        rep.after_step()
    delta = pseudo_gradient(start, rep.model)
    parts = rep.split(delta)       # one contribution per stage (a full replica sends them merged)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from client.pipeline.boundary import Boundary, BoundaryTransformer
from client.pipeline.stage import plan_stages
from client.pipeline.subspace import Subspace, constrained_names, localize, project_parameters_
from client.trainer import load_params
from protocol.config import ModelConfig
from protocol.model import build_model, parameters_of

__all__ = ["ConstrainedReplica"]


class ConstrainedReplica:
    """The model, boundaries and constraint of one replica; ``subspace=None`` compresses nothing."""

    def __init__(self, cfg: ModelConfig, stages: int, subspace: Subspace | None) -> None:
        self.plans = plan_stages(cfg.n_layers, stages)
        self.subspace = subspace
        self.boundaries = [p.start for p in self.plans[1:]]
        self.constrained = [] if subspace is None else constrained_names(cfg.n_layers, self.plans[-1].start)
        self.model = BoundaryTransformer.wrap(build_model(cfg), self.boundaries, Boundary(subspace))

    def start_window(self, theta: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Load θ_t (localized when compressing); returns the start Δ is taken against (CPU fp32)."""
        fixed = None
        if self.subspace is not None:
            theta, fixed = localize(theta, self.subspace, self.constrained)
        self.model.set_fixed(fixed)
        load_params(self.model, theta)
        return {n: t.detach().to("cpu", torch.float32, copy=True) for n, t in theta.items()}

    def after_step(self) -> None:
        """Keep the residual writers in span(U) (call after every optimizer step)."""
        if self.subspace is not None:
            sub = self.subspace.to(self.model.embed.weight.device)
            project_parameters_(parameters_of(self.model), sub, self.constrained)

    def split(self, delta: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """Δ cut into the stages' partial contributions (each stage sends only its parameters)."""
        return [{n: d for n, d in delta.items() if p.owns(n)} for p in self.plans]
