"""What every phase of a peer works with and none of them owns: the run, the store, the key, the
state directory, the trainer, the local settings, the display, the request to stop, and whether
the store answers (:class:`Outage`: one line when it stops answering, one when it answers again,
whichever phase noticed)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from client.metered import MeteredStore
from client.progress import PeerDisplay
from client.state import LocalState
from client.uplink import Backoff
from client.window import WindowTrainer
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.settings import LocalSettings

__all__ = ["Outage", "PeerContext"]

log = logging.getLogger(__name__)


class Outage:
    """The store (or the grant server) not answering, as one episode: :meth:`down` says so once,
    with the error, and returns how long to wait before looking again (backoff from 0.5 s to 8 s);
    :meth:`up` says once how long it lasted. In between, the peer waits and gives no window up for
    it while the window can still be made."""

    def __init__(self, display: PeerDisplay) -> None:
        self.display = display
        self.since: float | None = None  # monotonic
        self._wait = Backoff(first_s=0.5, cap_s=8.0)

    def down(self, exc: Exception) -> float:
        """The store did not answer (``exc``): the wait before the next look."""
        if self.since is None:
            self.since, self._wait = time.monotonic(), Backoff(first_s=0.5, cap_s=8.0)
            log.warning(
                "the store does not answer (%s): waiting, no window is given up for it while it can be made", exc
            )
            self.display.update(phase="store unreachable")
        return self._wait.next()

    def up(self) -> None:
        """The store answered: the end of an outage, if one was going on."""
        if self.since is not None:
            log.warning("the store answers again after %.0f s", time.monotonic() - self.since)
            self.since = None


@dataclass(frozen=True)
class PeerContext:
    """The collaborators of one peer (:class:`client.peer.Peer` builds it once).

    ``store`` counts what the peer downloads (its ``download_bytes`` per window); ``run_id`` is the
    store prefix of ``spec``'s run; ``stop`` is set by :meth:`client.peer.Peer.stop` and read at
    every phase boundary and between inner steps.
    """

    spec: RunSpec
    store: MeteredStore
    identity: Identity
    state: LocalState
    trainer: WindowTrainer
    local: LocalSettings
    display: PeerDisplay
    run_id: str
    stop: threading.Event = field(default_factory=threading.Event)
    outage: Outage = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outage", Outage(self.display))

    def stopping(self) -> bool:
        """Whether the peer was asked to stop."""
        return self.stop.is_set()
