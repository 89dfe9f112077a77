"""A data-parallel replica: one peer, one contribution, the whole model trained on every GPU of a host.

Rank 0 holds a :class:`DataParallelReplica` (the peer's :class:`~client.window.WindowTrainer`);
every other rank runs :func:`serve_rank` on its :class:`RankModel` until rank 0 stops it::

    ranks = RankGroup.from_torchrun(device)
    if ranks.rank == 0:
        trainer = DataParallelReplica(spec, ranks, data_key=identity.peer_id, device=ranks.device, data=…)
        Peer(spec, store, identity, state, trainer).run()
    else:
        serve_rank(RankModel(spec, ranks))

A window: rank 0 gets the peer's batches (the data feed, as a full replica), loads θ_t and
broadcasts it, so ranks never drift whatever their floating point did before; then, for every inner
step, rank 0 broadcasts the batch, each rank trains its contiguous share of the rows, and the
gradients are summed over the ranks before clipping (:class:`client.trainer.InnerTrainer` with
``reduce``). Every rank thus takes the step one process takes on the whole batch (equal up to
float summation order), and every rank's inner optimizer holds the same moments. Rank 0 alone
computes Δ, applies error feedback and compresses: e, the signature and the upload are the peer's,
exactly as with a full replica.

A rank that dies or stalls stops the window with :class:`~client.ddp.ranks.RankLost`, which stops
the peer (it withdraws); torchrun then ends the other ranks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from client.data_feed import DataFeed, skip_reason
from client.ddp.ranks import ABORT, LOAD, STEP, STOP, TRAIN, Command, RankGroup
from client.replica import fold_window
from client.trainer import InnerTrainer, load_params
from client.window import Skipped, Trained, WindowJob, WindowStats, hardware_of
from protocol.config import RunSpec
from protocol.data.tokens import TokenDataset
from protocol.errors import ProtocolError, StoreError
from protocol.model import build_model, parameters_of
from protocol.wire import PipelineRole

__all__ = ["DataParallelReplica", "RankModel", "serve_rank", "share_of"]


def share_of(batch: Tensor, rank: int, world: int) -> Tensor:
    """The contiguous rows of ``batch`` that ``rank`` trains (sizes differ by at most one row)."""
    return batch.tensor_split(world)[rank]


class RankModel:
    """What every rank holds: the model and its inner optimizer, gradients summed over the ranks
    (``micro_batch_size``: accumulation over this rank's share of each batch)."""

    def __init__(self, spec: RunSpec, ranks: RankGroup, micro_batch_size: int = 0) -> None:
        self.ranks = ranks
        self.model = build_model(spec.model).to(ranks.device)
        self.trainer = InnerTrainer(
            self.model, spec.inner, ranks.device, micro_batch_size=micro_batch_size, reduce=ranks.sum_
        )
        self._params = [p for _, p in sorted(parameters_of(self.model).items())]

    def broadcast_theta(self) -> None:
        self.ranks.broadcast([p.detach() for p in self._params])

    def step(self, batch: Tensor) -> float:
        """One inner step on this rank's share of ``batch``; the loss over the whole batch."""
        share = share_of(batch, self.ranks.rank, self.ranks.world)
        return self.trainer.train_window([share], rows=batch.shape[0]).mean_loss


class DataParallelReplica:
    """A :class:`~client.window.WindowTrainer` on rank 0 of a data-parallel peer.

    Arguments as :class:`client.replica.FullReplica`, plus ``ranks`` (rank 0 of its group); the
    device is the group's."""

    def __init__(
        self,
        spec: RunSpec,
        ranks: RankGroup,
        *,
        data_key: str,
        data: Callable[[], TokenDataset] | None = None,
        micro_batch_size: int = 0,
    ) -> None:
        if ranks.rank != 0:
            raise ValueError("DataParallelReplica runs on rank 0; the other ranks run serve_rank")
        self.spec, self.ranks = spec, ranks
        self.data = DataFeed(spec, key=data_key, opener=data)
        self.local = RankModel(spec, ranks, micro_batch_size)

    @property
    def role(self) -> PipelineRole | None:
        return None

    @property
    def hardware(self) -> str:
        return f"{self.ranks.world}x {hardware_of(self.ranks.device)}"

    @property
    def step(self) -> int:
        return self.local.trainer.step

    @property
    def shifts(self) -> bool:
        """No: θ is broadcast to every rank when a window starts, and moving every rank's working
        model mid-window (the overlapped schedule) is not done; the peer gives this trainer a window
        only once θ opens it, as it does a pipeline stage."""
        return False

    def train(self, job: WindowJob) -> Trained | Skipped:
        """H inner steps over all ranks from θ_t on this peer's batches, then error feedback + codec."""
        try:
            batches = self.data.batches(job.window)
        except (ProtocolError, StoreError) as exc:  # never trained on data that did not verify
            return Skipped(skip_reason(exc))
        load_params(self.local.model, job.theta)
        t0 = time.perf_counter()
        losses: list[float] = []
        tokens = 0
        with self.ranks.leading():
            self.ranks.send(Command(TRAIN, self.step))
            self.local.broadcast_theta()
            for i, batch in enumerate(batches):
                losses.append(self.local.step(self._send_batch(batch)))
                tokens += batch.shape[0] * (batch.shape[1] - 1)
                job.report_step(i + 1, len(batches), losses[-1], tokens, t0)
                if job.should_stop():
                    self.ranks.send(Command(ABORT))
                    return Skipped("stopped", inner_s=time.perf_counter() - t0)
            self.ranks.send(Command(ABORT))  # the window's steps are done
        inner_s = time.perf_counter() - t0
        meta = {"loss_first": losses[0], "loss_last": losses[-1], "tokens": tokens, "inner_s": round(inner_s, 3)}
        stats = WindowStats(losses[0], losses[-1], tokens, inner_s, 0.0, data=self.data.take_usage())
        fold = functools.partial(fold_window, self.spec, job.window, self.local.model, job.theta, job.alpha)
        return Trained(fold, meta, stats, self.local.trainer.state_dict())

    def _send_batch(self, batch: Tensor) -> Tensor:
        """Send the inner step's batch [B, T+1] to every rank; rank 0's copy of it, as they hold it."""
        self.ranks.send(Command(STEP, batch.shape[0], batch.shape[1]))
        sent = batch.to(self.ranks.device, torch.int64)
        self.ranks.broadcast([sent])
        return sent

    def state_dict(self) -> dict[str, Any]:
        return self.local.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the inner optimizer on every rank (ConfigError if it does not fit the model)."""
        self.local.trainer.load_state_dict(state)
        with self.ranks.leading():
            self.ranks.send(Command(LOAD))
            self.ranks.broadcast_object(_to_cpu(self.local.trainer.state_dict()))


def serve_rank(local: RankModel) -> None:
    """Ranks 1…N−1: train ``local`` on rank 0's commands until it sends STOP (RankLost if it is gone)."""
    ranks = local.ranks
    cmd = ranks.receive()
    while cmd.op != STOP:
        if cmd.op == LOAD:
            local.trainer.load_state_dict(ranks.broadcast_object(None))
        elif cmd.op == TRAIN:
            local.trainer.step = cmd.a  # the schedule position rank 0 trains from
            local.broadcast_theta()
            cmd = _serve_steps(local)
            if cmd.op == STOP:  # rank 0 left in the middle of a window
                return
        cmd = ranks.receive()


def _serve_steps(local: RankModel) -> Command:
    """The window's inner steps; returns the command that ended them (ABORT, or STOP)."""
    while (cmd := local.ranks.receive()).op == STEP:
        batch = torch.empty((cmd.a, cmd.b), dtype=torch.int64, device=local.ranks.device)
        local.ranks.broadcast([batch])
        local.step(batch)
    return cmd


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (what another rank unpickles onto its own device)."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
