"""A window's work as a value: what a peer trains, and the one interface both ways of training share.

A peer trains each window in one of two ways, and holds the one it was started with:

* a full replica (:class:`client.replica.FullReplica`): the whole model and its inner optimizer;
* one stage of a pipeline replica (:class:`client.pipeline.trainer.StageTrainer`): a slice of the
  layers, trained together with the other stages of its group.

Both answer :meth:`WindowTrainer.train` with a value and change nothing the peer owns::

    result = trainer.train(WindowJob(window, theta, base, e.view(), report=show.update, should_stop=...))
    if isinstance(result, Trained):
        encoded = result.fold(e, stand_in) # only now: Δ folded into the peer's e in place, Δ̂ back
        # encoded + result.metadata → a signed contribution, staged with e and result.optimizer_after
    else:
        result.reason                      # Skipped: nothing to send, e is unchanged

The error-feedback buffer ``e`` belongs to the peer: a trainer never keeps one, and touches it only
when the peer calls :attr:`Trained.fold`, which the peer does once it knows the window is still
worth sending. Δ is formed there, tensor by tensor against ``theta`` (which the peer leaves
untouched until then, even when an aggregate arrived meanwhile), so that neither a second e nor a
whole Δ is ever held. The inner optimizer lives in the trainer (its moments are large and stay on
the device); ``optimizer_after`` is its state_dict at the end of the window, for the peer's commits.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from protocol.aggregate import SparseDict
from protocol.codec import Encoded
from protocol.data.tokens import DataUsage
from protocol.feedback import FeedbackBuffers, FeedbackState
from protocol.wire import PipelineRole

__all__ = ["Skipped", "Trained", "WindowJob", "WindowStats", "WindowTrainer", "hardware_of"]

Metadata = Mapping[str, int | float | str | bool]


@dataclass(frozen=True)
class WindowJob:
    """Everything one window's training starts from.

    ``window``: the window the contribution is for. ``theta``: the newest synchronised θ the peer
    holds (CPU float32; the trainer reads it, never writes it): θ_window, or with
    ``outer.delay = 1`` θ_window−1 while aggregate window−1 is in flight. ``base``: digest of the
    aggregate θ came from (the launch at window 0). ``feedback``: e before the window (a view; a
    trainer that computes e′ as a value starts from it). ``report``: live progress fields for the
    peer's display. ``should_stop``: polled between inner steps; a true answer abandons the window.
    ``stand_in``: the working model starts from θ − ``alpha``·stand_in (``outer.eager``: the
    forecast of the aggregate in flight, :mod:`client.forecast`); empty otherwise.

    ``between_steps(done)``: called before the first inner step and after each one (``done`` steps
    taken). The peer finishes background work there, and applies the aggregate in flight to
    ``theta`` in place when it arrives (it may also wait for it). It returns how the working model
    must move so that it stays θ − α·stand-in plus this window's progress: a list of
    ``(Δ, scale)``, each meaning θ_local ← θ_local − scale·Δ (the aggregate that arrived, the
    stand-in taken back or replaced by a newer forecast). A trainer that cannot move mid-window
    says so (:attr:`WindowTrainer.shifts`), and the peer gives it a window only once θ opens it.
    """

    window: int
    theta: Mapping[str, Tensor]
    base: str
    feedback: FeedbackState
    report: Callable[..., None]
    should_stop: Callable[[], bool]
    stand_in: SparseDict = field(default_factory=dict)
    alpha: float = 1.0
    between_steps: Callable[[int], Sequence[tuple[SparseDict, float]]] = lambda done: ()

    def report_step(self, step: int, steps: int, loss: float, tokens: int, started: float) -> None:
        """Report inner step ``step`` of ``steps`` done: its loss and the tokens/s since ``started``
        (a ``time.perf_counter()``), the same for every trainer."""
        elapsed = time.perf_counter() - started
        self.report(
            phase="training",
            window=self.window,
            step=step,
            steps=steps,
            loss=loss,
            tokens_per_s=tokens / max(elapsed, 1e-9),
        )


@dataclass(frozen=True)
class WindowStats:
    """What the window's training cost and achieved (losses are training-batch means).
    ``stale_steps``: inner steps taken before θ held the aggregate that opens the window.
    ``forecast_wait_s``: of ``inner_s``, the wait for the forecast before the first step;
    ``aggregate_wait_s``: of ``inner_s``, the wait mid-window for the aggregate that opens it (a
    validator that is slow or down). ``data``: what reaching the run's data cost since the last
    trained window (fetches, cache hits)."""

    loss_first: float
    loss_last: float
    tokens: int
    inner_s: float
    compress_s: float
    stale_steps: int = 0
    forecast_wait_s: float = 0.0
    aggregate_wait_s: float = 0.0
    data: DataUsage = DataUsage()


@dataclass(frozen=True)
class Trained:
    """A window trained to the end; nothing of it has reached e yet.

    ``fold(e, stand_in)``: fold the window's Δ = (θ − α·stand_in) − θ_local into the peer's ``e`` in
    place (error feedback + codec on this trainer's parameters), with θ as the peer holds it now and
    ``stand_in`` what is still in the working model of it, and return Δ̂ by tensor name; called at
    most once, before θ changes again and before the trainer trains again, and only if the peer
    still sends the window. ``metadata``:
    the contribution's metadata. ``optimizer_after``: the inner optimizer's state_dict after the
    window; it shares tensors with the live optimizer, so it is written before the trainer trains
    again (or not at all).
    """

    fold: Callable[[FeedbackBuffers, SparseDict], Mapping[str, Encoded]]
    metadata: Metadata
    stats: WindowStats
    optimizer_after: Mapping[str, Any]


@dataclass(frozen=True)
class Skipped:
    """Nothing to send for the window: ``reason`` says why; ``inner_s`` is the training time spent."""

    reason: str
    inner_s: float = 0.0


class WindowTrainer(Protocol):
    """How a peer trains a window (see the module docstring)."""

    @property
    def role(self) -> PipelineRole | None:
        """The pipeline role announced with the peer (None for a full replica)."""
        ...

    @property
    def hardware(self) -> str:
        """What the training runs on, as announced (device, machine, torch version)."""
        ...

    @property
    def step(self) -> int:
        """Global inner step after the last trained one."""
        ...

    @property
    def shifts(self) -> bool:
        """Whether the trainer moves its working model by the aggregates ``between_steps`` returns
        (see :class:`WindowJob`); one that cannot is given a window only once θ opens it."""
        ...

    def train(self, job: WindowJob) -> Trained | Skipped:
        """H inner steps from ``job.theta``, then error feedback + codec on this trainer's Δ."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state (moments and step), for the peer's state directory."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ConfigError if it does not fit this trainer."""
        ...


def hardware_of(device: torch.device) -> str:
    """The announced hardware string: device type, machine and torch version."""
    return f"{device.type} {platform.machine()} torch {torch.__version__}"
