"""A private asyncio event loop on a background thread, for running a hivemind ``DHTNode``.

Why not ``hivemind.DHT``: it runs the node in a child process fed by a multiprocessing pipe, and
with a current uvloop that pipe is left non-blocking, so any value over ~32 KiB hangs or kills the
child (hivemind PR #660). Running ``DHTNode`` directly in our own loop has no pipe and no trap; the
synchronous store API submits coroutines with :meth:`LoopThread.run`.

Orphans: the node's ``p2pd`` daemon is started by this loop, and on Linux it gets
``PR_SET_PDEATHSIG = SIGKILL`` so that it dies with the loop thread even if this process is killed
with SIGKILL (normal shutdown terminates it through ``DHTNode.shutdown``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[[int, int], int] | None:
    # Resolved before any fork: a preexec_fn must not import or allocate much.
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    prctl: Callable[[int, int], int] = libc.prctl
    return prctl


_PRCTL = _load_prctl()


def _die_with_parent_thread() -> None:
    """preexec_fn: SIGKILL the child when the thread that forked it (our loop thread) dies."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


class _OrphanFreeLoop(asyncio.SelectorEventLoop):
    """Selector loop whose subprocesses (hivemind's p2pd) die with the loop thread."""

    async def subprocess_exec(self, protocol_factory: Any, program: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", _die_with_parent_thread)
        return await super().subprocess_exec(protocol_factory, program, *args, **kwargs)


class LoopThread:
    """Owns one event loop running forever on a daemon thread until :meth:`stop`.

    Daemon, so that ``atexit`` handlers (which run while daemon threads still live) can use the loop
    to shut nodes down cleanly; a non-daemon thread would make the interpreter wait forever first.
    """

    def __init__(self, name: str = "dht-loop") -> None:
        self.loop: asyncio.AbstractEventLoop = _OrphanFreeLoop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # hivemind leaves background tasks (cache refresh, readers); cancel them quietly.
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for it; on timeout cancel it and raise ``TimeoutError``."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop (would deadlock)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"DHT operation did not finish in {timeout} s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join the thread. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
