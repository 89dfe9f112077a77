"""A peer that is one stage of a pipeline replica (``sparseloco-peer join --pipeline GROUP ...``).

Everything but the training phase is the ordinary :class:`client.peer.Peer`: it announces itself
(with its pipeline role), keeps the full synchronised θ on CPU, applies and verifies every
aggregate, checkpoints its error feedback and optimizer, and signs and uploads its own contribution.
Only ``train_and_compress`` differs: the stage trains its slice together with the other stages of
its group (:func:`client.pipeline.replica.run_stage_window`) on the batches assigned to the group,
and its contribution holds only its own parameters, with metadata naming group and stage. A stage
that cannot finish the window with the others skips it, like a peer that missed the deadline.

    peer = PipelinePeer(spec, store, identity, state, group="g1", stage=0, stages=2,
                        rendezvous="10.0.0.5:29500", device="cuda")
    peer.run()
"""

from __future__ import annotations

import platform
import time

import torch

from client.peer import Peer, Trained
from client.pipeline.replica import PipelineStage, replica_batches, run_stage_window
from client.progress import PeerDisplay
from client.state import LocalState
from protocol import layout
from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.store.base import ObjectStore
from protocol.wire import Announcement, Contribution, PipelineRole, encode_announcement, encode_contribution

__all__ = ["PipelinePeer"]


class PipelinePeer(Peer):
    """Stage ``stage`` of ``stages`` of pipeline replica ``group``; see the module docstring."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state: LocalState,
        *,
        group: str,
        stage: int,
        stages: int,
        rendezvous: str,
        device: str = "cpu",
        display: PeerDisplay | None = None,
        backend: str = "gloo",
    ) -> None:
        if not spec.pipeline.enabled:
            raise ConfigError("this run does not accept pipeline replicas (pipeline.enabled = false)")
        # θ and the unused full model stay on the CPU; only this stage's slice goes to the device.
        super().__init__(spec, store, identity, state, device="cpu", display=display)
        self.role = PipelineRole(group, stage, stages)
        self.rendezvous = rendezvous
        self.pipeline = PipelineStage(spec, group=group, stage=stage, stages=stages, device=device, backend=backend)
        self.pipeline.feedback = self.feedback  # one error-feedback state, checkpointed by the peer
        self.trainer = self.pipeline  # type: ignore[assignment]  # same state_dict shape: checkpointed too
        self.stage_device = torch.device(device)

    def announce(self) -> None:
        hardware = f"{self.stage_device.type} {platform.machine()} torch {torch.__version__}"
        ann = Announcement(self.spec.hash(), 0, "sparseloco-peer/0.1", hardware, role=self.role)
        self._put_with_retry(layout.peer_key(self.run_id, self.identity.peer_id), encode_announcement(ann, self.identity))

    def train_and_compress(self, window: int) -> Trained | None:
        """This stage's share of the replica's H steps, then error feedback + codec on its slice."""
        if not self._window_open(window):
            self._skip(window, "window closed before training started")
            return None
        self.display.update(phase=f"pipeline stage {self.role.stage}/{self.role.stages}", window=window)
        batches = replica_batches(self.dataset, self.spec, self.role.group, window)
        previous = dict(self.feedback.buffers)  # compress_step replaces buffers, never mutates them
        result = run_stage_window(self.pipeline, self.params, window, self.pos.base, batches,
                                  rendezvous=self.rendezvous)
        self.inner_s += result.seconds
        if not result.ok:
            self._skip(window, f"pipeline {result.reason}: {result.detail}")
            return None
        t1 = time.perf_counter()
        contribution = Contribution(self.spec.hash(), window, self.pos.base, self.spec.codec,
                                    dict(result.encoded), dict(result.metadata))
        blob = encode_contribution(contribution, self.identity)
        self._previous_feedback = previous
        return Trained(window, blob, result.mean_loss, result.mean_loss, result.tokens, result.seconds,
                       time.perf_counter() - t1)
