"""One stage's share of a pipeline replica's window: H inner steps, then its own contribution.

The stages of a replica (one process each, possibly on different machines) call
:func:`run_stage_window` for the same window with the same synchronised θ_t. They meet at the
rendezvous, check they agree on window, base and subspace, train H GPipe steps together (global
gradient clipping, the run's learning-rate schedule at global step ``window·H + i``), keep the
residual writers in span(U) after every step, commit together, and only then each stage runs error
feedback + codec on the pseudo-gradient of ITS OWN parameters. Anything that goes wrong with the
other stages (death, timeout, mismatch) is a skipped window: no error-feedback state comes back,
and nothing is published. The inner optimizer keeps the steps it took (see :mod:`client.peer`).

    stage = PipelineStage(spec, group="g1", stage=s, stages=S, device="cuda")
    batches = replica_batches(dataset, spec, "g1", window)            # same on every stage
    result = run_stage_window(stage, theta_t, window, base_digest, batches, rendezvous="host:29500",
                              feedback=e)
    if result.ok:
        publish(Contribution(spec.hash(), window, base_digest, spec.codec_at(window), result.encoded, result.metadata))
        e = result.feedback_after
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from client.pipeline.boundary import Boundary
from client.pipeline.link import StageLink
from client.pipeline.schedule import clip_coefficient, pipeline_step
from client.pipeline.stage import Stage, plan_stages
from client.pipeline.subspace import Subspace, constrained_names, localize, project_parameters_
from client.schedule import lr_at
from client.trainer import inner_optimizer, optimizer_state, restore_optimizer
from protocol.codec import Encoded
from protocol.config import RunSpec
from protocol.data.assignment import TokenDataset, assigned_batches, pipeline_data_key
from protocol.errors import ConfigError, NonFiniteValues, PipelineFailure
from protocol.feedback import FeedbackState, compress_step
from protocol.model import build_model

__all__ = ["PipelineStage", "StageWindowResult", "pipeline_peer_key", "replica_batches", "run_stage_window"]


def _digest(batches: Sequence[Tensor]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(b.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def pipeline_peer_key(group: str) -> str:
    """The identity under which a pipeline replica's batches are assigned (all stages share it)."""
    return pipeline_data_key(group)


def replica_batches(dataset: TokenDataset, spec: RunSpec, group: str, window: int) -> list[Tensor]:
    """The replica's H batches for ``window`` — every stage (and the validator) derives the same."""
    d = spec.data
    return assigned_batches(
        dataset, spec.seed, pipeline_peer_key(group), window, spec.inner.steps, d.batch_size, d.seq_len, pages=d.pages
    )


@dataclass(frozen=True)
class StageWindowResult:
    """What one stage did in one window. ``encoded`` covers this stage's parameters only;
    ``feedback_after`` is e after the compress step that produced it (None when skipped)."""

    window: int
    group: str
    stage: int
    stages: int
    ok: bool
    reason: str = ""  # PipelineFailure.reason when skipped
    detail: str = ""
    encoded: Mapping[str, Encoded] = field(default_factory=dict)
    metadata: Mapping[str, int | float | str | bool] = field(default_factory=dict)
    feedback_after: FeedbackState | None = None
    steps: int = 0
    tokens: int = 0
    mean_loss: float = float("nan")
    seconds: float = 0.0


class PipelineStage:
    """The long-lived state of one stage process: its layers and inner optimizer."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        group: str,
        stage: int,
        stages: int,
        device: torch.device | str = "cpu",
        backend: str = "gloo",
    ) -> None:
        if not group or any(c in group for c in "/\\\n"):
            raise ConfigError(f"pipeline group must be a plain name, got {group!r}")
        self.spec, self.group, self.backend = spec, group, backend
        self.device = torch.device(device)
        plans = plan_stages(spec.model.n_layers, stages)
        self.plan = plans[stage]
        self.stage = Stage(build_model(spec.model), self.plan).to(self.device)
        ratio = spec.pipeline.compression_ratio
        self.subspace = Subspace.for_run(spec.hash(), spec.model.dim, ratio) if ratio > 1 else None
        self.boundary = Boundary(None if self.subspace is None else self.subspace.to(self.device))
        last_boundary = plans[-1].start
        self.constrained = [] if self.subspace is None else constrained_names(spec.model.n_layers, last_boundary)
        self.params = self.stage.slice_parameters()
        self.optimizer = inner_optimizer(self.params, spec.inner)  # as a full replica's
        self.step = 0  # global inner step after the last trained one (the schedule index is window·H + i)

    # Same shape as InnerTrainer's, so a peer checkpoints a stage's optimizer like a full replica's.
    def state_dict(self) -> dict[str, Any]:
        return optimizer_state(self.step, self.optimizer)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = restore_optimizer(self.optimizer, state, "this stage")

    def start_window(self, theta: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Load θ_t (localized into the subspace when compressing); returns the slice's start (CPU)."""
        fixed = None
        if self.subspace is not None:
            if "embed.weight" not in theta:
                raise ConfigError("a compressing stage needs the embedding to rebuild T_fix")
            wanted = {n: theta[n] for n in set(self.params) | {"embed.weight"} if n in theta}
            theta, fixed = localize(wanted, self.subspace, self.constrained)
        self.stage.load(theta, fixed)
        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self.params.items()}

    def inner_step(self, link: StageLink, micro_batches: Sequence[Tensor], global_step: int) -> float:
        lr = lr_at(global_step, self.spec.inner)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        result = pipeline_step(self.stage, link, self.boundary, micro_batches)
        if math.isfinite(result.grad_norm):  # the same decision on every stage (the norm is global)
            coef = clip_coefficient(result.grad_norm, self.spec.inner.grad_clip)
            if coef < 1.0:
                for p in self.params.values():
                    if p.grad is not None:
                        p.grad.mul_(coef)
            self.optimizer.step()
            if self.boundary.subspace is not None:  # the run's subspace, on this stage's device
                project_parameters_(self.params, self.boundary.subspace, self.constrained)
        self.optimizer.zero_grad(set_to_none=True)
        return result.loss


def run_stage_window(
    stage: PipelineStage,
    theta: Mapping[str, Tensor],
    window: int,
    base: str,
    batches: Sequence[Tensor],
    *,
    rendezvous: str,
    feedback: FeedbackState,
) -> StageWindowResult:
    """Train this stage's share of window ``window`` with the other stages; never raises for them.

    ``theta``: the synchronised θ_t (at least this stage's slice and, when compressing, the
    embedding, from which T_fix is rebuilt). ``base``: digest of the aggregate θ_t came from.
    ``batches``: :func:`replica_batches` (identical on every stage). ``feedback``: this stage's e
    before the window (left untouched). Returns a skipped result with the reason when another
    stage dies, times out or disagrees; configuration errors do raise.
    """
    spec, plan = stage.spec, stage.plan
    t0 = time.perf_counter()
    result = partial(StageWindowResult, window=window, group=stage.group, stage=plan.index, stages=plan.stages)
    micro = spec.pipeline.micro_batches
    losses: list[float] = []
    try:
        with StageLink(
            rendezvous,
            stage=plan.index,
            stages=plan.stages,
            window=window,
            timeout_s=spec.pipeline.timeout_s,
            rendezvous_timeout_s=spec.pipeline.rendezvous_timeout_s,
            backend=stage.backend,
            device=stage.device,
        ) as link:
            link.agree("run", spec.hash())
            link.agree("base", base)
            link.agree("subspace", "none" if stage.subspace is None else stage.subspace.digest())
            link.agree("batches", _digest(batches))  # e.g. a dataset built by another Python version
            start = stage.start_window(theta)
            for i, batch in enumerate(batches):
                parts = list(batch.to(stage.device).chunk(min(micro, batch.shape[0])))
                losses.append(stage.inner_step(link, parts, window * spec.inner.steps + i))
                stage.step = window * spec.inner.steps + i + 1
            delta = {n: start[n] - p.detach().to("cpu", torch.float32) for n, p in stage.params.items()}
            # Commit: every stage finished; only now may any of them touch its error feedback.
            if int(link.all_reduce(torch.ones(1)).item()) != plan.stages:
                raise PipelineFailure("commit count is wrong", reason="mismatch")
    except PipelineFailure as exc:
        stage.optimizer.zero_grad(set_to_none=True)  # a step may have stopped between backward and update
        return result(ok=False, reason=exc.reason, detail=str(exc), steps=len(losses), seconds=time.perf_counter() - t0)
    try:
        encoded, feedback_after = compress_step(feedback, delta, spec.outer.beta, spec.codec_at(window))
    except NonFiniteValues as exc:
        return result(ok=False, reason=exc.reason, detail=str(exc), steps=len(losses), seconds=time.perf_counter() - t0)
    tokens = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)
    mean_loss = sum(losses) / len(losses) if losses else float("nan")
    metadata: dict[str, int | float | str | bool] = {
        "pipeline_group": stage.group,
        "pipeline_stage": plan.index,
        "pipeline_stages": plan.stages,
        "compression_ratio": spec.pipeline.compression_ratio if stage.subspace is not None else 1,
        "tokens": tokens,
        "loss": mean_loss,
    }
    return result(
        ok=True,
        encoded=encoded,
        metadata=metadata,
        feedback_after=feedback_after,
        steps=len(losses),
        tokens=tokens,
        mean_loss=mean_loss,
        seconds=time.perf_counter() - t0,
    )
