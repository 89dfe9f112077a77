"""What the benchmarks measure memory with: the largest growth of this process's resident memory
while a ``with`` block runs (Linux ``/proc``; sampled every 5 ms)."""

from __future__ import annotations

import os
import threading


class RssPeak:
    """Largest growth of this process's resident memory while ``with`` runs (sampled every 5 ms)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> RssPeak:
        self.base = self.rss()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss() - self.base)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss() - self.base)
