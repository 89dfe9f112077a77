"""The peer: join a run, then train, compress, sign and upload one contribution per window.

    trainer = FullReplica(spec, data_key=identity.peer_id, device="cuda")   # or a pipeline StageTrainer
    peer = Peer(spec, store, identity, LocalState(dir), trainer, local=settings, display=PeerDisplay())
    peer.run(until_window=20)          # returns when θ opens window 20 (or on stop())

One window, as :meth:`Peer.run` reads it::

    catch_up    wait for / pull / verify / apply aggregate t−1 (fingerprint check, resync on mismatch)
    train       the trainer's H steps from θ_t, then Δ̂, e′ = compress_step(e, Δ); sign Δ̂
    upload      commit e′, the moments and the signed bytes together, then put contrib/<t>/<peer>
    (next)      catch_up applies aggregate t and commits θ_{t+1}'s position

How the peer trains is a :class:`~client.window.WindowTrainer` it holds: the whole model
(:class:`client.replica.FullReplica`) or one stage of a pipeline replica
(:class:`client.pipeline.trainer.StageTrainer`). Either returns the window's work as a value
(:class:`~client.window.Trained` or :class:`~client.window.Skipped`) and changes nothing the peer
owns; the peer decides what takes effect.

Error feedback across failures. e changes only when a contribution is staged: the e′ computed with
it is adopted in the same atomic commit of the state directory that writes the signed bytes
(write-ahead), so a restart re-uploads exactly those bytes with exactly that e.

* A window whose deadline passes before its contribution is staged (slow hardware, a stalled store,
  a pipeline stage that lost its group) is *skipped*: nothing was adopted, e keeps its pre-window
  value, and the window's Δ never enters e (it was computed against a θ_t the swarm moved past).
* A staged contribution whose put fails for good gives its Δ̂ back: e ← e′ + decode(Δ̂), which is
  β·e + Δ up to float rounding, i.e. what error feedback keeps when nothing is sent. The rule needs
  only what the commit holds (the staged bytes are Δ̂), so it applies unchanged to an upload
  resumed after a restart; restoring the pre-window e instead would need a second copy of e in the
  state directory. Either way e never loses mass that was not sent.
* A staged contribution that reached the store but is rejected or late, or whose window closed
  while the peer was down, loses its Δ̂ exactly as in production SparseLoCo: e already had it
  subtracted, and it may well have been sent.

The inner optimizer's moments and step keep what training did, also in a skipped window: they
describe the local loss surface and carry nothing the swarm sees, and rolling them back would cost
a copy of the optimizer state (2× the parameters) every window. They reach the state directory
with the next staged contribution; a restart before it resumes from the moments committed last.

Failures at a window boundary (store errors, bad aggregates, missed deadlines) become recorded
outcomes (a :class:`~protocol.events.PeerWindow` event with ``outcome`` and ``reason``). What stops
the peer: configuration and identity errors; no genesis checkpoint of its run hash within
``peer.join_timeout_s`` (:class:`RunNotFound`: its run.toml differs from the operator's, or the
validator is not up; a store that does not answer yet, such as a grant server whose validator is
starting, is waited for within the same bound); and ``peer.max_upload_failures`` consecutive
contributions the store refused while reads work (:class:`UploadsRefused`: a credential that may
read but not write, so training on would only stall the run).

Leaving. However :meth:`Peer.run` ends once the peer has announced (done, :meth:`stop`, Ctrl-C,
one of the errors above), it replaces its announcement by a signed withdrawal: the validator stops
waiting for this peer at once instead of holding the next window open until its deadline.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from client.progress import PeerDisplay
from client.state import LocalState, Snapshot
from client.sync import Position, Sync
from client.window import Skipped, WindowJob, WindowStats, WindowTrainer
from protocol import layout
from protocol.codec import Encoded
from protocol.config import RunSpec
from protocol.errors import ConfigError, ObjectExists, ProtocolError, ReasonedError, StoreError, StoreUnavailable
from protocol.events import (
    Announced,
    Applied,
    Joined,
    PeerStarted,
    PeerWindow,
    ResumedUpload,
    Resynced,
    Stopped,
    SyncFailed,
    WaitingForGenesis,
)
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore, put_once
from protocol.windows import upload_deadline
from protocol.wire import (
    Aggregate,
    Announcement,
    Contribution,
    Verified,
    decode_contribution,
    encode_announcement,
    encode_contribution,
)

CLIENT_VERSION = "sparseloco-peer/0.1"
UPLOAD_RETRIES = 3
GENESIS_REPORT_S = 10.0  # how often a peer waiting for genesis says so


class RunNotFound(ReasonedError):
    """No signed genesis checkpoint of this peer's run hash appeared within ``peer.join_timeout_s``."""

    reason = "run_not_found"


class UploadsRefused(ReasonedError):
    """The store refused ``peer.max_upload_failures`` consecutive contributions of this peer."""

    reason = "uploads_refused"


@dataclass(frozen=True)
class Staged:
    """A window's signed contribution and the state adopted with it, in one commit.

    ``sent``: the Δ̂ inside ``blob`` (given back to e if the bytes never reach the store).
    ``feedback_after``/``optimizer_after``: what the trainer returned with it (see
    :class:`client.window.Trained`).
    """

    window: int
    blob: bytes
    sent: Mapping[str, Encoded]
    stats: WindowStats
    feedback_after: FeedbackState
    optimizer_after: Mapping[str, Any]


class Peer:
    """One participant; see the module docstring for the window loop."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state: LocalState,
        trainer: WindowTrainer,
        *,
        local: LocalSettings | None = None,
        display: PeerDisplay | None = None,
    ) -> None:
        self.spec, self.store, self.identity, self.state = spec, store, identity, state
        self.trainer = trainer
        self.local = local or LocalSettings()
        self.display = display or PeerDisplay(json_lines=True)
        self.run_id = layout.run_id(spec.hash())
        self.sync = Sync(spec, store, poll_interval_s=self.local.poll_interval_s)
        self.feedback = FeedbackState()  # e as last committed (changed only with a staged contribution)
        self.params: dict[str, torch.Tensor] = {}  # θ master copy: CPU float32, changed only by Sync
        self.pos = Position(0, "", "")
        self.pending: Staged | None = None  # staged, not yet known to be aggregated
        self._checkpoint_window = 0
        self._diverged = False  # θ must be rebuilt from a checkpoint before training again
        self.inner_s = 0.0
        self.windows_trained = 0
        self.announced = False  # our announcement is in the store: leaving withdraws it
        self.withdrawn = False
        self._refused = 0  # consecutive contributions the store refused
        self._stop = False

    def stop(self) -> None:
        """Ask the loop to stop at the next phase boundary (Ctrl-C raises instead, also safely)."""
        self._stop = True

    # ------------------------------------------------------------------ the loop
    def run(self, *, until_window: int | None = None, max_windows: int | None = None) -> None:
        """Join, then one iteration per window until θ opens ``until_window`` or
        ``max_windows`` windows were trained here (or :meth:`stop`); then withdraw."""
        try:
            self.join()
            while not self._done(until_window, max_windows):
                try:
                    self.catch_up()  # pull/verify/apply aggregate t−1 (and every other one published)
                    if self._done(until_window, max_windows) or self._diverged:
                        continue
                    work = self.train(self.pos.window)  # H steps → Δ → signed Δ̂ with e′, or a skip
                    if isinstance(work, Staged):
                        self.upload(work)  # commit e′ with the bytes, put before the deadline
                    else:
                        self._skip(self.pos.window, work)
                except (ProtocolError, StoreError) as exc:
                    self._failed(exc)  # a recorded outcome; the next iteration retries or moves on
        finally:
            if self.announced:  # also on Ctrl-C and on the errors that stop the peer
                self.withdrawn = self.withdraw()
        self.display.emit(
            Stopped(
                reason="stopped" if self._stop else "done",
                window=self.pos.window,
                windows_trained=self.windows_trained,
                inner_s=round(self.inner_s, 3),
                fingerprint=self.pos.fingerprint,
                withdrawn=self.withdrawn,
            )
        )

    def _done(self, until_window: int | None, max_windows: int | None) -> bool:
        if self._stop:
            return True
        if max_windows is not None and self.windows_trained >= max_windows and self.pending is None:
            return True
        return until_window is not None and self.pos.window >= until_window

    # ------------------------------------------------------------------ join
    def join(self) -> None:
        """Announce, restore local state, load the newest checkpoint and replay aggregates."""
        t0 = time.time()
        self.display.emit(
            PeerStarted(
                peer_id=self.identity.peer_id,
                run_id=self.run_id,
                run_hash=self.spec.hash(),
                store=self.local.store.location(),
            )
        )
        self._announce_when_reachable(t0)
        self.display.emit(Announced(peer_id=self.identity.peer_id))
        snap = self.state.load(self.spec.hash())
        if snap is not None:
            self.feedback = FeedbackState.from_state_dict(snap.feedback)
            if snap.optimizer is not None:
                self.trainer.load_state_dict(snap.optimizer)
        self.pos = self._wait_for_genesis()
        if snap is not None and snap.pending == self.pos.window and snap.pending_blob is not None:
            self._resume_pending(snap.pending, snap.pending_blob)
        self.display.update(peer_id=self.identity.peer_id, window=self.pos.window, fingerprint=self.pos.fingerprint)
        self.display.emit(
            Joined(
                peer_id=self.identity.peer_id,
                window=self.pos.window,
                fingerprint=self.pos.fingerprint,
                replayed_from=self._checkpoint_window,
                resumed=snap is not None,
                resumed_window=snap.window if snap else None,
                feedback_norm=round(self.feedback.norm(), 6),
                inner_step=self.trainer.step,
                join_s=round(time.time() - t0, 3),
            )
        )

    def announce(self) -> None:
        """Sign and put this peer's announcement (hardware and pipeline role from its trainer)."""
        ann = Announcement(self.spec.hash(), 0, CLIENT_VERSION, self.trainer.hardware, role=self.trainer.role)
        self._put_with_retry(
            layout.peer_key(self.run_id, self.identity.peer_id), encode_announcement(ann, self.identity)
        )
        self.announced = True

    def _announce_when_reachable(self, started: float) -> None:
        """Announce; while the store is unreachable (a grant server whose validator has not
        started yet) keep trying, as long as a peer waits for genesis (``peer.join_timeout_s``)."""
        timeout = self.local.peer.join_timeout_s
        reported: float | None = None
        while True:
            try:
                self.announce()
                return
            except StoreUnavailable as exc:
                waited = time.time() - started
                if waited >= timeout or self._stop:
                    raise RunNotFound(f"{self._not_found(timeout)}; the store stayed unreachable: {exc}") from exc
                if reported is None or waited - reported >= GENESIS_REPORT_S:
                    reported = waited
                    self._report_waiting(waited, timeout)
                time.sleep(self.sync.poll_s)

    def withdraw(self) -> bool:
        """Replace our announcement by a signed withdrawal (the key is ours): the validator stops
        waiting for this peer. Best effort: False when the store refused it."""
        ann = Announcement(
            self.spec.hash(),
            self.pos.window,
            CLIENT_VERSION,
            self.trainer.hardware,
            role=self.trainer.role,
            withdrawn=True,
        )
        try:
            self._put_with_retry(
                layout.peer_key(self.run_id, self.identity.peer_id), encode_announcement(ann, self.identity)
            )
        except StoreError:
            return False  # the validator stops waiting after one window anyway
        return True

    def _wait_for_genesis(self) -> Position:
        """Newest checkpoint (waiting for genesis if the validator is not up yet, at most
        ``peer.join_timeout_s``), then replay."""
        timeout = self.local.peer.join_timeout_s
        start = time.monotonic()
        reported: float | None = None
        while True:
            try:
                pos = self.sync.resync(self.params)
                break
            except ProtocolError as exc:
                if exc.reason != "not_ready" or self._stop:
                    raise
            waited = time.monotonic() - start
            if waited >= timeout:
                raise RunNotFound(self._not_found(timeout))
            if reported is None or waited - reported >= GENESIS_REPORT_S:
                reported = waited
                self._report_waiting(waited, timeout)
            self.display.update(phase="waiting for genesis")
            time.sleep(self.sync.poll_s)
        self._checkpoint_window = pos.window
        return self.sync.advance(self.params, pos, on_apply=self._applied, on_resync=self._resynced)

    def _report_waiting(self, waited: float, timeout: float) -> None:
        self.display.emit(
            WaitingForGenesis(
                run_id=self.run_id,
                run_hash=self.spec.hash(),
                store=self.local.store.location(),
                waited_s=round(waited, 1),
                timeout_s=timeout,
            )
        )

    def _not_found(self, timeout: float) -> str:
        return (
            f"no genesis checkpoint of run {self.run_id} (run hash {self.spec.hash()}) in "
            f"{self.local.store.location()} after {timeout:.0f} s. Either the run's validator has not "
            "started, or this run.toml differs from the operator's: run `sparseloco run-id run.toml` "
            "on both sides and compare the run hashes (only the RunSpec counts; [local], --settings, "
            "SPARSELOCO_* variables and flags do not)"
        )

    def _resume_pending(self, window: int, blob: bytes) -> None:
        """A contribution staged before a restart (e and the moments were restored with it):
        upload it if its window is still open."""
        if not self._window_open(window):
            return  # like a late upload: its Δ̂ may have been sent before the restart
        unknown = WindowStats(float("nan"), float("nan"), 0, 0.0, 0.0)
        staged = Staged(window, blob, self._sent_in(blob), unknown, self.feedback, self.trainer.state_dict())
        self.pending = staged
        outcome, reason = self._put_contribution(staged)
        if outcome != "uploaded":
            self._give_back(staged)
        self.display.emit(ResumedUpload(window=window, outcome=outcome, reason=reason))

    def _sent_in(self, blob: bytes) -> dict[str, Encoded]:
        """The Δ̂ of our own staged contribution (read back from its signed bytes)."""
        try:
            return dict(decode_contribution(blob, run_hash=self.spec.hash(), max_bytes=len(blob)).value.tensors)
        except ProtocolError as exc:
            raise ConfigError(f"the contribution staged in {self.state.root} is unreadable: {exc}") from exc

    # ------------------------------------------------------------------ catch-up
    def catch_up(self) -> None:
        """Wait for the aggregate of the window we contributed to, then apply every published one."""
        before = self.pos.window
        if self.pending is not None and self.pending.window == self.pos.window:
            self.display.update(phase="waiting for aggregate")
            self.sync.wait_until_published(self.pos.window, base=self.pos.base, should_stop=lambda: self._stop)
        try:
            if self._diverged:
                self.pos = self.sync.bootstrap(self.params, on_apply=self._applied)
                self._diverged = False
            else:
                self.pos = self.sync.advance(self.params, self.pos, on_apply=self._applied, on_resync=self._resynced)
        except (ProtocolError, StoreError) as exc:
            # A bad object or a failing store: record it, and rebuild θ from the newest checkpoint
            # on the next try (θ may be half-updated, so it cannot be trusted any more).
            self.display.emit(SyncFailed(window=self.pos.window, reason=exc.reason, detail=str(exc)))
            self._diverged = True
            time.sleep(max(self.sync.poll_s, 1.0))  # a persistent fault must not spin
            return
        if self.pending is not None and self.pending.window < self.pos.window:
            self.pending = None
        if self.pos.window != before:
            self._commit(self.trainer.state_dict(), tensors_unchanged=True)

    def _applied(self, agg: Verified[Aggregate], pos: Position) -> None:
        """Report aggregate ``agg`` (the fingerprint of θ after it, whether our contribution is in it)."""
        mine = [m for m in agg.value.manifest if m.peer_id == self.identity.peer_id]
        weight = mine[0].weight if mine else None
        self.state.record(
            {
                "window": agg.value.window,
                "fingerprint": pos.fingerprint,
                "aggregate": agg.digest,
                "included": bool(mine),
                "weight": weight,
                "time": round(time.time(), 3),
            }
        )
        self.display.update(window=pos.window, fingerprint=pos.fingerprint, score=weight)
        self.display.emit(
            Applied(
                window=agg.value.window,
                fingerprint=pos.fingerprint,
                included=bool(mine),
                weight=weight,
                contributors=len(agg.value.manifest),
            )
        )

    def _resynced(self, pos: Position, exc: ProtocolError) -> None:
        self.display.emit(Resynced(window=pos.window, reason=exc.reason, detail=str(exc)))

    # ------------------------------------------------------------------ train
    def train(self, window: int) -> Staged | Skipped:
        """The trainer's window from θ_window and e, then the signed contribution (nothing adopted yet)."""
        if not self._window_open(window):
            return Skipped("window closed before training started")
        job = WindowJob(
            window,
            self.params,
            self.pos.base,
            self.feedback,
            report=self.display.update,
            should_stop=lambda: self._stop,
        )
        work = self.trainer.train(job)
        if isinstance(work, Skipped):
            self.inner_s += work.inner_s
            return work
        self.inner_s += work.stats.inner_s
        t0 = time.perf_counter()
        contribution = Contribution(
            self.spec.hash(), window, self.pos.base, self.spec.codec, dict(work.encoded), dict(work.metadata)
        )
        blob = encode_contribution(contribution, self.identity)
        stats = dataclasses.replace(work.stats, compress_s=work.stats.compress_s + time.perf_counter() - t0)
        return Staged(window, blob, work.encoded, stats, work.feedback_after, work.optimizer_after)

    # ------------------------------------------------------------------ upload
    def upload(self, staged: Staged) -> None:
        """Adopt e′ with the signed bytes (one commit), then put them; a closed window skips it."""
        if not self._window_open(staged.window):
            self._skip(staged.window, Skipped("deadline passed during training", staged.stats.inner_s))
            return
        self._adopt(staged)
        t0 = time.perf_counter()
        outcome, reason = self._put_contribution(staged)
        upload_s = time.perf_counter() - t0
        if outcome != "uploaded":
            self._give_back(staged)
        self.windows_trained += 1
        self.display.update(upload_bytes=len(staged.blob), upload_s=upload_s)
        st = staged.stats
        self.display.emit(
            PeerWindow(
                window=staged.window,
                outcome=outcome,
                reason=reason,
                loss_first=round(st.loss_first, 5),
                loss=round(st.loss_last, 5),
                tokens=st.tokens,
                inner_s=round(st.inner_s, 3),
                compress_s=round(st.compress_s, 3),
                upload_bytes=len(staged.blob),
                upload_s=round(upload_s, 3),
                feedback_norm=round(self.feedback.norm(), 6),
                data_bytes=st.data.fetched_bytes,
                data_hits=st.data.hits,
                data_misses=st.data.misses,
            )
        )
        if self._refused >= self.local.peer.max_upload_failures:
            raise UploadsRefused(self._refused_message(reason))
        if outcome != "uploaded":
            self._wait_window_closed(staged.window)  # retraining the same window would fail alike

    def _refused_message(self, reason: str | None) -> str:
        key = f"{self.run_id}/contrib/<window>/{self.identity.peer_id}"
        return (
            f"the store refused this peer's contribution in {self._refused} consecutive windows "
            f"(last: {reason}) while reading from it works: this peer may not write {key} in "
            f"{self.local.store.location()}. Ask the operator for a credential (or grants) that may write there; "
            "training on without uploading would only hold the run's windows open"
        )

    def _adopt(self, staged: Staged) -> None:
        """e′, the moments and the signed bytes become the peer's state in one commit (write-ahead)."""
        self.feedback = staged.feedback_after
        self.pending = staged
        self._commit(staged.optimizer_after)

    def _give_back(self, staged: Staged) -> None:
        """The staged bytes never reached the store: Δ̂ goes back into e, the contribution is dropped."""
        self.feedback = staged.feedback_after.returned(staged.sent)
        self.pending = None
        self._commit(staged.optimizer_after)

    def _put_contribution(self, staged: Staged) -> tuple[str, str | None]:
        key = layout.contrib_key(self.run_id, staged.window, self.identity.peer_id)
        try:
            # Our own earlier attempt (a restart, a retried put that did land) counts when identical.
            created = self._put_with_retry(key, staged.blob, once=True)
        except ObjectExists:
            return "failed", "a different contribution exists"
        except StoreError as exc:
            self._refused += 1  # AccessDenied, or a store that keeps failing our writes
            return "failed", f"{exc.reason}: {exc}"
        self._refused = 0
        return "uploaded", None if created else "already present"

    def _put_with_retry(self, key: str, data: bytes, *, once: bool = False) -> bool:
        """``store.put``, or with ``once`` :func:`put_once`, retried on store errors other than
        ``ObjectExists``; whether this call created the object."""
        for attempt in range(UPLOAD_RETRIES):
            try:
                if once:
                    return put_once(self.store, key, data)
                self.store.put(key, data)
                return True
            except ObjectExists:
                raise
            except StoreError:
                if attempt == UPLOAD_RETRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("UPLOAD_RETRIES is at least 1")

    def _failed(self, exc: ProtocolError | StoreError) -> None:
        """A window that broke on a store or protocol error: record it (nothing was adopted)."""
        self.display.emit(PeerWindow(window=self.pos.window, outcome="failed", reason=exc.reason, detail=str(exc)))
        self._wait_window_closed(self.pos.window)
        time.sleep(max(self.sync.poll_s, 1.0))  # a persistent fault (a forged aggregate) must not spin

    def _skip(self, window: int, skipped: Skipped) -> None:
        """Record a window with nothing to send; e and the staged state stay as they are."""
        self.display.emit(
            PeerWindow(window=window, outcome="skipped", reason=skipped.reason, inner_s=round(skipped.inner_s, 3))
        )
        self._wait_window_closed(window)

    def _wait_window_closed(self, window: int) -> None:
        """Wait for ``window``'s aggregate, so the next iteration moves on instead of retraining it."""
        try:
            self.sync.wait_until_published(window, base=self._base_of(window), should_stop=lambda: self._stop)
        except StoreError:
            time.sleep(self.sync.poll_s)  # the store is failing too: the loop retries and records it

    def _base_of(self, window: int) -> str | None:
        """The base an aggregate of ``window`` must chain onto, when this peer knows it."""
        return self.pos.base if window == self.pos.window else None

    def _window_open(self, window: int) -> bool:
        if self.sync.aggregate_published(window, self._base_of(window)):
            return False
        if self.pos.opened_at is None or window != self.pos.window:
            return True
        return time.time() < upload_deadline(self.pos.opened_at, self.spec.windows)

    # ------------------------------------------------------------------ state
    def _commit(self, optimizer: Mapping[str, Any], *, tensors_unchanged: bool = False) -> None:
        """Write the peer's state: position, e, ``optimizer`` and the staged contribution, atomically.

        θ is not stored: a restart re-derives it from the store's checkpoint and aggregates.
        """
        pending = self.pending
        self.state.save(
            Snapshot(
                run_hash=self.spec.hash(),
                window=self.pos.window,
                base=self.pos.base,
                fingerprint=self.pos.fingerprint,
                feedback=self.feedback.state_dict(),
                optimizer=optimizer,
                pending=pending.window if pending else None,
                pending_blob=pending.blob if pending else None,
            ),
            tensors_unchanged=tensors_unchanged,
        )
