"""What the local swarm's launcher learns from its processes' events (:mod:`protocol.events`).

followed = Followed()
followed.on_validator(event)                 # a validator event
followed.on_peer(followed.peers[name], event)  # a peer's event, into its PeerView
followed.published[3].val_loss, followed.peers["peer-0"].applied[3]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.events import (
    Announced,
    Applied,
    Event,
    Joined,
    PeerStarted,
    PeerWindow,
    ValidatorStarted,
    WindowOpened,
    WindowPublished,
)

__all__ = ["Followed", "PeerView"]


@dataclass
class PeerView:
    """What the launcher learned about one peer from its events."""

    name: str
    peer_id: str = ""
    applied: dict[int, str] = field(default_factory=dict)  # window -> fingerprint of θ after it
    windows: dict[int, PeerWindow] = field(default_factory=dict)  # window -> its last "window" event
    joined: list[Joined] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    inner_s: float = 0.0  # training time, less the waits for the forecast before a window's first step
    forecast_wait_s: float = 0.0
    wall_s: float = 0.0
    announced: bool = False

    def running_s(self) -> float:
        """Seconds between each incarnation's ``peer_started`` and its last event: the process's
        wall time less the interpreter's start-up and exit."""
        total, started = 0.0, None
        for event in self.events:
            if isinstance(event, PeerStarted):
                started = event.time
            elif started is not None:
                total += event.time - started
                started = event.time
        return total


@dataclass
class Followed:
    """What the launcher learned from the processes' events: every peer's :class:`PeerView`, the
    published windows, and the validator's (re)starts."""

    peers: dict[str, PeerView] = field(default_factory=dict)
    published: dict[int, WindowPublished] = field(default_factory=dict)
    validator_ready: bool = False  # published genesis (or resumed) and opened its window
    validator_opened: list[int] = field(default_factory=list)  # the window each (re)start resumed at
    restarted: bool = False  # ValidatorStarted seen, its first WindowOpened not yet

    def on_validator(self, event: Event) -> None:
        if isinstance(event, ValidatorStarted):
            self.restarted = True
        elif isinstance(event, WindowOpened):
            self.validator_ready = True
            if self.restarted:
                self.validator_opened.append(event.window)
                self.restarted = False
        elif isinstance(event, WindowPublished):
            self.published[event.window] = event

    @staticmethod
    def on_peer(view: PeerView, event: Event) -> None:
        view.events.append(event)
        if isinstance(event, Applied):
            view.applied[event.window] = event.fingerprint
        elif isinstance(event, PeerWindow):
            view.windows[event.window] = event
            view.inner_s += event.inner_s - event.forecast_wait_s
            view.forecast_wait_s += event.forecast_wait_s
        elif isinstance(event, Joined):
            view.joined.append(event)
        elif isinstance(event, Announced):
            view.announced = True
