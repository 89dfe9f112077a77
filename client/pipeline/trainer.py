"""One stage of a pipeline replica as the way a peer trains its windows (``join --pipeline``).

The peer is the ordinary :class:`client.peer.Peer` (announce, catch up, stage, upload, commit);
it holds a :class:`StageTrainer` instead of a full replica. The stage trains its slice together
with the other stages of its group (:func:`client.pipeline.replica.run_stage_window`) on the
batches assigned to the group, and its contribution holds only its own parameters, with metadata
naming group and stage. A stage that cannot finish the window with the others skips it, like a
peer that missed the deadline. θ stays on the CPU in the peer; only this stage's slice is built,
on ``device``.

    trainer = StageTrainer(spec, group="g1", stage=0, stages=2, rendezvous="10.0.0.5:29500", device="cuda")
    Peer(spec, store, identity, state, trainer).run()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from client.data_feed import DataFeed, skip_reason
from client.pipeline.replica import PipelineStage, pipeline_peer_key, run_stage_window
from client.window import Skipped, Trained, WindowJob, WindowStats, hardware_of
from protocol.aggregate import SparseDict
from protocol.codec import Encoded
from protocol.config import RunSpec
from protocol.data.tokens import TokenDataset
from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.feedback import FeedbackBuffers
from protocol.wire import PipelineRole

__all__ = ["StageTrainer"]


class StageTrainer:
    """A :class:`~client.window.WindowTrainer` for stage ``stage`` of ``stages`` of replica ``group``."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        group: str,
        stage: int,
        stages: int,
        rendezvous: str,
        device: torch.device | str = "cpu",
        backend: str = "gloo",
        data: Callable[[], TokenDataset] | None = None,
    ) -> None:
        if not spec.pipeline.enabled:
            raise ConfigError("this run does not accept pipeline replicas (pipeline.enabled = false)")
        self.spec, self.rendezvous = spec, rendezvous
        self.pipeline = PipelineStage(spec, group=group, stage=stage, stages=stages, device=device, backend=backend)
        self.data = DataFeed(spec, key=pipeline_peer_key(group), opener=data)  # the replica's batches
        self._role = PipelineRole(group, stage, stages)

    @property
    def role(self) -> PipelineRole | None:
        return self._role

    @property
    def hardware(self) -> str:
        return hardware_of(self.pipeline.device)

    @property
    def step(self) -> int:
        return self.pipeline.step

    @property
    def shifts(self) -> bool:
        """No: the stages of a replica agree on θ's base when the window starts and cannot move
        together mid-window, so a stage trains a window only once θ opens it."""
        return False

    def train(self, job: WindowJob) -> Trained | Skipped:
        """This stage's share of the replica's H steps, then error feedback + codec on its slice.

        The stages compute e′ as a value (from ``job.feedback``, a view of the peer's e): the fold
        hands it to the peer's e. A stage holds a slice of θ, so the copies this costs are the
        slice's size."""
        role = self._role
        job.report(phase=f"pipeline stage {role.stage}/{role.stages}", window=job.window)
        try:
            batches = self.data.batches(job.window)  # the same on every stage of the replica
        except (ProtocolError, StoreError) as exc:
            return Skipped(skip_reason(exc))
        result = run_stage_window(
            self.pipeline, job.theta, job.window, job.base, batches, rendezvous=self.rendezvous, feedback=job.feedback
        )
        after = result.feedback_after
        if not result.ok or after is None:
            return Skipped(f"pipeline {result.reason}: {result.detail}", inner_s=result.seconds)
        stats = WindowStats(
            result.mean_loss, result.mean_loss, result.tokens, result.seconds, 0.0, data=self.data.take_usage()
        )
        encoded = dict(result.encoded)

        def fold(e: FeedbackBuffers, stand_in: SparseDict) -> dict[str, Encoded]:
            e.adopt(after)  # a stage trains from θ itself: there is never a stand-in
            return encoded

        return Trained(fold, result.metadata, stats, self.pipeline.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return self.pipeline.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pipeline.load_state_dict(state)
