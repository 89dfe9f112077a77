"""What every phase of a peer works with and none of them owns: the run, the store, the key, the
state directory, the trainer, the local settings, the display, and the request to stop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from client.metered import MeteredStore
from client.progress import PeerDisplay
from client.state import LocalState
from client.window import WindowTrainer
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.settings import LocalSettings

__all__ = ["PeerContext"]


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

    def stopping(self) -> bool:
        """Whether the peer was asked to stop."""
        return self.stop.is_set()
