"""The inner loop: H AdamW steps on a replica, and the pseudo-gradient it produces.

    trainer = InnerTrainer(model, spec.inner, device, micro_batch_size=settings.compute.micro_batch_size)
    base = snapshot(model)                     # θ_t (CPU float32)
    stats = trainer.train_window(batches)      # H steps, schedule indexed by the global step
    delta = pseudo_gradient(base, model)       # Δ = θ_t − θ_local
    state = trainer.state_dict()               # optimizer moments + step (the peer's state dir keeps them)

The learning rate follows :func:`client.schedule.lr_at` at the trainer's global inner-step
counter, so a restored trainer continues the schedule. Gradients are accumulated over micro-batches
when ``micro_batch_size`` > 0. Autocast is bf16 on CUDA; CPU runs in fp32. Parameters stay fp32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from client.schedule import lr_at
from protocol.config import InnerConfig
from protocol.errors import ConfigError
from protocol.model import autocast_for, lm_loss, parameters_of

__all__ = ["InnerTrainer", "WindowStats", "load_params", "pseudo_gradient", "snapshot"]


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
    """AdamW inner optimizer of one replica (betas/wd/clip and schedule from ``InnerConfig``)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: InnerConfig,
        device: torch.device | str = "cpu",
        *,
        micro_batch_size: int = 0,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.step = 0  # global inner step: indexes the schedule across windows and restarts
        params = parameters_of(model)
        # Weight decay on matrices only; norms (1-D) are not decayed.
        decay = [p for _, p in sorted(params.items()) if p.ndim >= 2]
        no_decay = [p for _, p in sorted(params.items()) if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=1e-8,
        )
        self._params = decay + no_decay

    def train_window(self, batches: Sequence[Tensor]) -> WindowStats:
        """One inner step per batch [B, T+1]; returns the window's statistics."""
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
            loss, norm = self._accumulate(batch)
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

    def _accumulate(self, batch: Tensor) -> tuple[float, float]:
        """Forward/backward over micro-batches (mean loss), then clip. Returns (loss, pre-clip norm)."""
        batch = batch.to(self.device, non_blocking=True)
        size = batch.shape[0]
        mb = self.micro_batch_size if 0 < self.micro_batch_size < size else size
        total = 0.0
        for part in torch.split(batch, mb):
            with autocast_for(self.device):
                loss = lm_loss(self.model, part) * (part.shape[0] / size)
            torch.autograd.backward(loss)  # what loss.backward() runs; Tensor.backward is unannotated
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip)
        return total, float(norm)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Global step and AdamW state (moments on the device; the peer's state dir stores them)."""
        return {"step": self.step, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ConfigError if it does not fit this model."""
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"inner-optimizer state does not fit this model: {exc}") from exc
        self.step = int(state["step"])


# ---------------------------------------------------------------------- pseudo-gradients
@torch.no_grad()
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
