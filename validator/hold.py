"""A restarted validator whose peers are gone holds its window instead of publishing it empty.

A validator restarted after its peers left (or before they are back: a host rebooted, a run paused
overnight) used to gather the open window, find no contribution and publish it empty at once —
the open window's upload deadline had usually passed while it was down. That opens the next
window at once, which nobody trains either, and so on: a run with no peers filled its chain with
empty aggregates that every returning peer then replays, and a peer coming back found the
window it could train already half over.

So the first window a restarted validator gathers (past genesis: :class:`RestartHold` is only
asked before the process has published anything; a run of one validator — with several, the
others go on) is **held** when nothing at all was uploaded to it: not published, until a peer is heard from, then published at once (empty: the uploads of a
window close with it). Its ``published_at`` opens the next window *then*, with its full upload
deadline for the peers that are back. Heard from means any of:

* an announcement first seen after the hold began: a new peer, one that withdrew and announced
  again, or one whose announcement changed (a peer announces again each time it joins, with the
  time it joined: a restarted peer is noticed even if it never withdrew). The hold re-reads the
  announcements every :data:`RECHECK_S` seconds;
* a grant to an announced peer (:meth:`heard_from`, called by the grant server's events): a peer
  waiting for the held window's aggregate asks for it.

**How peers stay in step.** Peers find the open window from the chain (:mod:`protocol.windows`):
window t opens when aggregate t − 1 is published, and its deadline is ``upload_deadline_s`` later.
While t is held, a peer that comes back finds t closed (its deadline long past), skips it and
waits for aggregate t (``client/peer/loop.py``); a peer on the overlapped schedule trains t + 1
meanwhile. Hearing from it ends the hold, aggregate t is published, and t + 1 opens with its whole
deadline, so the returning peers train and upload it like any other window.

The hold is said once as a ``window_held`` event (the window, the announcements tracked, the
bound); the grant server's ``/v1/info`` says ``waiting_for_peers: 1`` (``announced: 0``) while it
lasts. It is bounded by ``validator.restart_hold_s`` (a local setting;
default :data:`~protocol.settings.DEFAULT_RESTART_HOLD_S` = 1 h, 0 never holds): a peer that is
alive but invisible (it skipped the window, holds a store credential instead of asking for grants
and never announced again) is not kept waiting forever; past the bound the window is published
empty, as before.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from protocol.events import Event, WindowHeld
from validator.gather import Gathered, PeerRegistry

__all__ = ["RECHECK_S", "RestartHold"]

# How often a held window re-reads every announcement (a peer that joined again announced anew).
RECHECK_S = 5.0


class RestartHold:
    """Whether a restarted validator holds its first window, and the wait (module docstring)."""

    def __init__(
        self,
        registry: PeerRegistry,
        *,
        limit_s: float,
        poll_s: float,
        emit: Callable[[Event], None],
        stop: threading.Event,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry, self.limit_s, self.poll_s = registry, limit_s, poll_s
        self.emit, self.stop, self.clock = emit, stop, clock
        self.armed = True  # until this process publishes a window
        self._heard: dict[str, float] = {}  # peer -> when it last asked for a grant
        self._held: tuple[int, float] | None = None  # (window, since when): a retry holds on from there
        self._lock = threading.Lock()

    def published(self) -> None:
        """This process published a window: later windows are never held."""
        self.armed = False

    def heard_from(self, peer: str) -> None:
        """``peer`` asked for a grant (the grant server's threads call this)."""
        with self._lock:
            self._heard[peer] = self.clock()

    def needed(self, window: int, gathered: Gathered) -> bool:
        """Hold ``window``: this process has published nothing yet, the run is past genesis, the
        setting allows it, and nobody uploaded anything to it (not even something rejected)."""
        return self.armed and window > 0 and self.limit_s > 0 and not gathered.received and not gathered.unannounced

    def wait(self, window: int) -> bool:
        """Until a peer is heard from or the bound passes (True: publish now), or the validator is
        stopped (False: nothing published, a restart holds again)."""
        if self._held is None or self._held[0] != window:
            self._held = (window, self.clock())
            live = set(self.registry.announcements) - self.registry.withdrawn
            self.emit(WindowHeld(window=window, announced=len(live), hold_s=self.limit_s))
        since = self._held[1]
        registry = self.registry
        while not self.stop.is_set():
            registry.refresh()
            registry.recheck(set(registry.announcements), RECHECK_S)  # a peer that joined again
            if self.heard(since) or self.clock() - since >= self.limit_s:
                return True
            self.stop.wait(max(self.poll_s, 1.0))  # a LIST per look, for as long as the hold lasts
        return False

    def heard(self, since: float) -> int:
        """How many announced peers were heard from at or after ``since``."""
        registry = self.registry
        with self._lock:
            granted = {p for p, at in self._heard.items() if at >= since}
        seen = {p for p, at in registry.first_seen.items() if at >= since and not math.isinf(at)}
        return len((granted & set(registry.announcements) | seen) - registry.withdrawn)
