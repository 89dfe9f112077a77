"""A window's work as a value: what a peer trains, and the one interface both ways of training share.

A peer trains each window in one of two ways, and holds the one it was started with:

* a full replica (:class:`client.replica.FullReplica`): the whole model and its inner optimizer;
* one stage of a pipeline replica (:class:`client.pipeline.trainer.StageTrainer`): a slice of the
  layers, trained together with the other stages of its group.

Both answer :meth:`WindowTrainer.train` with a value and change nothing the peer owns::

    result = trainer.train(WindowJob(window, theta, base, feedback, report=show.update, should_stop=...))
    if isinstance(result, Trained):
        # result.encoded + result.metadata → a signed contribution; result.feedback_after and
        # result.optimizer_after are adopted in the same commit that stages it (client/peer.py)
    else:
        result.reason                      # Skipped: nothing to send, e is unchanged

The error-feedback state ``e`` is an input and ``feedback_after`` an output: a trainer never keeps
one. The inner optimizer lives in the trainer (its moments are large and stay on the device);
``optimizer_after`` is its state_dict at the end of the window, for the peer's commit.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from protocol.codec import Encoded
from protocol.feedback import FeedbackState
from protocol.tokens import DataUsage
from protocol.wire import PipelineRole

__all__ = ["Skipped", "Trained", "WindowJob", "WindowStats", "WindowTrainer", "hardware_of"]

Metadata = Mapping[str, int | float | str | bool]


@dataclass(frozen=True)
class WindowJob:
    """Everything one window's training starts from.

    ``theta``: θ_window, the synchronised parameters (CPU float32; read, never written).
    ``base``: digest of the aggregate θ came from (``GENESIS`` at window 0). ``feedback``: e before
    the window. ``report``: live progress fields for the peer's display. ``should_stop``: polled
    between inner steps; a true answer abandons the window.
    """

    window: int
    theta: Mapping[str, Tensor]
    base: str
    feedback: FeedbackState
    report: Callable[..., None]
    should_stop: Callable[[], bool]


@dataclass(frozen=True)
class WindowStats:
    """What the window's training cost and achieved (losses are training-batch means). ``data``:
    what reaching the run's data cost since the last trained window (fetches, cache hits)."""

    loss_first: float
    loss_last: float
    tokens: int
    inner_s: float
    compress_s: float
    data: DataUsage = DataUsage()


@dataclass(frozen=True)
class Trained:
    """A window trained and compressed: the parts of a contribution and the state that goes with it.

    ``encoded``: Δ̂ by tensor name (only this trainer's parameters). ``metadata``: the contribution's
    metadata. ``feedback_after``: e after the compress step that produced ``encoded``.
    ``optimizer_after``: the inner optimizer's state_dict after the window; it may share tensors
    with the live optimizer, so it is committed before the trainer trains again.
    """

    encoded: Mapping[str, Encoded]
    metadata: Metadata
    stats: WindowStats
    feedback_after: FeedbackState
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
