"""A restarted validator whose peers are gone holds its first window instead of publishing it
empty, until a peer is heard from (:mod:`validator.hold`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest

from protocol import layout
from protocol.events import Event, WindowHeld, WindowPublished, describe
from protocol.identity import Identity
from protocol.settings import LocalSettings
from protocol.wire import Announcement, encode_announcement
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.node import Validator


@pytest.fixture(scope="module")
def vkey() -> Identity:
    return Identity.generate()


@pytest.fixture()
def swarm(vkey: Identity) -> Iterator[Swarm]:
    sw = Swarm(tiny_spec(vkey, windows={"upload_deadline_s": 1.0}), 2)
    sw.announce_all()
    yield sw
    sw.close()


def _local(hold_s: float) -> LocalSettings:
    return dataclasses.replace(LOCAL, validator=dataclasses.replace(LOCAL.validator, restart_hold_s=hold_s))


def _validator(sw: Swarm, vkey: Identity, state_dir: object, events: list[Event], hold_s: float) -> Validator:
    v = Validator(sw.spec, sw.handle(), vkey, str(state_dir), local=_local(hold_s), emit=events.append)
    v.resume()
    return v


def _two_windows(sw: Swarm, vkey: Identity, state_dir: object) -> None:
    """Windows 0 and 1 with both peers, then the validator stops (its peers leave too)."""
    v = _validator(sw, vkey, state_dir, [], 3600.0)
    params = {n: p.detach().clone() for n, p in v.model.named_parameters()}
    for w in (0, 1):
        assert v.state is not None
        for p in sw.peers:
            sw.upload(p.peer_id, w, sw.honest(p, params, w, v.state.base))
        assert v.run_window() is not None
    v.close()


class _Held:
    """Runs ``v.run_window()`` on a thread; ``held`` is set once it says it holds the window."""

    def __init__(self, v: Validator, events: list[Event]) -> None:
        self.v, self.events, self.held = v, events, threading.Event()
        self.report: WindowPublished | None = None

        def note(event: Event) -> None:
            events.append(event)
            if isinstance(event, WindowHeld):
                self.held.set()

        v.emit = v.hold.emit = note
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.report = self.v.run_window()

    def join(self) -> WindowPublished | None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()
        return self.report


def _restarted_and_holding(sw: Swarm, vkey: Identity, state_dir: object) -> tuple[Validator, _Held]:
    """Windows 0 and 1 with both peers, a restart, and window 2 gathered with nobody back: held."""
    _two_windows(sw, vkey, state_dir)
    events: list[Event] = []
    v = _validator(sw, vkey, state_dir, events, 3600.0)
    assert v.state is not None and v.state.window == 2
    run = _Held(v, events)
    assert run.held.wait(timeout=60)
    return v, run


def test_a_restarted_validator_holds_an_empty_window_until_a_peer_joins_again(
    swarm: Swarm, vkey: Identity, tmp_path
) -> None:
    """Restarted after its peers left, the validator gathers window 2 (nobody uploads), holds it,
    unpublished, and publishes it once a peer announces again (a new join: its announcement
    changed), so window 3 opens then, with its whole deadline."""
    v, run = _restarted_and_holding(swarm, vkey, tmp_path)
    (held,) = [e for e in run.events if isinstance(e, WindowHeld)]
    assert (held.window, held.announced, held.hold_s) == (2, 2, 3600.0)
    assert "held until a peer is heard from" in describe(held)
    assert not swarm.store.exists(layout.aggregate_key(swarm.run, 2))  # not published while nobody is back
    peer = swarm.peers[0]
    rejoined = Announcement(swarm.run_hash, 0, "test", "cpu", metadata={"joined_at": 1.0})
    back_at = v.clock()
    swarm.store.put(layout.peer_key(swarm.run, peer.peer_id), encode_announcement(rejoined, peer))
    report = run.join()
    assert report is not None and report.window == 2 and report.accepted == 0
    assert report.published_at >= back_at  # window 3 opens once a peer is back
    assert v.state is not None and v.state.window == 3
    v.close()


def test_a_grant_to_a_peer_ends_the_hold(swarm: Swarm, vkey: Identity, tmp_path) -> None:
    v, run = _restarted_and_holding(swarm, vkey, tmp_path)
    v.heard_from("not-a-peer-of-this-run")  # an identity nobody announced proves nothing
    v.heard_from(swarm.peers[1].peer_id)
    report = run.join()
    assert report is not None and report.window == 2
    v.close()


def test_the_hold_is_bounded_and_stopping_publishes_nothing(swarm: Swarm, vkey: Identity, tmp_path) -> None:
    v, run = _restarted_and_holding(swarm, vkey, tmp_path)
    v.stop.set()
    assert run.join() is None
    assert not swarm.store.exists(layout.aggregate_key(swarm.run, 2))
    v.close()
    events: list[Event] = []
    v = _validator(swarm, vkey, tmp_path, events, 0.5)  # restarted again, with a short bound
    report = v.run_window()
    assert report is not None and report.window == 2 and report.accepted == 0
    assert [type(e) for e in events if isinstance(e, (WindowHeld, WindowPublished))] == [WindowHeld, WindowPublished]
    v.close()


def test_only_a_restart_holds_and_only_a_window_nobody_uploaded_to(swarm: Swarm, vkey: Identity, tmp_path) -> None:
    """A window with an upload is published; once this process published a window, an empty one
    is published at its deadline as before (the process runs: its peers had their chance)."""
    _two_windows(swarm, vkey, tmp_path)
    events: list[Event] = []
    v = _validator(swarm, vkey, tmp_path, events, 3600.0)
    assert v.state is not None
    params = {n: p.detach().clone() for n, p in v.model.named_parameters()}
    peer = swarm.peers[0]
    swarm.upload(peer.peer_id, 2, swarm.honest(peer, params, 2, "ab" * 32))  # stale: rejected, yet someone is there
    report = v.run_window()
    assert report is not None and report.window == 2 and report.accepted == 0 and report.rejected == 1
    report = v.run_window()  # window 3: nobody
    assert report is not None and report.window == 3
    assert not [e for e in events if isinstance(e, WindowHeld)]
    v.close()


def test_the_grant_server_says_the_validator_waits_for_peers_while_a_window_is_held() -> None:
    """What ``validate`` wires between the events and the grant server: a grant is a sign of life
    for the hold, and ``/v1/info``'s ``waiting_for_peers`` is 1 from ``window_held`` until the
    window is published."""
    from types import SimpleNamespace

    from protocol.events import Granted
    from validator.serve import PeerWait, hold_sink

    heard: list[str] = []
    validator = SimpleNamespace(heard_from=heard.append)
    waiting = PeerWait()
    hold_sink(validator, waiting, Granted(peer_id="p1", address="127.0.0.1", op="get", key="k", expires_at=1.0))  # type: ignore[arg-type]
    assert heard == ["p1"] and waiting() is None
    hold_sink(validator, waiting, WindowHeld(window=7, announced=3, hold_s=60.0))  # type: ignore[arg-type]
    assert waiting() == (1, 0)
    published = WindowPublished(
        window=7, accepted=0, rejected=0, val_loss=1.0, digest="d" * 64, fingerprint="f" * 64, published_at=2.0
    )
    hold_sink(validator, waiting, published)  # type: ignore[arg-type]
    assert waiting() is None
