"""The processes of one data-parallel peer: a process group, the commands rank 0 sends, bounded waits.

One peer uses every GPU of its host: ``torchrun --nproc-per-node N sparseloco-peer join …`` starts
N processes (ranks). Rank 0 is the peer; ranks 1…N−1 only train, on rank 0's commands::

    ranks = RankGroup.from_torchrun(device="cuda", timeout_s=300)   # under torchrun (env://)
    ranks = RankGroup.open(rank, world, "tcp://127.0.0.1:29500", device="cpu")   # tests, launchers

    # rank 0                                     # every other rank
    with ranks.leading():                        cmd = ranks.receive()
        ranks.send(Command(TRAIN, step, n))      ...

Every collective is bounded by ``timeout_s``: a dead or stuck rank becomes a :class:`RankLost`,
never a hang. Between windows rank 0 waits for the swarm (aggregates, genesis) for as long as it
takes, so while it holds no command it sends a heartbeat every few seconds (:meth:`keep_alive`);
the other ranks wait for commands with the same bound and notice a dead rank 0 the same way.

Backend: NCCL on CUDA (tensors stay on the GPU), gloo on the CPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from protocol.devices import resolve_device
from protocol.errors import ConfigError, ReasonedError

__all__ = [
    "ABORT",
    "HEARTBEAT",
    "LOAD",
    "STEP",
    "STOP",
    "TRAIN",
    "Command",
    "RankGroup",
    "RankLost",
    "rank_device",
    "torchrun_world",
]

# Commands (the first field of a command header).
HEARTBEAT, TRAIN, STEP, ABORT, LOAD, STOP = range(6)
HEARTBEAT_S = 2.0  # how often an idle rank 0 tells the others it is alive
HEADER = 4  # int64 fields of a command header


class RankLost(ReasonedError):
    """A rank of this data-parallel peer died, stalled past the collective timeout, or went away."""

    reason = "rank_lost"


@dataclass(frozen=True)
class Command:
    """What rank 0 tells the others: ``op`` and up to three integer arguments."""

    op: int
    a: int = 0
    b: int = 0
    c: int = 0


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


def rank_device(device: str, local_rank: int) -> str:
    """This rank's device: a bare ``cuda`` becomes ``cuda:LOCAL_RANK`` (checked, and made current)."""
    if device == "cuda":
        device = f"cuda:{local_rank}"
    device = resolve_device(device)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    return device


class RankGroup:
    """The process group of one data-parallel peer (see the module docstring)."""

    def __init__(self, rank: int, world: int, device: str, timeout_s: float) -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self._lock = threading.Lock()  # rank 0: commands of the main thread and the heartbeat in order
        self._beating: threading.Thread | None = None
        self._stopped = threading.Event()
        self.lost: RankLost | None = None  # set once a collective failed (a rank went away)

    @classmethod
    def open(
        cls, rank: int, world: int, init_method: str, *, device: str = "cpu", timeout_s: float = 300.0
    ) -> RankGroup:
        """Join the group at ``init_method`` (``env://`` under torchrun, ``tcp://HOST:PORT``)."""
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} outside 0..{world - 1}")
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        try:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
        except (RuntimeError, ValueError) as exc:
            raise RankLost(f"the ranks of this peer did not meet at {init_method}: {exc}") from exc
        return cls(rank, world, device, timeout_s)

    @classmethod
    def from_torchrun(cls, device: str, *, timeout_s: float = 300.0) -> RankGroup:
        """This process's rank of a ``torchrun`` launch; ``device`` as :func:`rank_device` makes it."""
        world = torchrun_world()
        if world is None:
            raise ConfigError("not started by torchrun with more than one process (WORLD_SIZE)")
        rank, size, local_rank = world
        return cls.open(rank, size, "env://", device=rank_device(device, local_rank), timeout_s=timeout_s)

    # ------------------------------------------------------------------ commands
    @contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0: hold the group for a sequence of commands (the heartbeat waits meanwhile)."""
        with self._lock:
            yield

    def send(self, cmd: Command) -> None:
        """Rank 0 (inside :meth:`leading`): broadcast a command header."""
        header = torch.tensor([cmd.op, cmd.a, cmd.b, cmd.c], dtype=torch.int64, device=self._wire)
        self._broadcast(header, "command")

    def receive(self) -> Command:
        """Other ranks: the next command that is not a heartbeat."""
        while True:
            header = torch.zeros(HEADER, dtype=torch.int64, device=self._wire)
            self._broadcast(header, "waiting for rank 0")
            op, a, b, c = (int(v) for v in header.tolist())
            if op != HEARTBEAT:
                return Command(op, a, b, c)

    def keep_alive(self, on_lost: Callable[[RankLost], None]) -> None:
        """Rank 0: start the heartbeat thread; ``on_lost`` runs (in that thread) if a rank is gone."""

        def beat() -> None:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            while not self._stopped.wait(HEARTBEAT_S):
                try:
                    with self._lock:
                        if self._stopped.is_set():
                            return
                        self.send(Command(HEARTBEAT))
                except RankLost as exc:
                    on_lost(exc)
                    return

        self._beating = threading.Thread(target=beat, name="sparseloco-ranks-heartbeat", daemon=True)
        self._beating.start()

    def close(self) -> None:
        """Stop the heartbeat, tell the other ranks to exit (rank 0, while the group works), leave it."""
        self._stopped.set()
        if self._beating is not None:
            self._beating.join()
        if self.rank == 0 and self.lost is None:
            try:
                with self.leading():
                    self.send(Command(STOP))
            except RankLost:
                pass  # a rank that is gone needs no stop command
        if dist.is_initialized() and self.lost is None:  # a broken NCCL group may block on destroy
            dist.destroy_process_group()

    # ------------------------------------------------------------------ tensors
    def broadcast(self, tensors: Sequence[Tensor]) -> None:
        """Rank 0's values of ``tensors`` (on this rank's device) into every rank's, in place."""
        for t in tensors:
            self._broadcast(t, "broadcast")

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` (tensors on the CPU) on every rank."""
        box = [obj]
        self._run(lambda: dist.broadcast_object_list(box, src=0, device=self._wire), "broadcast_object")
        return box[0]

    def sum_(self, tensors: list[Tensor]) -> None:
        """Sum ``tensors`` (one dtype) over the ranks in place, as one flat all-reduce."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._run(lambda: dist.all_reduce(flat), "all_reduce")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    @property
    def _wire(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _broadcast(self, t: Tensor, what: str) -> None:
        self._run(lambda: dist.broadcast(t, src=0), what)

    def _run(self, op: Callable[[], object], what: str) -> None:
        try:
            op()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NCCL errors surface here, within the timeout
        except (RuntimeError, OSError, ValueError) as exc:
            # The group is unusable from here on: close() leaves the other ranks to torchrun.
            self.lost = RankLost(f"rank {self.rank} of {self.world}: {what} failed: {exc}")
            raise self.lost from exc
