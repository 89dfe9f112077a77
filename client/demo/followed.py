"""What the local swarm's launcher learns from its processes' events (:mod:`protocol.events`).

followed = Followed()
followed.on_validator(event)                 # a validator event ("validator-2": one of several)
followed.on_peer(followed.peers[name], event)  # a peer's event, into its PeerView
followed.published[3].val_loss, followed.peers["peer-0"].applied[3]
followed.validators["validator-2"].steps    # its agreement steps (several validators)
followed.grants[peer_id]["get"]             # presigned requests the grant servers gave that peer, by op

With several validators every one of them reports each certified window (``window_published``
with the leader, view and signers of its certificate) and every agreement step it saw
(``agreement``: proposed, endorsed, objected, handover, certified); ``published`` keeps the first
report of each window, :class:`ValidatorView` what each validator reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.events import (
    AgreementStep,
    Announced,
    Applied,
    Event,
    Granted,
    Joined,
    PeerStarted,
    PeerWindow,
    ValidatorStarted,
    WindowOpened,
    WindowPublished,
)

__all__ = ["Followed", "PeerView", "ValidatorView"]


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
class ValidatorView:
    """What the launcher learned about one validator process (all its incarnations) from its events."""

    name: str
    ready: bool = False  # published genesis (or resumed) and opened a window, since its last start
    opened: list[int] = field(default_factory=list)  # every window_opened, in order
    published: dict[int, WindowPublished] = field(default_factory=dict)  # window -> its report
    steps: list[AgreementStep] = field(default_factory=list)  # every agreement step it saw

    def steps_of(self, window: int, step: str) -> list[AgreementStep]:
        """Its agreement steps ``step`` (``endorsed``, ``objected`` …) of ``window``."""
        return [s for s in self.steps if s.window == window and s.step == step]


@dataclass
class Followed:
    """What the launcher learned from the processes' events: every peer's :class:`PeerView`, the
    published windows, and the validator's (re)starts."""

    peers: dict[str, PeerView] = field(default_factory=dict)
    published: dict[int, WindowPublished] = field(default_factory=dict)
    validator_ready: bool = False  # published genesis (or resumed) and opened its window
    validator_opened: list[int] = field(default_factory=list)  # the window each (re)start resumed at
    restarted: bool = False  # ValidatorStarted seen, its first WindowOpened not yet
    validators: dict[str, ValidatorView] = field(default_factory=dict)  # by process name
    grants: dict[str, dict[str, int]] = field(default_factory=dict)  # peer id -> op -> grants given

    def on_validator(self, event: Event, name: str = "validator") -> None:
        view = self.validators.setdefault(name, ValidatorView(name))
        if isinstance(event, ValidatorStarted):
            self.restarted = True
            view.ready = False
        elif isinstance(event, WindowOpened):
            self.validator_ready = view.ready = True
            view.opened.append(event.window)
            if self.restarted:
                self.validator_opened.append(event.window)
                self.restarted = False
        elif isinstance(event, WindowPublished):
            self.published.setdefault(event.window, event)
            view.published[event.window] = event
        elif isinstance(event, AgreementStep):
            view.steps.append(event)
        elif isinstance(event, Granted):
            ops = self.grants.setdefault(event.peer_id, {})
            ops[event.op] = ops.get(event.op, 0) + 1

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
