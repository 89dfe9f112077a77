"""The peer's local state, its sync rules and its window loop (in-process, memory store).

A minimal in-test validator (genesis + gather + aggregate + sign, built from the same protocol
functions the real validator uses) drives the real :class:`client.peer.Peer` through windows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from client.peer import Peer, RunNotFound, Staged, UploadsRefused
from client.peer.sync import Advanced, NotReady, Reloaded, Sync
from client.progress import PeerDisplay
from client.replica import FullReplica
from client.state import LocalState, Snapshot, flatten, tensors_equal, unflatten
from client.trainer import pseudo_gradient
from client.window import Skipped
from protocol import layout
from protocol.aggregate import aggregate, apply_outer, sparse_of
from protocol.broadcast import applied, plain
from protocol.config import RunSpec
from protocol.errors import (
    AccessDenied,
    ConfigError,
    DigestMismatch,
    StaleBase,
    StoreError,
    StoreUnavailable,
    UnknownSigner,
)
from protocol.events import (
    Applied,
    Event,
    Joined,
    PeerStarted,
    PeerWindow,
    ResumedUpload,
    Stopped,
    SyncFailed,
    WaitingForGenesis,
)
from protocol.feedback import FeedbackBuffers, FeedbackState
from protocol.identity import Identity
from protocol.model import build_model, fingerprint
from protocol.settings import LocalSettings, PeerSettings, local_table_toml
from protocol.store import open_store
from protocol.store.base import ObjectStore
from protocol.store.traffic import WireCounter
from protocol.wire import GENESIS, decode_announcement, decode_contribution
from validator.publish import encode_window_aggregate, publish_checkpoint

TINY = {"preset": "tiny", "dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}


def tiny_spec(validator: Identity, **windows: float) -> RunSpec:
    return RunSpec.from_dict(
        {
            "name": "peer-test",
            "model": TINY,
            "data": {"seq_len": 32, "batch_size": 4},
            "inner": {"steps": 3, "warmup_steps": 2, "total_steps": 100},
            "codec": {"k": 64},
            "windows": {"checkpoint_every": 2, **windows},
            "validator": {"public_keys": [validator.public_key_hex]},
        }
    )


LOCAL = LocalSettings(poll_interval_s=0.02)  # the peers' local settings in these tests


class MiniValidator:
    """Genesis, then per window: wait for ``expect`` contributions, aggregate, sign, publish."""

    def __init__(self, spec: RunSpec, store, ident: Identity) -> None:
        self.spec, self.store, self.ident = spec, store, ident
        self.run = layout.run_id(spec.hash())
        self.params = {n: p.detach().clone() for n, p in build_model(spec.model).named_parameters()}
        self.window = 0
        self.fingerprints: list[str] = []
        self.launch = publish_checkpoint(
            store,
            self.run,
            spec.hash(),
            0,
            aggregate=GENESIS,
            params=self.params,
            identity=ident,
            published_at=time.time(),
        ).digest
        self.base = self.launch  # window 0 builds on the genesis manifest
        self.previous = self.launch  # accepted too with outer.delay = 1 (the base of window − 1)

    def close_window(self, expect: int, timeout: float = 60.0) -> list[str]:
        prefix = layout.contrib_prefix(self.run, self.window)
        deadline = time.time() + timeout
        while len(self.store.list(prefix)) < expect and time.time() < deadline:
            time.sleep(0.02)
        contribs = []
        accepted = {self.base, self.previous} if self.spec.outer.delay else {self.base}
        for key in self.store.list(prefix):
            c = decode_contribution(
                self.store.get(key, max_bytes=1 << 26), run_hash=self.spec.hash(), max_bytes=1 << 26, window=self.window
            )
            if c.value.base not in accepted:
                raise StaleBase(f"window {self.window}: trained from {c.value.base[:16]}")
            contribs.append(c)
        contribs.sort(key=lambda c: c.sender)
        delta = aggregate([sparse_of(c.value.tensors) for c in contribs]) if contribs else {}
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        tensors = plain(delta, shapes)  # what is signed, and what every participant applies
        apply_outer(self.params, applied(tensors), self.spec.outer.alpha)
        fp = fingerprint(self.params)
        blob = encode_window_aggregate(
            run_hash=self.spec.hash(),
            window=self.window,
            base=self.base,
            alpha=self.spec.outer.alpha,
            tensors=tensors,
            manifest=[(c.sender, c.digest, 1.0) for c in contribs],
            fingerprint_next=fp,
            published_at=time.time(),
            metadata={},
            identity=self.ident,
        )
        self.store.put(layout.aggregate_key(self.run, self.window), blob, if_absent=True)
        self.previous, self.base = self.base, __import__("hashlib").sha256(blob).hexdigest()
        self.window += 1
        self.fingerprints.append(fp)
        if self.window % self.spec.windows.checkpoint_every == 0:
            publish_checkpoint(
                self.store,
                self.run,
                self.spec.hash(),
                self.window,
                aggregate=self.base,
                params=self.params,
                identity=self.ident,
                published_at=time.time(),
                launch=self.launch,
            )
        return [c.sender for c in contribs]


E = TypeVar("E", bound=Event)


class Recorder(PeerDisplay):
    def __init__(self) -> None:
        super().__init__(json_lines=True)
        self.events: list[Event] = []
        self._changed = threading.Condition()

    def emit(self, event: Event) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def update(self, **fields: object) -> None:
        with self._changed:
            super().update(**fields)
            self._changed.notify_all()  # progress fields count as news for wait_for

    def of(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]

    def wait_for(self, found: Callable[[], bool], timeout: float = 60.0) -> None:
        """Until ``found()`` holds, re-checked on every event (AssertionError on timeout)."""
        with self._changed:
            assert self._changed.wait_for(found, timeout=timeout), self.events


@pytest.fixture
def swarm(tmp_path: Path):
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident)
    store = open_store(f"memory://peer-test-{time.time_ns()}")
    return spec, store, MiniValidator(spec, store, vident), tmp_path


def make_peer(spec: RunSpec, store, root: Path, name: str, local: LocalSettings = LOCAL) -> tuple[Peer, Recorder]:
    state = LocalState(root / name)
    rec = Recorder()
    identity = Identity.load_or_create(state.key_path)
    replica = FullReplica(spec, data_key=identity.peer_id)
    return Peer(spec, store, identity, state, replica, local=local, display=rec), rec


def send(peer: Peer, window: int) -> Staged:
    """``peer`` trains ``window`` and puts its contribution (the put done when this returns)."""
    staged = peer.train(window)
    assert isinstance(staged, Staged)
    peer.upload(staged)
    peer.flush()
    return staged


def run_peers(val: MiniValidator, peers: list[Peer], windows: int, expect: int | None = None) -> None:
    threads = [threading.Thread(target=p.run, kwargs={"until_window": windows}, daemon=True) for p in peers]
    for t in threads:
        t.start()
    while val.window < windows:
        val.close_window(expect or len(peers))
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()


# ---------------------------------------------------------------------- state directory
def test_state_round_trip_and_old_files_removed(tmp_path: Path) -> None:
    state = LocalState(tmp_path)
    assert state.load("a" * 64) is None
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 4))], betas=(0.9, 0.95))
    opt.param_groups[0]["params"][0].grad = torch.randn(3, 4)
    opt.step()
    fb = {"w": torch.randn(3, 4)}
    snap = Snapshot(
        "a" * 64,
        3,
        "b" * 64,
        "c" * 64,
        feedback=fb,
        optimizer={"step": 7, "optimizer": opt.state_dict()},
        pending=3,
        pending_blob=b"signed bytes",
    )
    state.save(snap)
    state.save(snap)  # a second commit replaces the first one's files
    back = state.load("a" * 64)
    assert back is not None and back.window == 3 and back.pending == 3 and back.pending_blob == b"signed bytes"
    assert tensors_equal(back.feedback, fb)
    restored = back.optimizer["optimizer"]
    assert back.optimizer["step"] == 7 and set(restored["state"]) == {0}
    assert torch.equal(restored["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    opt.load_state_dict(restored)  # accepted by torch as is
    assert len(list(tmp_path.glob("feedback-*"))) == 1 and len(list(tmp_path.glob("pending-*"))) == 1


def test_state_keeps_tensor_files_when_unchanged(tmp_path: Path) -> None:
    state = LocalState(tmp_path)
    state.save(Snapshot("a" * 64, 1, "b" * 64, "c" * 64, feedback={"w": torch.ones(2)}))
    before = sorted(p.name for p in tmp_path.glob("feedback-*"))
    state.save(Snapshot("a" * 64, 2, "d" * 64, "e" * 64, feedback={"w": torch.ones(2)}), feedback=False, moments=False)
    assert sorted(p.name for p in tmp_path.glob("feedback-*")) == before
    back = state.load("a" * 64)
    assert back is not None and back.window == 2 and tensors_equal(back.feedback, {"w": torch.ones(2)})


def test_state_refuses_other_run_and_damage(tmp_path: Path) -> None:
    state = LocalState(tmp_path)
    state.save(Snapshot("a" * 64, 1, "b" * 64, "c" * 64, feedback={"w": torch.ones(2)}))
    with pytest.raises(ConfigError, match="belongs to run"):
        state.load("f" * 64)
    meta = json.loads((tmp_path / "progress.json").read_text())
    (tmp_path / meta["files"]["feedback"]["file"]).write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="damaged"):
        state.load("a" * 64)


def test_flatten_round_trip_int_keys_and_lists() -> None:
    tree = {
        "step": 3,
        "state": {0: {"m": torch.arange(3.0)}, 5: {"m": torch.zeros(1)}},
        "groups": [{"betas": [0.9, 0.95]}],
    }
    tensors, skeleton = flatten(tree)
    json.dumps(skeleton)  # JSON-serialisable, no pickle anywhere
    back = unflatten(tensors, skeleton)
    assert set(back["state"]) == {0, 5} and torch.equal(back["state"][0]["m"], torch.arange(3.0))
    assert back["groups"] == [{"betas": [0.9, 0.95]}] and back["step"] == 3


# ---------------------------------------------------------------------- sync
def test_sync_waits_for_genesis_then_replays(tmp_path: Path) -> None:
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident)
    store = open_store(f"memory://sync-{time.time_ns()}")
    with pytest.raises(NotReady):
        Sync(spec, store).bootstrap({})
    val = MiniValidator(spec, store, vident)
    for _ in range(3):
        val.close_window(0, timeout=0)  # empty windows still chain
    params: dict[str, torch.Tensor] = {}
    pos = Sync(spec, store).bootstrap(params)
    assert pos.window == 3 and pos.fingerprint == val.fingerprints[-1] == fingerprint(params)


def test_sync_rejects_aggregate_signed_by_unknown_key(swarm) -> None:
    spec, store, val, _ = swarm
    val.ident = Identity.generate()  # an impostor publishes window 0
    val.close_window(0, timeout=0)
    sync = Sync(spec, store)
    with pytest.raises(UnknownSigner):
        sync.fetch_aggregate(0)
    # never applied, and a joining peer is not stopped by it: window 0 is simply not published yet
    pos = sync.bootstrap({})
    assert pos.window == 0 and not sync.aggregate_published(0, pos.base) and not sync.aggregate_published(0)


def test_sync_apply_checks_chain_and_fingerprint(swarm) -> None:
    spec, store, val, _ = swarm
    val.close_window(0, timeout=0)
    sync = Sync(spec, store)
    params: dict[str, torch.Tensor] = {}
    pos = sync.resync(params)
    agg = sync.fetch_aggregate(0)
    assert agg is not None
    with pytest.raises(StaleBase):
        sync.apply(params, type(pos)(0, "0" * 64, pos.fingerprint), agg)
    params["head.out.weight" if "head.out.weight" in params else sorted(params)[0]].add_(1e-3)  # diverge
    with pytest.raises(DigestMismatch):
        sync.apply(params, pos, agg)


def test_sync_steps_are_values_and_a_divergence_reloads_the_newest_checkpoint(swarm) -> None:
    spec, store, val, _ = swarm
    for _ in range(3):
        val.close_window(0, timeout=0)  # checkpoint_every = 2: checkpoints 0 and 2
    sync = Sync(spec, store)
    pos, params = sync.load_checkpoint(0, sync.launch())
    assert [(type(s), s.pos.window) for s in sync.steps(params, pos)] == [(Advanced, 1), (Advanced, 2), (Advanced, 3)]
    pos, params = sync.load_checkpoint(0, sync.launch())
    params[sorted(params)[0]].add_(1e-3)  # diverge
    steps = list(sync.steps(params, pos))
    assert [(type(s), s.pos.window) for s in steps] == [(Reloaded, 2), (Advanced, 3)]
    reloaded = steps[0]
    assert isinstance(reloaded, Reloaded) and isinstance(reloaded.error, DigestMismatch)
    assert steps[-1].pos.fingerprint == val.fingerprints[-1] == fingerprint(params)


# ---------------------------------------------------------------------- the peer loop
def test_peers_train_and_stay_identical(swarm) -> None:
    spec, store, val, root = swarm
    (p1, r1), (p2, r2) = make_peer(spec, store, root, "a"), make_peer(spec, store, root, "b")
    run_peers(val, [p1, p2], windows=3)
    for p, r in ((p1, r1), (p2, r2)):
        assert [e.fingerprint for e in r.of(Applied)] == val.fingerprints
        assert [e.outcome for e in r.of(PeerWindow)] == ["uploaded"] * 3
        assert all(e.included for e in r.of(Applied))
        assert fingerprint(p.params) == val.fingerprints[-1]
        assert [r["fingerprint"] for r in p.state.records()] == val.fingerprints  # durable history
    assert fingerprint(val.params) != fingerprint(build_model(spec.model))  # θ moved


def test_late_joiner_catches_up_from_checkpoint(swarm) -> None:
    spec, store, val, root = swarm
    (p1, _) = make_peer(spec, store, root, "a")
    run_peers(val, [p1], windows=3)  # checkpoint_every = 2: checkpoint at window 2
    (late, rec) = make_peer(spec, store, root, "late")
    run_peers(val, [p1, late], windows=5)
    joined = rec.of(Joined)[0]
    assert joined.replayed_from == 2 and joined.window == 3
    assert fingerprint(late.params) == fingerprint(p1.params) == val.fingerprints[-1]


def committed_feedback(peer: Peer) -> dict[str, torch.Tensor]:
    """e as the state directory holds it, once the peer's lane has written what it was given
    (the peer may be running on another thread: it is not asked to flush)."""
    deadline = time.monotonic() + 30
    while peer.uploads.lane.busy():
        assert time.monotonic() < deadline, "the peer's lane did not finish its commits"
        time.sleep(0.01)  # a background thread's queue: no event announces that it drained
    snap = peer.state.load(peer.spec.hash())
    assert snap is not None
    return snap.feedback


def copy_of(e: FeedbackBuffers) -> FeedbackState:
    """A frozen copy of a peer's e (its buffers change in place)."""
    return FeedbackState({n: t.clone() for n, t in e.buffers.items()})


def test_restart_resumes_feedback_and_reuploads_staged_bytes(swarm) -> None:
    spec, store, val, root = swarm
    (p1, _) = make_peer(spec, store, root, "a")
    run_peers(val, [p1], windows=2)
    fb = copy_of(p1.feedback)
    # Train window 2 and stage it, then "crash" before the put reaches the store.
    staged = p1.train(2)
    assert not isinstance(staged, Skipped)
    assert tensors_equal(committed_feedback(p1), fb.state_dict())  # folded in memory, not committed
    p1.uploads.adopt(staged)
    p1.flush()
    again, rec = make_peer(spec, store, root, "a")
    again.join()
    assert rec.of(Joined)[0].resumed and rec.of(ResumedUpload)[0].outcome == "uploaded"
    assert rec.of(Joined)[0].staged_window == 2
    assert not tensors_equal(again.feedback.state_dict(), fb.state_dict())  # e includes the staged window
    assert tensors_equal(again.feedback.state_dict(), p1.feedback.state_dict())
    assert store.get(layout.contrib_key(val.run, 2, again.identity.peer_id)) == staged.blob
    assert again.trainer.step == p1.trainer.step


def test_missed_deadline_skips_window_and_keeps_feedback(tmp_path: Path) -> None:
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident, upload_deadline_s=0.0)
    store = open_store(f"memory://skip-{time.time_ns()}")
    val = MiniValidator(spec, store, vident)
    val.close_window(0, timeout=0)  # window 1 opens with published_at = now, deadline = now
    peer, rec = make_peer(spec, store, tmp_path, "slow")
    t = threading.Thread(target=peer.run, kwargs={"until_window": 2}, daemon=True)
    t.start()
    time.sleep(1.0)
    val.close_window(0, timeout=0)
    t.join(timeout=30)
    assert not t.is_alive()
    windows = rec.of(PeerWindow)
    assert windows and all(w.outcome == "skipped" for w in windows)
    assert peer.feedback.buffers == {} and not store.list(layout.contrib_prefix(val.run, 1))


def test_window_closing_during_training_leaves_feedback_as_before(swarm) -> None:
    """A full replica whose window closes while it trains sends nothing and keeps e exactly."""
    spec, store, val, root = swarm
    (peer, rec) = make_peer(spec, store, root, "a")
    run_peers(val, [peer], windows=1)
    before, on_disk = copy_of(peer.feedback), committed_feedback(peer)
    assert before.buffers and tensors_equal(on_disk, before.state_dict())

    def close_at_first_step(**fields: object) -> None:
        if fields.get("step") == 1 and val.window == 1:
            val.close_window(0, timeout=0)  # aggregate 1 is published: the window is over

    peer.display.update = close_at_first_step  # type: ignore[method-assign]
    work = peer.train(1)
    assert isinstance(work, Skipped) and "deadline" in work.reason and val.window == 2  # trained, then too late
    peer._skip(1, work)
    assert rec.of(PeerWindow)[-1].outcome == "skipped" and rec.of(PeerWindow)[-1].window == 1
    assert tensors_equal(peer.feedback.state_dict(), before.state_dict()) and peer.pending is None
    assert tensors_equal(committed_feedback(peer), on_disk)
    assert not store.list(layout.contrib_prefix(val.run, 1))


class FlakyStore(ObjectStore):
    """Delegates to ``inner`` but refuses every contribution put for ``window`` (fault injection:
    a refusal, not retried; transient failures are retried until the deadline, test_uploads_link)."""

    def __init__(self, inner: ObjectStore, window: int) -> None:
        self.inner, self.bad = inner, f"/contrib/{window:08d}/"
        self.refused = 0

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if self.bad in key:
            self.refused += 1
            raise AccessDenied(f"injected refusal for {key}")
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


class WiredStore(FlakyStore):
    """Delegates to ``inner`` and counts each operation into a :class:`WireCounter` as a socket
    store would: ``HEADER`` bytes of request and of answer, and the bodies each way."""

    HEADER = 100

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner, window=-1)
        self.wire = WireCounter()

    def _op(self, sent: int, received: int) -> None:
        self.wire.add_sent(self.HEADER + sent)
        self.wire.add_received(self.HEADER + received)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._op(len(data), 0)
        super().put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        data = super().get(key, max_bytes=max_bytes)
        self._op(0, len(data))
        return data

    def list(self, prefix: str) -> list[str]:
        self._op(0, 0)
        return super().list(prefix)


def test_window_reports_carry_the_store_wire_bytes_since_the_previous_report(swarm) -> None:
    spec, store, val, root = swarm
    wired = WiredStore(store)
    peer, rec = make_peer(spec, wired, root, "wired")
    run_peers(val, [peer], windows=3)
    reports = rec.of(PeerWindow)
    assert [e.outcome for e in reports] == ["uploaded"] * 3
    for e in reports:
        assert e.wire_up_bytes >= e.upload_bytes + WiredStore.HEADER  # its contribution, and the requests
        assert e.wire_down_bytes >= e.download_bytes  # what it read, and the answers
    # Deltas: together no more than the counter, which only the leave (a withdrawal) moved since.
    assert sum(e.wire_up_bytes for e in reports) <= wired.wire.sent
    assert sum(e.wire_down_bytes for e in reports) <= wired.wire.received
    assert peer.store.bytes_written >= sum(e.upload_bytes for e in reports)


class UnreadableKey(FlakyStore):
    """Delegates to ``inner`` but cannot read ``key`` (a grant server or store that is down)."""

    def __init__(self, inner: ObjectStore, key: str) -> None:
        super().__init__(inner, window=-1)
        self.key = key

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        if key == self.key:
            raise StoreError(f"injected: {key} unreachable")
        return self.inner.get(key, max_bytes=max_bytes)


def test_a_store_failing_between_aggregates_keeps_what_was_applied(swarm) -> None:
    """Aggregates 2 and 3 are published while the peer is away; reading 3 fails (the store is
    down, which the loop waits out: test_a_store_down_mid_window_costs_no_window_and_is_said_once):
    θ stays at aggregate 2 with the position, nothing is rebuilt from a checkpoint, and the peer
    goes on from there once the store answers."""
    spec, store, val, root = swarm
    (peer, rec) = make_peer(spec, store, root, "a")
    run_peers(val, [peer], windows=2)
    val.close_window(0, timeout=0)
    val.close_window(0, timeout=0)
    peer.theta.sync.store = UnreadableKey(store, layout.aggregate_key(val.run, 3))
    applied_before = len(rec.of(Applied))
    with pytest.raises(StoreError, match="unreachable"):
        peer.catch_up(need=0)
    assert peer.pos.window == 3 and fingerprint(peer.params) == val.fingerprints[2]
    assert not peer.theta.diverged
    peer.theta.sync.store = store
    peer.catch_up(need=0)
    assert peer.pos.window == 4 and fingerprint(peer.params) == val.fingerprints[3]
    assert [e.window for e in rec.of(Applied)[applied_before:]] == [2, 3]  # no replay from a checkpoint


def assert_window_kept(peer: Peer, e_before: FeedbackState, trained: Peer) -> None:
    """e == β·e_before + Δ (the whole window, nothing subtracted), in memory and in the state dir.

    Δ = θ_t − θ_local, with θ_t the peer's θ and θ_local still in the model of ``trained`` (the
    peer that trained it).
    """
    replica = trained.trainer
    assert isinstance(replica, FullReplica)
    delta = pseudo_gradient(peer.params, replica.model)
    beta = peer.spec.outer.beta
    for name, d in delta.items():
        old = e_before.buffers.get(name, torch.zeros_like(d))
        expected = beta * old + d
        assert torch.allclose(peer.feedback.buffers[name], expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
    assert tensors_equal(committed_feedback(peer), peer.feedback.state_dict())


@pytest.fixture
def sync_swarm(tmp_path: Path):
    """A run on the synchronous schedule (outer.delay = 0): a peer waits for each aggregate."""
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(outer={"delay": 0})
    store = open_store(f"memory://peer-sync-{time.time_ns()}")
    return spec, store, MiniValidator(spec, store, vident), tmp_path


def test_failed_upload_is_an_outcome_and_gives_delta_back(sync_swarm) -> None:
    spec, store, val, root = sync_swarm
    flaky = FlakyStore(store, window=1)
    peer, rec = make_peer(spec, flaky, root, "flaky")
    t = threading.Thread(target=peer.run, kwargs={"until_window": 3}, daemon=True)
    t.start()
    val.close_window(1)
    rec.wait_for(lambda: bool(rec.of(Applied)))
    fb_after_0 = copy_of(peer.feedback)  # the synchronous peer is at window 1 now; e is window 0's
    rec.wait_for(lambda: any(e.window == 1 for e in rec.of(PeerWindow)))
    # The peer now waits for window 1 to close: θ_1 and its model (θ_local) are what it trained.
    assert_window_kept(peer, fb_after_0, peer)
    assert peer.pending is None and peer.state.load(spec.hash()).pending is None  # type: ignore[union-attr]
    val.close_window(0, timeout=0)  # window 1 closes without it
    val.close_window(1)
    t.join(timeout=60)
    assert not t.is_alive() and flaky.refused == 1  # a refusal: recorded, not retried
    outcomes = {e.window: e.outcome for e in rec.of(PeerWindow)}
    assert outcomes == {0: "uploaded", 1: "failed", 2: "uploaded"}
    assert [e.included for e in rec.of(Applied)] == [True, False, True]
    assert fingerprint(peer.params) == val.fingerprints[-1]


def test_failed_upload_of_an_overlapped_window_gives_delta_back(tmp_path: Path) -> None:
    """outer.delay = 1 with overlap 1.0: window 1 trains from θ_0 to the end while aggregate 0 is
    in flight; its put fails for good, so e is β·e + Δ again, with Δ formed against θ_0; the next
    window is sent as usual."""
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(outer={"overlap": 1.0, "eager": False})
    store = open_store(f"memory://peer-delayed-{time.time_ns()}")
    val, root = MiniValidator(spec, store, vident), tmp_path
    flaky = FlakyStore(store, window=1)
    peer, rec = make_peer(spec, flaky, root, "flaky")
    peer.join()
    staged = peer.train(0)
    assert isinstance(staged, Staged)
    peer.upload(staged)
    peer.flush()
    e_0 = copy_of(peer.feedback)
    staged = peer.train(1)  # aggregate 0 is not published: θ_0, one aggregate behind window 1
    assert isinstance(staged, Staged) and staged.trained_from == 0 and peer.pos.window == 0
    assert staged.stats.stale_steps == spec.inner.steps  # the whole window: Δ against θ_0
    peer.upload(staged)
    peer.flush()
    assert rec.of(PeerWindow)[-1].outcome == "failed" and rec.of(PeerWindow)[-1].trained_from == 0
    assert_window_kept(peer, e_0, peer)
    assert peer.pending is None and flaky.refused == 1
    val.close_window(1)
    peer.catch_up(need=1)
    staged = peer.train(2)
    assert isinstance(staged, Staged) and staged.trained_from == 1
    peer.upload(staged)
    peer.flush()
    assert rec.of(PeerWindow)[-1].outcome == "uploaded"


def test_resumed_upload_that_fails_gives_delta_back(swarm) -> None:
    """The rule for a failed upload needs only the commit: it holds after a restart too."""
    spec, store, val, root = swarm
    (p1, _) = make_peer(spec, store, root, "a")
    run_peers(val, [p1], windows=2)
    e_before = copy_of(p1.feedback)
    staged = p1.train(2)
    assert not isinstance(staged, Skipped)
    p1.uploads.adopt(staged)  # staged and committed, then the process dies before the put
    p1.flush()
    again, rec = make_peer(spec, FlakyStore(store, window=2), root, "a")
    again.join()
    assert rec.of(ResumedUpload)[0].outcome == "failed"
    assert_window_kept(again, e_before, p1)
    assert again.pending is None and not store.list(layout.contrib_prefix(val.run, 2))


def announcement_of(peer: Peer):
    blob = peer.store.get(layout.peer_key(peer.run_id, peer.identity.peer_id))
    return decode_announcement(blob, run_hash=peer.spec.hash(), max_bytes=1 << 16, sender=peer.identity.peer_id).value


def test_a_clean_stop_withdraws_the_announcement_and_a_restart_announces_again(swarm) -> None:
    spec, store, val, root = swarm
    peer, rec = make_peer(spec, store, root, "a")
    run_peers(val, [peer], windows=2)
    started = rec.of(PeerStarted)[0]
    assert (started.run_hash, started.run_id, started.peer_id) == (spec.hash(), peer.run_id, peer.identity.peer_id)
    assert rec.of(Stopped)[-1].withdrawn and announcement_of(peer).withdrawn
    assert announcement_of(peer).window == 2  # the window it held when it left
    done = rec.of(Stopped)[-1]
    assert (done.reason, done.windows_trained, done.window) == ("done", 2, 2) and done.inner_s > 0
    interrupted = peer.stopped("interrupted")  # what join emits after Ctrl-C or SIGTERM: the same counts
    assert dataclasses.replace(interrupted, time=done.time) == dataclasses.replace(done, reason="interrupted")
    again, _ = make_peer(spec, store, root, "a")
    again.announce()
    assert not announcement_of(again).withdrawn


def test_join_gives_up_when_no_genesis_of_its_run_appears(tmp_path: Path) -> None:
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident)
    store = open_store(f"memory://nogenesis-{time.time_ns()}")
    MiniValidator(spec.replace(codec={"k": 32}), store, vident)  # the operator's run differs in one field
    local = LocalSettings(poll_interval_s=0.02, peer=PeerSettings(join_timeout_s=0.5))
    peer, rec = make_peer(spec, store, tmp_path, "a", local)
    start = time.monotonic()
    with pytest.raises(RunNotFound) as err:
        peer.run()
    assert time.monotonic() - start < 10  # the bound, plus this machine's slack
    message = str(err.value)
    assert spec.hash() in message and "sparseloco run-id run.toml" in message
    assert local.store.location() in message
    waiting = rec.of(WaitingForGenesis)
    assert waiting and waiting[0].run_hash == spec.hash() and waiting[0].timeout_s == 0.5
    assert announcement_of(peer).withdrawn  # it announced (under its own run), so it withdrew


class UnreachableStore(FlakyStore):
    """Nothing answers the first ``outages`` puts (a grant server whose validator is not up yet)."""

    def __init__(self, inner: ObjectStore, outages: int) -> None:
        super().__init__(inner, window=-1)
        self.outages = outages

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if self.outages > 0:
            self.outages -= 1
            raise StoreUnavailable(f"nothing answers for {key}")
        self.inner.put(key, data, if_absent=if_absent)


class ReadsDownStore(FlakyStore):
    """Reads of aggregates fail ``outages`` times, as if the link were down, once ``armed``."""

    def __init__(self, inner: ObjectStore, outages: int) -> None:
        super().__init__(inner, window=-1)
        self.outages, self.armed, self.failed = outages, False, 0

    def _down(self, key: str) -> None:
        if self.armed and "/aggregate/" in key and self.failed < self.outages:
            self.failed += 1
            raise StoreUnavailable(f"nothing answers for {key}")

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        self._down(key)
        return self.inner.get(key, max_bytes=max_bytes)

    def size(self, key: str) -> int:
        self._down(key)
        return self.inner.size(key)


def test_a_link_down_while_catching_up_costs_no_window(swarm) -> None:
    """The store does not answer while the peer reads the next aggregate: it waits and reads
    again; the window it then trains is uploaded, none is recorded as failed."""
    spec, store, val, root = swarm
    flaky = ReadsDownStore(store, outages=3)
    peer, rec = make_peer(spec, flaky, root, "patient")
    t = threading.Thread(target=peer.run, kwargs={"until_window": 3}, daemon=True)
    t.start()
    rec.wait_for(lambda: bool(rec.of(Joined)))
    flaky.armed = True  # from now on: the link goes down at the next aggregate's read
    while val.window < 3:
        val.close_window(1)
    t.join(timeout=60)
    assert not t.is_alive()
    assert flaky.failed == 3
    windows = rec.of(PeerWindow)
    assert [e.outcome for e in windows] == ["uploaded"] * 3, [(e.window, e.outcome, e.detail) for e in windows]
    assert fingerprint(peer.params) == val.fingerprints[-1]


class StoreDownStore(FlakyStore):
    """Once ``armed``, nothing answers the next ``outages`` requests of any kind (the store is down)."""

    def __init__(self, inner: ObjectStore, outages: int) -> None:
        super().__init__(inner, window=-1)
        self.outages, self.armed, self.failed = outages, False, 0

    def _down(self, key: str) -> None:
        if self.armed and self.failed < self.outages:
            self.failed += 1
            raise StoreUnavailable(f"nothing answers for {key}")

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._down(key)
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        self._down(key)
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str) -> list[str]:
        self._down(prefix)
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        self._down(key)
        return self.inner.size(key)


def test_a_store_down_mid_window_costs_no_window_and_is_said_once(swarm, caplog) -> None:
    """The store stops answering every request while the peer trains and uploads a window (well
    within its deadline): the window is tried again once the store answers, not recorded as
    failed; the peer says once that the store does not answer and once that it answers again."""
    spec, store, val, root = swarm
    down = StoreDownStore(store, outages=6)
    peer, rec = make_peer(spec, down, root, "steady")
    t = threading.Thread(target=peer.run, kwargs={"until_window": 3}, daemon=True)
    with caplog.at_level(logging.WARNING, logger="client.peer"):
        t.start()
        rec.wait_for(lambda: bool(rec.of(Joined)))
        down.armed = True
        while val.window < 3:
            val.close_window(1)
        t.join(timeout=60)
    assert not t.is_alive() and down.failed == 6
    windows = rec.of(PeerWindow)
    assert [e.outcome for e in windows] == ["uploaded"] * 3, [(e.window, e.outcome, e.detail) for e in windows]
    assert not rec.of(SyncFailed)  # one episode, not a line per look
    said = [r.getMessage() for r in caplog.records]
    assert sum("the store does not answer" in m for m in said) == 1, said
    assert sum("the store answers again" in m for m in said) == 1, said
    assert fingerprint(peer.params) == val.fingerprints[-1]


def test_a_store_down_while_a_late_peer_replays_is_waited_out(swarm, caplog) -> None:
    """A peer joins two windows late while the store does not answer its reads of the aggregates:
    the replay waits, says so once, goes on from the last aggregate it applied, and the peer joins
    on the chain's θ and trains (the join failed with the store's error before)."""
    spec, store, val, root = swarm
    first, _ = make_peer(spec, store, root, "first")
    run_peers(val, [first], windows=2)
    down = ReadsDownStore(store, outages=3)
    down.armed = True
    late, rec = make_peer(spec, down, root, "late")
    t = threading.Thread(target=late.run, kwargs={"until_window": 3}, daemon=True)
    with caplog.at_level(logging.WARNING, logger="client.peer"):
        t.start()
        rec.wait_for(lambda: bool(rec.of(Joined)))
        while val.window < 3:
            val.close_window(1)
        t.join(timeout=60)
    assert not t.is_alive() and down.failed == 3
    (joined,) = rec.of(Joined)
    assert joined.window == 2
    assert [(e.window, e.outcome) for e in rec.of(PeerWindow)] == [(2, "uploaded")]
    said = [r.getMessage() for r in caplog.records]
    assert sum("the store does not answer" in m for m in said) == 1, said
    assert sum("the store answers again" in m for m in said) == 1, said
    assert fingerprint(late.params) == val.fingerprints[-1]


def test_a_window_broken_by_a_store_that_does_not_answer_is_trained_again_while_open(swarm) -> None:
    """Training window 1 breaks twice on a store that does not answer (its deadline far ahead):
    the window is trained again and uploaded, not recorded as failed (nor is any other)."""
    spec, store, val, root = swarm
    peer, rec = make_peer(spec, store, root, "again")
    real, broken = peer.train, []

    def train(window: int) -> Staged | Skipped:
        if window == 1 and len(broken) < 2:
            broken.append(window)
            raise StoreUnavailable("nothing answers")
        return real(window)

    peer.train = train  # type: ignore[method-assign]
    run_peers(val, [peer], windows=3)
    assert broken == [1, 1]
    assert [(e.window, e.outcome) for e in rec.of(PeerWindow)] == [(0, "uploaded"), (1, "uploaded"), (2, "uploaded")]


def test_a_peer_waits_to_announce_until_the_store_answers(swarm) -> None:
    spec, store, val, root = swarm
    peer, rec = make_peer(spec, UnreachableStore(store, outages=4), root, "early")  # 3 per announce attempt
    peer.run(until_window=0)
    assert rec.of(WaitingForGenesis) and rec.of(Joined)
    assert announcement_of(peer).withdrawn  # it announced, then left


def test_a_peer_whose_store_never_answers_gives_up_within_its_join_timeout(swarm) -> None:
    spec, store, val, root = swarm
    local = LocalSettings(poll_interval_s=0.02, peer=PeerSettings(join_timeout_s=0.5))
    peer, rec = make_peer(spec, UnreachableStore(store, outages=10**6), root, "lost", local)
    with pytest.raises(RunNotFound, match="unreachable"):
        peer.run()
    assert not peer.announced and not rec.of(Joined)


class DenyingStore(FlakyStore):
    """Reads and announcements work; every contribution put is denied (a read-only credential)."""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if "/contrib/" in key:
            self.refused += 1
            raise AccessDenied(f"denied: {key}")
        self.inner.put(key, data, if_absent=if_absent)


def test_a_peer_whose_uploads_are_refused_stops_after_n_windows(swarm) -> None:
    spec, store, val, root = swarm
    local = LocalSettings(poll_interval_s=0.02, peer=PeerSettings(max_upload_failures=2))
    peer, rec = make_peer(spec, DenyingStore(store, window=0), root, "denied", local)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            peer.run()
        except UploadsRefused as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    rec.wait_for(lambda: bool(rec.of(PeerWindow)))
    assert rec.of(PeerWindow)[0].outcome == "failed"
    val.close_window(0, timeout=0)  # window 0 closes without it; it fails window 1 alike and stops
    t.join(timeout=60)
    assert not t.is_alive() and len(errors) == 1
    assert [(e.window, e.outcome) for e in rec.of(PeerWindow)] == [(0, "failed"), (1, "failed")]
    assert "2 consecutive windows" in str(errors[0]) and peer.identity.peer_id in str(errors[0])
    assert announcement_of(peer).withdrawn


def test_cli_refuses_a_runspec_without_validator_keys(tmp_path: Path) -> None:
    import subprocess
    import sys

    spec = RunSpec.from_dict({"model": TINY})
    (tmp_path / "run.toml").write_text(
        spec.to_toml() + local_table_toml({"store": {"url": f"file://{tmp_path / 'store'}"}})
    )
    exe = Path(sys.executable).parent / "sparseloco-peer"
    out = subprocess.run(
        [str(exe), "join", "--run", str(tmp_path / "run.toml"), "--state", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "validator.public_keys" in out.stderr
    assert not (tmp_path / "store").exists()  # nothing was announced


def test_forged_aggregate_is_recorded_and_never_applied(swarm, caplog) -> None:
    spec, store, val, root = swarm
    peer, rec = make_peer(spec, store, root, "a")
    t = threading.Thread(target=peer.run, kwargs={"until_window": 2}, daemon=True)
    t.start()
    val.close_window(1)
    key = layout.aggregate_key(val.run, 1)
    while not store.list(layout.contrib_prefix(val.run, 1)):
        time.sleep(0.02)
    honest_fp = fingerprint(peer.params)
    forged = encode_window_aggregate(
        run_hash=spec.hash(),
        window=1,
        base=val.base,
        alpha=1.0,
        tensors={},
        manifest=[],
        fingerprint_next=honest_fp,
        published_at=time.time(),
        metadata={},
        identity=Identity.generate(),
    )
    caplog.set_level(logging.WARNING, logger="protocol.chain")
    store.put(key, forged)
    deadline = time.time() + 30
    while "unknown_signer" not in caplog.text and time.time() < deadline:
        time.sleep(0.05)
    # seen, logged and ignored: the forgery neither closes window 1 nor stops the peer
    assert "aggregate 1 in the store does not verify" in caplog.text
    assert peer.pos.window == 1 and 1 not in [e.window for e in rec.of(Applied)] and t.is_alive()
    assert not rec.of(SyncFailed)
    store.delete(key)  # the operator removes the forgery; the real validator publishes
    val.close_window(1)
    t.join(timeout=60)
    assert not t.is_alive() and fingerprint(peer.params) == val.fingerprints[-1]


# ---------------------------------------------------------------------- the overlapped schedule
def contribution_of(store: ObjectStore, val: MiniValidator, peer: Peer, window: int):
    blob = store.get(layout.contrib_key(val.run, window, peer.identity.peer_id))
    return decode_contribution(blob, run_hash=val.spec.hash(), max_bytes=len(blob)).value


def test_a_fresh_peer_trains_window_0_while_genesis_is_not_out(tmp_path: Path) -> None:
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident)
    store = open_store(f"memory://early-{time.time_ns()}")
    peer, rec = make_peer(spec, store, tmp_path, "early")
    t = threading.Thread(target=peer.run, kwargs={"until_window": 1}, daemon=True)
    t.start()
    rec.wait_for(lambda: peer.trainer.step == spec.inner.steps)  # window 0 trained, no genesis yet
    assert rec.of(WaitingForGenesis) and not rec.of(Joined) and not rec.of(PeerWindow)
    val = MiniValidator(spec, store, vident)  # the validator comes up: genesis
    val.close_window(1)
    t.join(timeout=60)
    assert not t.is_alive()
    [window] = rec.of(PeerWindow)
    assert (window.window, window.outcome, window.inner_s > 0) == (0, "uploaded", True)
    assert contribution_of(store, val, peer, 0).base == val.launch  # signed once genesis was known
    assert peer.trainer.step == spec.inner.steps  # trained once, before genesis
    assert fingerprint(peer.params) == val.fingerprints[-1]


def test_an_aggregate_that_arrives_mid_window_moves_the_working_model(tmp_path: Path) -> None:
    """Window 1 starts from θ_0 while aggregate 0 is in flight; it is published after the first
    inner step: the peer applies it to θ and to its working model, and window 1 is sent against θ_1
    (base = aggregate 0), exactly like a synchronous contribution."""
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(outer={"eager": False})
    store = open_store(f"memory://mid-window-{time.time_ns()}")
    val, root = MiniValidator(spec, store, vident), tmp_path
    peer, rec = make_peer(spec, store, root, "a")
    peer.join()
    send(peer, 0)

    def publish_after_first_step(**fields: object) -> None:
        if fields.get("step") == 1 and fields.get("window") == 1 and val.window == 0:
            val.close_window(1)

    peer.display.update = publish_after_first_step  # type: ignore[method-assign]
    staged = peer.train(1)
    assert isinstance(staged, Staged) and staged.trained_from == 0 and staged.stats.stale_steps == 1
    assert peer.pos.window == 1 and peer.pos.fingerprint == val.fingerprints[0]
    peer.upload(staged)
    peer.flush()
    assert contribution_of(store, val, peer, 1).base == val.base  # aggregate 0's digest: not stale
    assert rec.of(PeerWindow)[-1].stale_steps == 1 and [e.window for e in rec.of(Applied)] == [0]


def test_a_wait_mid_window_for_a_late_aggregate_is_reported_apart_from_training(tmp_path: Path) -> None:
    """Aggregate 0 comes a second after window 1's trainer has reached the point where it must wait
    for it (a slow or restarting validator): the window's report says how much of its inner time
    was that wait, and its human line says so, rather than a second more of training."""
    from protocol.events import describe

    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(outer={"eager": False})
    store = open_store(f"memory://late-aggregate-{time.time_ns()}")
    val = MiniValidator(spec, store, vident)
    peer, rec = make_peer(spec, store, tmp_path, "a")
    peer.join()
    send(peer, 0)
    late: list[threading.Timer] = []

    def publish_a_second_after_the_wait_began(**fields: object) -> None:
        if fields.get("phase") == "waiting for aggregate" and not late:
            late.append(threading.Timer(1.0, val.close_window, args=(1,)))
            late[0].start()

    peer.display.update = publish_a_second_after_the_wait_began  # type: ignore[method-assign]
    staged = peer.train(1)
    assert isinstance(staged, Staged) and late and peer.pos.window == 1
    assert 0.9 <= staged.stats.aggregate_wait_s <= staged.stats.inner_s
    peer.upload(staged)
    peer.flush()
    report = rec.of(PeerWindow)[-1]
    assert report.window == 1 and report.aggregate_wait_s == round(staged.stats.aggregate_wait_s, 3)
    assert f"(of which {report.aggregate_wait_s:.1f} s waiting for aggregate 0)" in describe(report)


def test_an_aggregate_late_by_a_whole_window_is_said_to_be_late_once_and_when_it_came(tmp_path: Path, caplog) -> None:
    """The validator is down: aggregate 0 is not published a whole upload deadline after window 0
    closed. The waiting peer says so once (not silence), and how late it was when it arrives."""
    from client.peer.position import overdue_at

    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident, upload_deadline_s=3.0, gather_grace_s=0.5)
    store = open_store(f"memory://late-validator-{time.time_ns()}")
    val = MiniValidator(spec, store, vident)
    peer, _ = make_peer(spec, store, tmp_path, "a")
    peer.join()
    closes = peer.theta.deadline(0)
    assert closes and overdue_at(closes, spec) == closes + 3.5
    late = max(0.0, overdue_at(closes, spec) + 1.0 - time.time())
    comes_back = threading.Timer(late, val.close_window, kwargs={"expect": 0, "timeout": 0})
    comes_back.start()
    with caplog.at_level(logging.WARNING, logger="client.peer.position"):
        peer.catchup.wait()
    comes_back.join()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "aggregate 0 is not published" in m and "slow or down" in m]) == 1, said
    assert any(re.fullmatch(r"aggregate 0 was published \d+ s after its window's upload deadline", m) for m in said)
    peer.catchup.between_windows(1)
    assert peer.pos.window == 1


def test_the_eager_forecast_is_the_aggregate_when_the_validator_takes_the_same_contributions(swarm) -> None:
    """Two peers; peer a trains window 1 from θ_0 less the forecast of aggregate 0 from both
    window-0 contributions in the store, and aggregate 0 arrives after its first inner step. The
    validator took both: the forecast was aggregate 0 bit for bit, so a's contribution is exactly
    the one its twin (same key, e and optimizer state) trains from θ_1 on the synchronous schedule."""
    spec, store, val, root = swarm
    (a, _), (b, _) = make_peer(spec, store, root, "a"), make_peer(spec, store, root, "b")
    for p in (a, b):
        p.join()
        send(p, 0)
    shutil.copytree(root / "a", root / "twin")  # a's key, e, moments and step after window 0
    forecast: list[int] = []

    def publish_after_first_step(**fields: object) -> None:
        if fields.get("window") == 1 and fields.get("step") == 1 and val.window == 0:
            assert a.inflight.forecast is not None
            forecast.append(a.inflight.forecast.contributors)
            val.close_window(2)

    a.display.update = publish_after_first_step  # type: ignore[method-assign]
    staged = a.train(1)
    assert isinstance(staged, Staged) and staged.trained_from == 0 and staged.stats.stale_steps == 1
    assert forecast == [2] and a.pos.fingerprint == val.fingerprints[0] and a.inflight.stand_in == {}

    twin, _ = make_peer(spec, store, root, "twin")
    twin.join()  # θ_1: aggregate 0 is published
    assert twin.pos.window == 1 and twin.identity.peer_id == a.identity.peer_id
    synchronous = twin.train(1)
    assert isinstance(synchronous, Staged) and synchronous.stats.stale_steps == 0
    for name, enc in staged.sent.items():
        other = synchronous.sent[name]
        assert torch.equal(enc.indices, other.indices) and torch.equal(enc.codes, other.codes), name
        assert torch.equal(enc.scale_codes, other.scale_codes) and enc.base == other.base, name
    assert tensors_equal(a.feedback.state_dict(), twin.feedback.state_dict())


def _two_peers_after_window_1(tmp_path: Path) -> tuple[RunSpec, MiniValidator, Peer, Peer, Staged]:
    """Peers a and b in aggregate 0; both trained window 1 on θ_1, a uploaded it, b holds it staged
    (``outer.overlap = 1``: window 2 may end before aggregate 1 arrives, as it does here)."""
    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(outer={"forecast_wait": 1.0, "overlap": 1.0})  # never waits for aggregate 1
    store = open_store(f"memory://forecast-wait-{time.time_ns()}")
    val = MiniValidator(spec, store, vident)
    (a, _), (b, _) = make_peer(spec, store, tmp_path, "a"), make_peer(spec, store, tmp_path, "b")
    for p in (a, b):
        p.join()
        send(p, 0)
    assert sorted(val.close_window(2)) == sorted([a.identity.peer_id, b.identity.peer_id])
    held: list[Staged] = []
    for p in (a, b):
        p.catch_up(1)
        staged = p.train(1)
        assert isinstance(staged, Staged) and staged.stats.stale_steps == 0  # θ_1 opened it
        held.append(staged)
    a.upload(held[0])
    a.flush()
    return spec, val, a, b, held[1]


def test_an_eager_peer_waits_for_the_other_contributions_before_its_first_step(tmp_path: Path) -> None:
    """a opens window 2 while aggregate 1 is in flight and only its own window-1 contribution is in
    the store: it waits before its first inner step (outer.forecast_wait), b's upload lands during
    that wait, and a trains from the forecast of both contributions."""
    _, _, a, b, b_staged = _two_peers_after_window_1(tmp_path)
    seen: list[tuple[str, int]] = []

    def upload_b_while_a_waits(**fields: object) -> None:
        if fields.get("phase") == "waiting for contributions":
            assert a.inflight.forecast is not None and a.inflight.forecast.contributors == 1
            b.upload(b_staged)
            b.flush()
        if fields.get("step") == 1 and a.inflight.forecast is not None:
            seen.append(("step 1", a.inflight.forecast.contributors))

    a.display.update = upload_b_while_a_waits  # type: ignore[method-assign]
    staged = a.train(2)
    assert isinstance(staged, Staged) and staged.trained_from == 1
    assert seen == [("step 1", 2)] and a.inflight.forecast is not None and a.inflight.forecast.complete
    assert staged.stats.forecast_wait_s > 0 and staged.stats.stale_steps == a.spec.inner.steps


def test_the_wait_for_contributions_is_bounded_and_then_the_peer_trains_from_its_own(tmp_path: Path) -> None:
    """b never uploads window 1: a waits at most its budget, then trains window 2 from the forecast
    of its own contribution alone, and the window is sent."""
    _, val, a, _, _ = _two_peers_after_window_1(tmp_path)
    phases: list[object] = []
    a.display.update = lambda **fields: phases.append(fields.get("phase"))  # type: ignore[method-assign]
    staged = a.train(2)
    assert isinstance(staged, Staged) and "waiting for contributions" in phases
    assert a.inflight.forecast is not None and a.inflight.forecast.contributors == 1
    assert not a.inflight.forecast.complete and staged.stats.forecast_wait_s > 0
    a.upload(staged)
    a.flush()
    assert val.close_window(1) == [a.identity.peer_id]  # window 1: only a's arrived


# ---------------------------------------------------------------------- the moments rule
def moments_of(optimizer_state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The AdamW moment tensors of a trainer state_dict, cloned, by parameter index."""
    return {
        f"{i}.{k}": v.detach().clone()
        for i, s in optimizer_state["optimizer"]["state"].items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    }


def test_a_restart_resumes_e_and_the_schedule_exactly_and_moments_at_most_moments_every_old(swarm) -> None:
    """``peer.moments_every = 3``: the moments are written with window 0's commit and next with
    window 3's. A peer killed after window 1 restarts with e and the inner step of window 1 and
    the moments of window 0; it trains on, stays on the swarm's θ, and window 3 writes them again."""
    spec, store, val, root = swarm
    local = LocalSettings(poll_interval_s=0.02, peer=PeerSettings(moments_every=3))
    peer, _ = make_peer(spec, store, root, "a", local)
    peer.join()
    after: list[dict[str, torch.Tensor]] = []
    for window in (0, 1):
        send(peer, window)
        after.append(moments_of(peer.trainer.state_dict()))
        val.close_window(1)
    assert not tensors_equal(after[0], after[1])
    assert peer.state.moments_window() == 0
    e, step = copy_of(peer.feedback), peer.trainer.step  # "killed" here: no stop, no final commit

    again, rec = make_peer(spec, store, root, "a", local)
    again.join()
    assert rec.of(Joined)[0].resumed
    assert tensors_equal(again.feedback.state_dict(), e.state_dict())  # e: exactly the last commit's
    assert again.trainer.step == step  # the learning-rate schedule: exactly
    assert tensors_equal(moments_of(again.trainer.state_dict()), after[0])  # moments: window 0's
    for window in (2, 3):
        send(again, window)
        val.close_window(1)
    assert again.state.moments_window() == 3
    again.catch_up(4)
    assert fingerprint(again.params) == val.fingerprints[-1]
