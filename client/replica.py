"""A full replica: the whole model and its inner optimizer in this process, one window at a time.

    replica = FullReplica(spec, data_key=identity.peer_id, device="cuda",
                          data=lambda: open_run_dataset(spec, store, settings.data))
    result = replica.train(job)        # Trained (Δ̂, e′, optimizer state) or Skipped (stopped, no data)

The window: load θ_t into the model, H AdamW steps on the batches assigned to (run, data_key, t)
(:class:`client.data_feed.DataFeed`: fetched from the run's store, verified, cached), Δ = θ_t −
θ_local, then ``compress_step(e, Δ)``. A window whose data cannot be had intact is skipped with the
reason. Nothing the peer owns is changed; see :mod:`client.window` for the values and
:mod:`client.peer` for when they take effect.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from client.data_feed import DataFeed, skip_reason
from client.trainer import InnerTrainer, load_params, pseudo_gradient
from client.window import Skipped, Trained, WindowJob, WindowStats, hardware_of
from protocol.config import RunSpec
from protocol.errors import ProtocolError, StoreError
from protocol.feedback import compress_step
from protocol.model import build_model
from protocol.tokens import TokenDataset
from protocol.wire import PipelineRole

__all__ = ["FullReplica"]


class FullReplica:
    """A :class:`~client.window.WindowTrainer` holding the whole model on ``device``.

    ``data``: opens the run's dataset, on the first window (default: the local built-in corpus of
    an in-process run without a dataset, see :class:`~client.data_feed.DataFeed`);
    ``micro_batch_size``: gradient accumulation (the local setting ``compute.micro_batch_size``,
    0: none)."""

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

    def train(self, job: WindowJob) -> Trained | Skipped:
        """H inner steps from θ_t on this peer's batches, then error feedback + codec on Δ."""
        try:
            batches = self.data.batches(job.window)
        except (ProtocolError, StoreError) as exc:  # never trained on data that did not verify
            return Skipped(skip_reason(exc))
        load_params(self.model, job.theta)
        t0 = time.perf_counter()
        losses: list[float] = []
        tokens = 0
        for i, batch in enumerate(batches):
            step = self.trainer.train_window([batch])
            losses.append(step.mean_loss)
            tokens += step.tokens
            elapsed = time.perf_counter() - t0
            job.report(
                phase="training",
                window=job.window,
                step=i + 1,
                steps=len(batches),
                loss=step.mean_loss,
                tokens_per_s=tokens / max(elapsed, 1e-9),
            )
            if job.should_stop():
                return Skipped("stopped", inner_s=time.perf_counter() - t0)
        inner_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        delta = pseudo_gradient(job.theta, self.model)
        encoded, feedback_after = compress_step(job.feedback, delta, beta=self.spec.outer.beta, cfg=self.spec.codec)
        meta = {"loss_first": losses[0], "loss_last": losses[-1], "tokens": tokens, "inner_s": round(inner_s, 3)}
        stats = WindowStats(losses[0], losses[-1], tokens, inner_s, time.perf_counter() - t1, self.data.take_usage())
        return Trained(encoded, meta, stats, feedback_after, self.trainer.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trainer.load_state_dict(state)
