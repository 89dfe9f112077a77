"""GPipe schedule of one inner step across the stages of a pipeline replica.

Every stage runs the same function with its own :class:`~client.pipeline.stage.Stage`: forward all
micro-batches (receive from the previous stage, run the blocks, send to the next), then backward
them in reverse order (receive the gradient of what it sent, backpropagate, send the gradient of
what it received). Sends and receives are tagged by micro-batch and happen in the same order on
both sides, so blocking point-to-point calls cannot deadlock. The loss is the token mean over the
whole step, so gradients equal those of the unsplit model on the full batch.

After the backward pass the stages all-reduce their squared gradient norms and the loss, so the
gradient clipping is the global one (as in the unsplit model) and every stage knows the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from client.pipeline.boundary import Boundary
from client.pipeline.stage import Stage
from protocol.model import autocast_for

__all__ = ["Link", "StepResult", "clip_coefficient", "pipeline_step"]


class Link(Protocol):
    def send(self, x: Tensor, dst: int, tag: int = 0) -> None: ...

    def recv(self, shape: tuple[int, ...], src: int, tag: int = 0) -> Tensor: ...

    def all_reduce(self, x: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean next-token loss of the whole step (same on every stage)
    grad_norm: float  # global gradient norm over all stages, before clipping
    tokens: int


def pipeline_step(stage: Stage, link: Link, boundary: Boundary, micro_batches: Sequence[Tensor]) -> StepResult:
    """Forward and backward of one inner step; leaves this stage's gradients in ``.grad``.

    ``micro_batches``: token tensors [b, T+1] (inputs ``[:, :-1]``, targets ``[:, 1:]``), the same
    on every stage (the assignment is deterministic, so token ids need not travel).
    """
    plan = stage.plan
    total = sum(mb[:, 1:].numel() for mb in micro_batches)
    dim = stage.dim
    saved: list[tuple[Tensor | None, Tensor]] = []
    loss_sum = torch.zeros((), dtype=torch.float64)
    for m, tokens in enumerate(micro_batches):
        inputs = tokens[:, :-1]
        rows = stage.fixed_rows(inputs)
        wire_in: Tensor | None = None
        if plan.first:
            h = stage.embed_tokens(inputs)
        else:
            shape = (*inputs.shape, boundary.width(dim))
            wire_in = link.recv(shape, plan.index - 1, m).requires_grad_(True)
            h = boundary.decode(wire_in, rows)
        # bf16 autocast on CUDA for the blocks, as the inner trainer; the boundary stays float32.
        with autocast_for(h.device):
            h = stage.run_blocks(h)
            logits = stage.logits(h) if plan.last else None
        if logits is not None:
            out = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum") / total
            loss_sum += out.detach().double().cpu()
        else:
            out = boundary.encode(h.float(), rows)
            link.send(out, plan.index + 1, m)
        saved.append((wire_in, out))
    for m in reversed(range(len(micro_batches))):
        wire_in, out = saved[m]
        # torch.autograd.backward is what Tensor.backward runs (which is unannotated).
        if plan.last:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, link.recv(tuple(out.shape), plan.index + 1, m).to(out.dtype))
        if wire_in is not None:
            assert wire_in.grad is not None
            link.send(wire_in.grad, plan.index - 1, m)
    sq = sum(
        (p.grad.detach().double().pow(2).sum() for p in stage.parameters() if p.grad is not None),
        torch.zeros((), dtype=torch.float64),
    )
    # float32 on the wire: exact enough for a norm and a loss, and what every backend reduces.
    stats = link.all_reduce(torch.stack([sq.float().cpu(), loss_sum.float()]))
    return StepResult(loss=float(stats[1]), grad_norm=float(stats[0]) ** 0.5, tokens=total)


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` would apply (1.0 when no clipping is needed)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))
