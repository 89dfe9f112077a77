"""The peer's background lane: state commits and contribution puts, one at a time, in order.

Committing e (4 bytes per parameter, fsynced) and putting a contribution take seconds on a large
model. The peer hands them to this lane and trains the next window meanwhile (:mod:`client.peer`).
Jobs run in submission order on one thread, so a commit is durable before the put submitted after
it (write-ahead), and two commits never interleave::

    lane = Lane()
    saved = lane.submit(state.save, snapshot)
    put = lane.submit(put_after, saved)     # runs after the save, on the same thread
    lane.drain()                             # every job done; re-raises the first failure

What a job reads (e's tensors, for one) must not change until the job is done: the peer drains the
lane before it changes e.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["Lane"]

T = TypeVar("T")


class Lane:
    """One worker thread running jobs first in, first out (see the module docstring)."""

    def __init__(self, name: str = "peer-lane") -> None:
        self._name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._jobs: list[Future[Any]] = []

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` after every job submitted before it."""
        job = self._pool.submit(fn, *args, **kwargs)
        self._jobs = [j for j in self._jobs if not j.done()] + [job]
        return job

    def busy(self) -> bool:
        """Whether a job is queued or running."""
        return any(not j.done() for j in self._jobs)

    def drain(self) -> None:
        """Wait for every job; the first one that raised raises here (after all have ended)."""
        jobs = list(self._jobs)
        failure: BaseException | None = None
        for job in jobs:
            exc = job.exception()
            if exc is not None and failure is None:
                failure = exc
        self._jobs = [j for j in self._jobs if j not in jobs]
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Finish the queued jobs and end the thread (a later :meth:`submit` starts a new one)."""
        self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
