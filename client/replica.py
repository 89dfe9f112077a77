"""A full replica: the whole model and its inner optimizer in this process, one window at a time.

    replica = FullReplica(spec, data_key=identity.peer_id, device="cuda",
                          data=lambda: open_run_dataset(spec, store, settings.data))
    result = replica.train(job)        # Trained (fold, optimizer state) or Skipped (stopped, no data)
    encoded = result.fold(e)           # Δ folded into the peer's e in place; Δ̂ back

The window: load θ into the model (less the job's stand-in for the aggregate in flight, if any), H
AdamW steps on the batches assigned to (run, data_key, t) (:class:`client.data_feed.DataFeed`:
fetched from the run's store, verified, cached); then, when the peer folds it, Δ = θ_start −
θ_local tensor by tensor and ``e.compress``. A window whose data cannot be had intact is skipped
with the reason. Nothing the peer owns is changed before the fold; see :mod:`client.window` for the
values and :mod:`client.peer` for when they take effect.

``micro_batch_size`` 0 is automatic (:func:`client.memory.auto_micro_batch`): the whole batch on
a CPU, on CUDA the most sequences that fit the device's free memory.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from client.data_feed import DataFeed, skip_reason
from client.memory import auto_micro_batch
from client.trainer import InnerTrainer, load_params
from client.window import Skipped, Trained, WindowJob, WindowStats, hardware_of
from protocol.aggregate import Sparse, SparseDict, apply_outer
from protocol.codec import Encoded
from protocol.config import RunSpec
from protocol.data.tokens import TokenDataset
from protocol.errors import NonFiniteValues, ProtocolError, StoreError
from protocol.feedback import FeedbackBuffers
from protocol.model import build_model, parameters_of
from protocol.wire import PipelineRole

__all__ = ["FullReplica", "fold_window"]


class FullReplica:
    """A :class:`~client.window.WindowTrainer` holding the whole model on ``device``.

    ``data``: opens the run's dataset, on the first window (default: the local built-in corpus of
    an in-process run without a dataset, see :class:`~client.data_feed.DataFeed`);
    ``micro_batch_size``: sequences per forward/backward pass (the local setting
    ``compute.micro_batch_size``, 0: automatic)."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        data_key: str,
        device: torch.device | str = "cpu",
        data: Callable[[], TokenDataset] | None = None,
        micro_batch_size: int = 0,
    ) -> None:
        self.spec, self.data_key = spec, data_key
        self.device = torch.device(device)
        self.data = DataFeed(spec, key=data_key, opener=data)
        self.model = build_model(spec.model).to(self.device)
        if micro_batch_size == 0:
            micro_batch_size = auto_micro_batch(spec.model, spec.data, self.device)
        self.trainer = InnerTrainer(self.model, spec.inner, self.device, micro_batch_size=micro_batch_size)

    @property
    def role(self) -> PipelineRole | None:
        return None

    @property
    def hardware(self) -> str:
        return hardware_of(self.device)

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def shifts(self) -> bool:
        return True

    def train(self, job: WindowJob) -> Trained | Skipped:
        """H inner steps from θ (less the stand-in) on this peer's batches, moving the working model
        as ``between_steps`` says (θ took an aggregate, the stand-in changed); the fold is left to
        the peer."""
        try:
            batches = self.data.batches(job.window)
        except (ProtocolError, StoreError) as exc:  # never trained on data that did not verify
            return Skipped(skip_reason(exc))
        load_params(self.model, job.theta)
        params = parameters_of(self.model)
        apply_outer(params, job.stand_in, job.alpha)
        t0 = time.perf_counter()
        losses: list[float] = []
        tokens = 0
        for i in range(len(batches) + 1):
            for delta, scale in job.between_steps(i):  # θ or its stand-in moved: the working model too
                apply_outer(params, delta, scale)
            if i == len(batches) or job.should_stop():
                break
            step = self.trainer.train_window([batches[i]])
            losses.append(step.mean_loss)
            tokens += step.tokens
            job.report_step(i + 1, len(batches), step.mean_loss, tokens, t0)
        if len(losses) < len(batches):
            return Skipped("stopped", inner_s=time.perf_counter() - t0)
        inner_s = time.perf_counter() - t0
        meta = {"loss_first": losses[0], "loss_last": losses[-1], "tokens": tokens, "inner_s": round(inner_s, 3)}
        stats = WindowStats(losses[0], losses[-1], tokens, inner_s, 0.0, data=self.data.take_usage())
        fold = functools.partial(fold_window, self.spec, job.window, self.model, job.theta, job.alpha)
        return Trained(fold, meta, stats, self.trainer.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trainer.load_state_dict(state)


def fold_window(
    spec: RunSpec,
    window: int,
    model: torch.nn.Module,
    theta: Mapping[str, Tensor],
    alpha: float,
    e: FeedbackBuffers,
    stand_in: SparseDict,
) -> dict[str, Encoded]:
    """Δ = (θ − α·stand-in) − θ_local of a trained ``model`` folded into ``e`` tensor by tensor (one
    Δ tensor alive at a time); θ is the peer's, as it stands now (it moved with the working model).
    The fold of every trainer that holds the whole model (:class:`Trained`); ``window``'s codec
    (:meth:`RunSpec.codec_at`) compresses it."""
    params = parameters_of(model)
    for name, p in params.items():  # checked before e changes: a NaN must not half-fold
        if not bool(torch.isfinite(p).all()):
            raise NonFiniteValues(f"{name} is not finite after training")
    deltas = ((name, _delta(theta[name], stand_in.get(name), alpha, p)) for name, p in params.items())
    return e.compress(deltas, beta=spec.outer.beta, cfg=spec.codec_at(window))


@torch.no_grad()
def _delta(theta: Tensor, stand_in: Sparse | None, alpha: float, p: Tensor) -> Tensor:
    """θ_start − θ_local for one tensor, on the CPU in float32 (what ``pseudo_gradient`` computes);
    θ_start is θ less the eager stand-in while it is still in the working model."""
    start = theta.detach().to("cpu", torch.float32, copy=True)
    if stand_in is not None:
        apply_outer({"t": start}, {"t": stand_in}, alpha)
    return start.sub_(p.detach().to("cpu", torch.float32))
