"""The inner loop: H AdamW steps on a replica, and the pseudo-gradient it produces.

    trainer = InnerTrainer(model, spec.inner, device, micro_batch_size=settings.compute.micro_batch_size)
    base = snapshot(model)                     # θ_t (CPU float32)
    stats = trainer.train_window(batches)      # H steps, schedule indexed by the global step
    delta = pseudo_gradient(base, model)       # Δ = θ_t − θ_local
    state = trainer.state_dict()               # optimizer moments + step (the peer's state dir keeps them)

The learning rate follows :func:`client.schedule.lr_at` at the trainer's global inner-step
counter, so a restored trainer continues the schedule. Gradients are accumulated over micro-batches
when ``micro_batch_size`` > 0. Autocast is bf16 on CUDA; CPU runs in fp32. Parameters stay fp32.

Data parallel (:mod:`client.ddp`): every rank trains its share of each batch with
``train_window(shares, rows=batch_rows)``, which scales its loss by share/batch rows, and
``reduce`` sums the gradients (and the loss) over the ranks before clipping, so every rank takes
the optimizer step one process would take on the whole batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from client.schedule import lr_at
from protocol.config import InnerConfig
from protocol.errors import ConfigError
from protocol.model import autocast_for, lm_loss, parameters_of

__all__ = ["GradientSum", "InnerTrainer", "WindowStats", "load_params", "pseudo_gradient", "snapshot"]

GradientSum = Callable[[list[Tensor]], None]
"""Sums every tensor of the list over the ranks of a data-parallel replica, in place."""


@dataclass(frozen=True)
class WindowStats:
    """What one window of inner training did (losses are training-batch means)."""

    start_step: int
    steps: int
    skipped_steps: int  # non-finite gradients: the optimizer step was skipped
    tokens: int
    first_loss: float
    last_loss: float
    mean_loss: float
    mean_grad_norm: float  # before clipping
    last_lr: float
    seconds: float


class InnerTrainer:
    """AdamW inner optimizer of one replica (betas/wd/clip and schedule from ``InnerConfig``).

    ``reduce``: set on the ranks of a data-parallel replica (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: InnerConfig,
        device: torch.device | str = "cpu",
        *,
        micro_batch_size: int = 0,
        reduce: GradientSum | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.reduce = reduce
        self.step = 0  # global inner step: indexes the schedule across windows and restarts
        self.optimizer = inner_optimizer(parameters_of(model), cfg)
        self._params = [p for group in self.optimizer.param_groups for p in group["params"]]

    def train_window(self, batches: Sequence[Tensor], *, rows: int | None = None) -> WindowStats:
        """One inner step per batch [B, T+1]; returns the window's statistics.

        ``rows``: the batch size each of ``batches`` is a share of (data parallel; default: B)."""
        if not batches:
            raise ValueError("train_window needs at least one batch")
        self.model.train()
        t0, start = time.perf_counter(), self.step
        losses: list[float] = []
        norms: list[float] = []
        skipped, tokens, lr = 0, 0, 0.0
        for batch in batches:
            lr = lr_at(self.step, self.cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss, norm = self._accumulate(batch, batch.shape[0] if rows is None else rows)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                skipped += 1  # a NaN/Inf gradient would poison θ and the moments
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
            norms.append(norm)
            tokens += batch.shape[0] * (batch.shape[1] - 1)
            self.step += 1
        return WindowStats(
            start_step=start,
            steps=len(batches),
            skipped_steps=skipped,
            tokens=tokens,
            first_loss=losses[0],
            last_loss=losses[-1],
            mean_loss=sum(losses) / len(losses),
            mean_grad_norm=sum(norms) / len(norms),
            last_lr=lr,
            seconds=time.perf_counter() - t0,
        )

    def _accumulate(self, batch: Tensor, size: int) -> tuple[float, float]:
        """Forward/backward over micro-batches (loss: mean over ``size`` rows), reduce, then clip.
        Returns (loss, pre-clip norm)."""
        batch = batch.to(self.device, non_blocking=True)
        mb = self.micro_batch_size if 0 < self.micro_batch_size < batch.shape[0] else max(batch.shape[0], 1)
        total = 0.0
        for part in torch.split(batch, mb) if batch.shape[0] else ():
            with autocast_for(self.device):
                loss = lm_loss(self.model, part) * (part.shape[0] / size)
            torch.autograd.backward(loss)  # what loss.backward() runs; Tensor.backward is unannotated
            total += float(loss.detach())
        if self.reduce is not None:
            total = self._reduce(self.reduce, total)
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip)
        return total, float(norm)

    def _reduce(self, reduce: GradientSum, loss: float) -> float:
        """Sum gradients and loss over the ranks (a rank with an empty share adds zeros)."""
        grads: list[Tensor] = []
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        total = torch.tensor([loss], dtype=torch.float32, device=self.device)
        reduce([*grads, total])
        return float(total.item())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Global step and AdamW state (moments on the device; the peer's state dir stores them)."""
        return optimizer_state(self.step, self.optimizer)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ConfigError if it does not fit this model."""
        self.step = restore_optimizer(self.optimizer, state, "this model")


# ---------------------------------------------------------------------- pseudo-gradients
@torch.no_grad()
def inner_optimizer(params: Mapping[str, Tensor], cfg: InnerConfig) -> torch.optim.AdamW:
    """The inner AdamW over ``params`` in name order: weight decay on matrices only (norms, 1-D,
    are not decayed). A full replica and a pipeline stage build it alike."""
    names = sorted(params)
    decay = [params[n] for n in names if params[n].ndim >= 2]
    no_decay = [params[n] for n in names if params[n].ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=1e-8,
    )


def optimizer_state(step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a peer checkpoints of an inner optimizer: the global step and the AdamW state."""
    return {"step": step, "optimizer": optimizer.state_dict()}


def restore_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], what: str) -> int:
    """Load :func:`optimizer_state` into ``optimizer``; the global step. ConfigError if it does not
    fit ``what`` (the model or stage it was built for)."""
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"inner-optimizer state does not fit {what}: {exc}") from exc
    return int(state["step"])


def snapshot(model: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A CPU float32 copy of every parameter (θ_t before the inner loop)."""
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in parameters_of(model).items()}


@torch.no_grad()
def load_params(model: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Copy ``params`` into the model's parameters (every name must match)."""
    own = parameters_of(model)
    if set(own) != set(params):
        raise ConfigError(f"parameter names differ: {sorted(set(own) ^ set(params))[:4]}")
    for name, p in own.items():
        p.copy_(params[name])


@torch.no_grad()
def pseudo_gradient(base: Mapping[str, Tensor], model: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Δ = θ_t − θ_local, on CPU in float32."""
    return {n: base[n] - p.detach().to("cpu", torch.float32) for n, p in parameters_of(model).items()}
