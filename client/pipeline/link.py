"""The connection between the stages of one pipeline replica for one window.

Stages meet at a rendezvous ``HOST:PORT``: stage 0 serves a ``torch.distributed`` TCPStore there,
the others connect to it. A fresh process group is formed for every window (keys prefixed by the
window), so a stage that died and restarted simply meets the others at the next window, and stages
at different windows never pair up. Every wait is bounded by ``timeout_s``; a dead, stuck or
mismatched stage becomes a :class:`~protocol.errors.PipelineFailure` (the replica skips the
window), never a hang.

Tensors travel over gloo as CPU float32 (activations are small once compressed, and gloo reports
a dead peer as an error instead of aborting the process); ``backend="nccl"`` keeps them on the GPU.

    with StageLink("127.0.0.1:29500", stage=1, stages=2, window=7, timeout_s=60) as link:
        link.agree("base", base_digest)          # every stage trained from the same aggregate
        x = link.recv((8, 128, 16), src=0)
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from protocol.errors import ConfigError, PipelineFailure

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store, Work

__all__ = ["StageLink", "free_port", "parse_rendezvous"]


def parse_rendezvous(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); raises ConfigError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"rendezvous must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _failure(exc: BaseException, what: str) -> PipelineFailure:
    text = str(exc).lower()
    reason = "timeout" if "timed out" in text or "timeout" in text else "peer_lost"
    return PipelineFailure(f"{what}: {exc}", reason=reason)


class _Group(Protocol):
    """What the link uses of a process-group backend (``ProcessGroupGloo``, ``ProcessGroupNCCL``)."""

    def send(self, tensors: list[Tensor], dstRank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[Tensor], srcRank: int, tag: int) -> Work: ...

    def allreduce(self, tensors: list[Tensor]) -> Work: ...

    def shutdown(self) -> None: ...


class StageLink:
    """A process group of the ``stages`` stages of one replica, for one window."""

    def __init__(
        self,
        rendezvous: str,
        *,
        stage: int,
        stages: int,
        window: int,
        timeout_s: float,
        rendezvous_timeout_s: float | None = None,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 <= stage < stages:
            raise ConfigError(f"stage {stage} outside 0..{stages - 1}")
        self.host, self.port = parse_rendezvous(rendezvous)
        self.stage, self.stages, self.window = stage, stages, window
        self.timeout = timedelta(seconds=timeout_s)
        # Stages reach a window at different times (one still syncing the aggregate): meeting may
        # take longer than any single exchange once they have met.
        self.meet_timeout = timedelta(seconds=max(timeout_s, rendezvous_timeout_s or 0.0))
        self.backend = backend
        self.device = torch.device(device)
        self.wire_device = self.device if backend == "nccl" else torch.device("cpu")
        self._store: Store | None = None
        self._group: _Group | None = None

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> StageLink:
        """Meet the other stages; retried until the rendezvous timeout (a previous window's server
        may still be closing, or the stage that serves the rendezvous may be restarting)."""
        deadline = time.monotonic() + self.meet_timeout.total_seconds()
        while True:
            try:
                return self._open_once(max(1.0, deadline - time.monotonic()))
            except PipelineFailure:
                if time.monotonic() + 0.5 >= deadline:
                    raise
                time.sleep(0.25)

    def _open_once(self, timeout_s: float) -> StageLink:
        timeout = timedelta(seconds=timeout_s)
        try:
            # Public API; torch.distributed re-exports TCPStore and PrefixStore without declaring them.
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                self.host,
                self.port,
                world_size=self.stages,
                is_master=self.stage == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise PipelineFailure(f"no rendezvous at {self.host}:{self.port}: {exc}", reason="rendezvous") from exc
        prefixed = dist.PrefixStore(f"sparseloco/window/{self.window}/", self._store)  # type: ignore[attr-defined]
        try:
            self.agree("hello", "1")  # waits (up to the rendezvous timeout) until every stage is here
            self._group = self._new_group(prefixed)
        except (PipelineFailure, RuntimeError, OSError) as exc:
            self.close()
            raise PipelineFailure(f"stages did not meet for window {self.window}: {exc}", reason="rendezvous") from exc
        return self

    def _new_group(self, store: Store) -> _Group:
        # The backends have send/recv/allreduce at runtime; torch's stubs declare them on
        # ProcessGroup only, hence the ignores.
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(store, self.stage, self.stages, self.timeout)  # type: ignore[return-value]
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, self.stage, self.stages, opts)  # type: ignore[return-value]
        raise ConfigError(f"unknown pipeline backend {self.backend!r} (gloo|nccl)")

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except RuntimeError:
                pass  # a broken group has nothing left to shut down
        self._store = None  # the master's server stops with its last reference

    def __enter__(self) -> StageLink:
        return self.open()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def group(self) -> _Group:
        if self._group is None:
            raise PipelineFailure("link is not open", reason="peer_lost")
        return self._group

    # ------------------------------------------------------------------ traffic
    def send(self, x: Tensor, dst: int, tag: int = 0) -> None:
        buf = x.detach().to(self.wire_device, torch.float32).contiguous()
        try:
            self.group.send([buf], dst, tag).wait(self.timeout)
        except (RuntimeError, OSError) as exc:
            raise _failure(exc, f"send to stage {dst}") from exc

    def recv(self, shape: tuple[int, ...], src: int, tag: int = 0) -> Tensor:
        buf = torch.empty(shape, dtype=torch.float32, device=self.wire_device)
        try:
            self.group.recv([buf], src, tag).wait(self.timeout)
        except (RuntimeError, OSError) as exc:
            raise _failure(exc, f"recv from stage {src}") from exc
        return buf.to(self.device)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over the stages (grad-norm clipping, loss, the end-of-window commit)."""
        buf = x.detach().to(self.wire_device, torch.float32).contiguous()
        try:
            self.group.allreduce([buf]).wait(self.timeout)
        except (RuntimeError, OSError) as exc:
            raise _failure(exc, "all_reduce") from exc
        return buf.to(x.device)

    def agree(self, key: str, value: str) -> None:
        """Every stage must hold the same ``value`` (window base, subspace digest, run hash)."""
        store = self._store
        if store is None:
            raise PipelineFailure("link is not open", reason="peer_lost")
        prefix = f"sparseloco/agree/{self.window}/{key}/"
        try:
            store.set(f"{prefix}{self.stage}", value)
            for other in range(self.stages):
                theirs = store.get(f"{prefix}{other}").decode()
                if theirs != value:
                    raise PipelineFailure(
                        f"stage {other} has {key}={theirs[:16]}…, stage {self.stage} has {value[:16]}…",
                        reason="mismatch",
                    )
        except (RuntimeError, OSError) as exc:
            raise _failure(exc, f"agreeing on {key}") from exc


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (tests and local launchers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])
