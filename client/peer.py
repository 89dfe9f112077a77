"""The peer: join a run, then train, compress, sign and upload one contribution per window.

    trainer = FullReplica(spec, data_key=identity.peer_id, device="cuda")   # or a pipeline StageTrainer
    peer = Peer(spec, store, identity, LocalState(dir), trainer, local=settings, display=PeerDisplay())
    peer.run(until_window=20)          # returns when θ opens window 20 (or on stop())

One iteration, as :meth:`Peer.run` reads it, for the next window t to train::

    catch_up    apply every published aggregate (verify, fingerprint check, resync on mismatch);
                wait only while θ is further behind t than the schedule allows (below)
    train       the trainer's H steps from the newest θ (θ_t, or θ_t−1 while aggregate t−1 is in
                flight), then Δ folded into e: Δ̂, e ← compress(e, Δ) in place; sign Δ̂
    upload      commit e and the signed bytes, then put contrib/<t>/<peer> — both on the background
                lane (client/lane.py) while the next window trains

**Overlap** (``outer.delay = 1``, the default): a peer does not wait for the aggregate of the window
it just sent. It trains window t while the validator gathers, scores and publishes window t−1,
starting from the newest θ it holds, θ_t−1. Between inner steps it looks for aggregate t−1; when it
is published the peer applies it to θ (bit-identical with everyone, as always: θ changes only by
signed aggregates) and moves its working model by the same step, and trains on; Δ is then taken
against θ_t and the contribution's ``base`` is aggregate t−1, as on the synchronous schedule. Once
``outer.overlap`` of the window's inner steps are done without it, the peer waits for it there
(bounding how much of a window is trained from the older θ; ``overlap = 1.0`` never waits, and a
window that ends first is sent with Δ against θ_t−1 and ``base`` one aggregate old, which the
validator applies to θ_t one window late). With ``outer.eager`` (the default) the working model
starts from θ_t−1 − α·Δ̄′ instead, Δ̄′ being aggregate t−1 as forecast from the window's
contributions already in the store, refreshed between steps (:mod:`client.forecast`); when the
validator accepts the same contributions the forecast is the aggregate, bit for bit, and its
arrival moves nothing. Δ is formed against θ as it stands at the fold, tensor by tensor, before
any later aggregate is applied (so θ is never held twice). A contribution is uploaded as soon as it
is staged, also before its window opens: the validator lists ``contrib/<t>/`` when it opens window t
and finds it there. A fresh peer that finds no genesis yet trains window 0 from θ₀ (a pure function
of the RunSpec) while it waits. With ``outer.delay = 0``, and for a trainer that cannot move its
working model mid-window (a pipeline stage), the peer waits for aggregate t−1 before it trains
window t.

How the peer trains is a :class:`~client.window.WindowTrainer` it holds: the whole model
(:class:`client.replica.FullReplica`) or one stage of a pipeline replica
(:class:`client.pipeline.trainer.StageTrainer`). Either returns the window's work as a value
(:class:`~client.window.Trained` or :class:`~client.window.Skipped`) and changes nothing the peer
owns; the peer decides what takes effect.

Memory. A full replica holds five copies of θ's size in steady state, host and device together:
the working model, θ (the base Δ is formed against), e and the two AdamW moments (plus the
gradients while it trains). Δ is never held whole (``Trained.fold`` forms it tensor by tensor into
e), e exists once (folded and given back in place), and the state directory is written tensor by
tensor (:mod:`client.state`).

Error feedback across failures. e changes only when a contribution is staged: the window's Δ is
folded into e once the peer knows it will send the window, and that e is committed with the signed
bytes before they are put (write-ahead), so a restart re-uploads exactly those bytes with exactly
that e.

* A window whose deadline passes before its Δ is folded into e (slow hardware, a stalled store, a
  pipeline stage that lost its group) is *skipped*: nothing was adopted, e keeps its pre-window
  value, and the window's Δ never enters e (it was computed against a θ the swarm moved past).
* A staged contribution whose put fails for good gives its Δ̂ back: e ← e′ + decode(Δ̂), which is
  β·e + Δ up to float rounding, i.e. what error feedback keeps when nothing is sent. The rule needs
  only what the commit holds (the staged bytes are Δ̂), so it applies unchanged to an upload
  resumed after a restart; restoring the pre-window e instead would need a second copy of e in the
  state directory. Either way e never loses mass that was not sent.
* A staged contribution that reached the store but is rejected or late, or whose window closed
  while the peer was down, loses its Δ̂ exactly as in production SparseLoCo: e already had it
  subtracted, and it may well have been sent.
* A restart in the middle of an overlapped window (the next window training while the last one's
  commit and put run on the lane) resumes from the last commit: a contribution staged there is
  re-put if its window is still open, a window that was training is trained again, and e is the
  one committed with the last staged contribution, never a half-folded one (e changes only on the
  main thread, after the lane has drained).

The inner optimizer's moments and step keep what training did, also in a skipped window: they
describe the local loss surface and carry nothing the swarm sees, and rolling them back would cost
a copy of the optimizer state (2× the parameters) every window. They reach the state directory
every ``peer.moments_every`` windows and when the peer stops (the step, which indexes the
learning-rate schedule, with every commit); a restart resumes the moments last written
(:mod:`client.state`).

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
import functools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from client.forecast import Forecast, same_delta
from client.lane import Lane
from client.metered import MeteredStore
from client.progress import PeerDisplay
from client.state import LocalState, Snapshot, detached
from client.sync import Position, Sync
from client.window import Skipped, Trained, WindowJob, WindowStats, WindowTrainer
from protocol import layout
from protocol.aggregate import SparseDict
from protocol.chain import delta_of
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
from protocol.feedback import FeedbackBuffers
from protocol.identity import Identity
from protocol.outcomes import PeerOutcome, read_outcomes, verdict
from protocol.replay import initial_params
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
_log = logging.getLogger(__name__)


class RunNotFound(ReasonedError):
    """No signed genesis checkpoint of this peer's run hash appeared within ``peer.join_timeout_s``."""

    reason = "run_not_found"


class UploadsRefused(ReasonedError):
    """The store refused ``peer.max_upload_failures`` consecutive contributions of this peer."""

    reason = "uploads_refused"


@dataclass(frozen=True)
class Staged:
    """A window's signed contribution, staged: e already holds its fold.

    ``sent``: the Δ̂ inside ``blob`` (given back to e if the bytes never reach the store).
    ``optimizer_after``: the trainer's state after the window (see :class:`client.window.Trained`).
    ``trained_from``: the window θ opened when training started (``window``, or ``window − 1``
    while that aggregate was in flight).
    """

    window: int
    blob: bytes
    sent: Mapping[str, Encoded]
    stats: WindowStats
    optimizer_after: Mapping[str, Any]
    trained_from: int


@dataclass(frozen=True)
class _Upload:
    """A staged contribution on the lane: its commit, then its put ((outcome, reason, seconds))."""

    staged: Staged
    put: Future[tuple[str, str | None, bool, float]]  # outcome, reason, refused by the store, seconds


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
        self.spec, self.identity, self.state = spec, identity, state
        self.store = MeteredStore(store)  # what this peer downloads, reported per window
        self.trainer = trainer
        self.local = local or LocalSettings()
        self.display = display or PeerDisplay(json_lines=True)
        self.run_id = layout.run_id(spec.hash())
        self.sync = Sync(spec, self.store, poll_interval_s=self.local.poll_interval_s)
        self.feedback = FeedbackBuffers()  # e, in place; changed only on this thread (module doc)
        self.params: dict[str, Tensor] = {}  # θ master copy: CPU float32, changed only by Sync
        self.pos = Position(0, "", "")
        self.pending: Staged | None = None  # staged, not yet known to be aggregated
        self.lane = Lane()  # commits and puts, in order, off the training thread
        self._upload: _Upload | None = None  # the last staged contribution, until its put is reported
        self._last_trained = -1  # the last window trained, skipped or failed here: the next one follows it
        self._moments_at: int | None = None  # the window whose commit last wrote the moments
        self._moments_step = -1  # the trainer's step then (moments newer than that are unsaved)
        self._downloaded = 0  # store bytes read when the last window was reported
        self._arrived_at: int | None = None  # inner steps taken when θ came to open the window in training
        self._abandoned = False  # θ was rebuilt from a checkpoint mid-window: the window is lost
        self._stand_in: SparseDict = {}  # what of the forecast the working model holds (outer.eager)
        self._forecast: Forecast | None = None
        self._refreshed = 0.0  # monotonic time of the forecast's last refresh
        self._early: Trained | None = None  # window 0, trained from θ₀ while genesis was not out yet
        self._last_manifest: frozenset[str] | None = None  # the peers of the last aggregate applied
        self._previous_base = ""  # the base of the window before θ's (what aggregate pos.window−1 built on)
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
            try:
                self.join()
                while not self._done(until_window, max_windows):
                    window, need = self._plan(until_window, max_windows)
                    try:
                        self.catch_up(need)  # apply what is published; wait while θ is too far behind
                        window, need = self._plan(until_window, max_windows)
                        if window is None or self.pos.window < need or self._diverged or self._stop:
                            continue
                        work = self.train(window)  # H steps → Δ folded into e → signed Δ̂, or a skip
                        if isinstance(work, Staged):
                            self.upload(work)  # commit e with the bytes, then put: on the lane
                        else:
                            self._skip(window, work)
                    except (ProtocolError, StoreError) as exc:
                        self._failed(self.pos.window if window is None else window, exc)
            finally:
                self._finish()  # the lane's last commit and put, and the moments, before leaving
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

    def _plan(self, until_window: int | None, max_windows: int | None) -> tuple[int | None, int]:
        """(the window to train next, or None when there is none left; the window θ must open
        before the peer goes on): the window after the last one trained here, never one already
        closed, trained once θ is at most ``outer.delay`` aggregates behind it."""
        window = max(self._last_trained + 1, self.pos.window)
        if max_windows is not None and self.windows_trained >= max_windows:
            return None, self.pending.window + 1 if self.pending else self.pos.window
        if until_window is not None and window >= until_window:
            return None, until_window
        return window, window - 1 if self._overlaps() else window

    def _overlap_steps(self) -> int:
        """Inner steps a window may take before θ holds the aggregate that opens it."""
        return self.spec.outer.overlap_steps(self.spec.inner.steps)

    def flush(self) -> None:
        """Wait for the lane (commits, the last put) and report what it did."""
        self._reap(block=True)

    def _finish(self) -> None:
        """Leaving: the lane's work done and reported, and the moments written if they moved."""
        self.flush()
        if self.trainer.step != self._moments_step and self.pos.fingerprint:
            self._commit(feedback=False, moments=True)
            self.lane.drain()

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
            self.feedback = FeedbackBuffers.from_state_dict(snap.feedback)
            if snap.optimizer is not None:
                self.trainer.load_state_dict(snap.optimizer)
            self._moments_at, self._moments_step = self.state.moments_window(), self.trainer.step
            self._last_trained = snap.pending if snap.pending is not None else snap.window - 1
        self.pos = self._wait_for_genesis(early=snap is None)
        if snap is not None and snap.pending is not None and snap.pending >= self.pos.window and snap.pending_blob:
            self._resume_pending(snap.pending, snap.pending_blob)
        self.flush()
        self.display.update(peer_id=self.identity.peer_id, window=self.pos.window, fingerprint=self.pos.fingerprint)
        self.display.emit(
            Joined(
                peer_id=self.identity.peer_id,
                window=self.pos.window,
                fingerprint=self.pos.fingerprint,
                replayed_from=self._checkpoint_window,
                resumed=snap is not None,
                resumed_window=snap.window if snap else None,
                staged_window=snap.pending if snap else None,
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

    def _wait_for_genesis(self, *, early: bool) -> Position:
        """Newest checkpoint (waiting for genesis if the validator is not up yet, at most
        ``peer.join_timeout_s``), then replay. With ``early`` (a fresh peer) and the overlapped
        schedule, the wait for genesis trains window 0 (:meth:`_train_before_genesis`)."""
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
            if early and self._overlaps():
                early = False  # one window, once
                self._early = self._train_before_genesis(deadline=start + timeout)
                continue
            self.display.update(phase="waiting for genesis")
            time.sleep(self.sync.poll_s)
        self._checkpoint_window = pos.window
        return self.sync.advance(self.params, pos, on_apply=self._applied, on_resync=self._resynced)

    def _overlaps(self) -> bool:
        """Whether this peer trains a window before θ opens it (``outer.delay = 1``, a trainer that
        can take the aggregate mid-window, ``outer.overlap`` > 0)."""
        return self.spec.outer.delay == 1 and self.trainer.shifts and self._overlap_steps() > 0

    def _train_before_genesis(self, *, deadline: float) -> Trained | None:
        """Window 0 from θ₀ while the validator has not published genesis yet: θ₀ is a pure function
        of the RunSpec, and only the base (the genesis manifest's digest) is unknown, which is
        signed only at the fold. The work is used if genesis turns out to open window 0 of this θ₀
        (:meth:`train`), dropped otherwise; it stops at the join deadline."""
        self.params.clear()  # resync replaces these tensors in place by the checked θ₀
        self.params.update(initial_params(self.spec.model))
        job = WindowJob(
            0,
            self.params,
            "",
            self.feedback.view(),
            report=self.display.update,
            should_stop=lambda: self._stop or time.monotonic() >= deadline,
            alpha=self.spec.outer.alpha,
        )
        work = self.trainer.train(job)
        self.inner_s += work.stats.inner_s if isinstance(work, Trained) else work.inner_s
        return work if isinstance(work, Trained) else None

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
        contribution = self._read_own(blob)
        trained_from = self.pos.window if contribution.base == self.pos.base else self.pos.window - 1
        staged = Staged(window, blob, dict(contribution.tensors), unknown, self.trainer.state_dict(), trained_from)
        self.pending = staged
        outcome, reason, refused = self._put_contribution(staged)
        self._refused += refused
        if outcome != "uploaded":
            self._give_back(staged)
        self.display.emit(ResumedUpload(window=window, outcome=outcome, reason=reason))

    def _read_own(self, blob: bytes) -> Contribution:
        """Our own staged contribution, read back from its signed bytes."""
        try:
            return decode_contribution(blob, run_hash=self.spec.hash(), max_bytes=len(blob)).value
        except ProtocolError as exc:
            raise ConfigError(f"the contribution staged in {self.state.root} is unreadable: {exc}") from exc

    # ------------------------------------------------------------------ catch-up
    def catch_up(self, need: int) -> None:
        """Apply every published aggregate; while θ opens a window before ``need``, wait for the
        next one (our last upload is reported first: it may be what that window waits for)."""
        before = self.pos.window
        try:
            if self._diverged:
                self.pos = self.sync.bootstrap(self.params, on_apply=self._applied)
                self._diverged = False
            else:
                self.pos = self.sync.advance(self.params, self.pos, on_apply=self._applied, on_resync=self._resynced)
            if self.pos.window < need:
                self._wait_for_aggregate()
                self.pos = self.sync.advance(self.params, self.pos, on_apply=self._applied, on_resync=self._resynced)
        except (ProtocolError, StoreError) as exc:
            self._sync_failed(exc)
            if not self._diverged:
                self._moved(before)  # what was applied before the store failed stands
            time.sleep(max(self.sync.poll_s, 1.0))  # a persistent fault must not spin
            return
        self._moved(before)

    def _wait_for_aggregate(self) -> None:
        """Until the aggregate that follows θ is published; our last upload is reported first (it
        may be what that window waits for)."""
        self.flush()
        self.display.update(phase="waiting for aggregate")
        self.sync.wait_until_published(self.pos.window, base=self.pos.base, should_stop=lambda: self._stop)

    def _sync_failed(self, exc: ProtocolError | StoreError) -> None:
        """A bad object or a failing store: record it. After a bad object θ may be half-updated,
        so it is rebuilt from the newest checkpoint on the next try. A store that fails between
        aggregates (unreachable, a grant server down) leaves θ at the last aggregate applied, and
        :meth:`_applied` moved the position with it: the next try goes on from there."""
        self.display.emit(SyncFailed(window=self.pos.window, reason=exc.reason, detail=str(exc)))
        if isinstance(exc, ProtocolError):
            self._diverged = True

    def _moved(self, before: int) -> None:
        """θ moved from window ``before``: drop a staged contribution that is aggregated now, and
        commit the position."""
        if self.pending is not None and self.pending.window < self.pos.window:
            self.pending = None
        if self.pos.window != before:
            self._commit(feedback=False)  # only the position (and the dropped staged bytes) moved

    def _between_steps(self, window: int, done: int) -> list[tuple[SparseDict, float]]:
        """Between inner steps of ``window``: report the lane's last put, and while θ lacks the
        aggregate that opens the window, apply it as soon as it is published (waiting for it once
        ``outer.overlap`` of the window is trained) or refresh its forecast. Returns how the
        working model moves (client/window.py)."""
        self._reap()
        if self.pos.window >= window or self._abandoned:
            return []
        alpha = self.spec.outer.alpha
        arrived = self._advance_in_window()
        cap = self._overlap_steps()
        if not arrived and self.pos.window < window and done >= cap < self.spec.inner.steps:  # 1.0: never waits
            self._wait_for_aggregate()
            arrived = self._advance_in_window()
        if arrived:
            exact = len(arrived) == 1 and same_delta(arrived[0], self._stand_in)
            moves = [] if exact else [(self._stand_in, -alpha), *((d, alpha) for d in arrived)]
            self._stand_in, self._forecast, self._arrived_at = {}, None, done
            return moves
        forecast = self._forecast
        if forecast is None or time.monotonic() - self._refreshed < self.sync.poll_s:
            return []
        self._refreshed = time.monotonic()
        if not forecast.refresh():
            return []
        old, self._stand_in = self._stand_in, forecast.delta
        return [(old, -alpha), (self._stand_in, alpha)]

    def _start_forecast(self, window: int) -> None:
        """``outer.eager``: the forecast of the aggregate θ lacks to open ``window`` (client/forecast.py)."""
        self._stand_in, self._forecast = {}, None
        if not self.spec.outer.eager or self.pos.window != window - 1:
            return
        staged = self.pending
        own = (self.identity.peer_id, staged.sent) if staged is not None and staged.window == window - 1 else None
        trusted = None if self._last_manifest is None else self._last_manifest | {self.identity.peer_id}
        bases = {self.pos.base, self._previous_base} - {""}
        self._forecast = Forecast(self.spec, self.store, window=window - 1, bases=bases, trusted=trusted, own=own)
        self._forecast.refresh()
        self._refreshed = time.monotonic()
        self._stand_in = self._forecast.delta

    def _advance_in_window(self) -> list[SparseDict]:
        """Apply what is published to θ mid-window; the Δ̄ applied (none when θ had to be rebuilt
        from a checkpoint: the working model cannot follow, and the window is abandoned)."""
        applied: list[SparseDict] = []
        before = self.pos.window

        def on_apply(agg: Verified[Aggregate], pos: Position) -> None:
            applied.append(delta_of(agg.value))
            self._applied(agg, pos)

        def on_resync(pos: Position, exc: ProtocolError) -> None:
            self._abandoned = True
            self._resynced(pos, exc)

        try:
            self.pos = self.sync.advance(self.params, self.pos, on_apply=on_apply, on_resync=on_resync)
        except (ProtocolError, StoreError) as exc:
            self._sync_failed(exc)
            self._abandoned = True
            return []
        self._moved(before)
        return [] if self._abandoned else applied

    def _applied(self, agg: Verified[Aggregate], pos: Position) -> None:
        """θ holds aggregate ``agg`` now: keep the position with it (a failure after it does not
        undo it) and report it (the fingerprint of θ after it, whether our contribution is in it)."""
        self.pos = pos
        mine = [m for m in agg.value.manifest if m.peer_id == self.identity.peer_id]
        weight = mine[0].weight if mine else None
        contributed = bool(mine) or (self.pending is not None and self.pending.window == agg.value.window)
        reported = verdict(self._outcome(agg) if contributed else None)
        self._last_manifest = frozenset(m.peer_id for m in agg.value.manifest)
        self._previous_base = agg.value.base
        self.state.record(
            {
                "window": agg.value.window,
                "fingerprint": pos.fingerprint,
                "aggregate": agg.digest,
                "included": bool(mine),
                "weight": weight,
                **reported,
                "time": round(time.time(), 3),
            }
        )
        self.display.update(window=pos.window, fingerprint=pos.fingerprint)
        self.display.emit(
            Applied(
                window=agg.value.window,
                fingerprint=pos.fingerprint,
                included=bool(mine),
                weight=weight,
                contributors=len(agg.value.manifest),
                **reported,
            )
        )

    def _outcome(self, agg: Verified[Aggregate]) -> PeerOutcome | None:
        """What the validator decided about our contribution to ``agg``'s window (its published
        outcomes); None when it names none. Unreadable outcomes are logged, never fatal: θ and
        the chain do not depend on them."""
        try:
            table = read_outcomes(self.store, self.run_id, agg)
        except (ProtocolError, StoreError) as exc:
            _log.warning("outcomes of window %d unreadable: %s", agg.value.window, exc)
            return None
        return table.get(self.identity.peer_id) if table is not None else None

    def _resynced(self, pos: Position, exc: ProtocolError) -> None:
        self.display.emit(Resynced(window=pos.window, reason=exc.reason, detail=str(exc)))

    # ------------------------------------------------------------------ train
    def train(self, window: int) -> Staged | Skipped:
        """The trainer's window from the newest θ, then its Δ folded into e and the signed
        contribution (staged by :meth:`upload`). θ does not change in between."""
        early, self._early = self._early, None
        if not self._window_open(window):
            return Skipped("window closed before training started")
        if early is not None and window == 0 == self.pos.window:  # trained while genesis was not out yet
            self._stand_in, self._arrived_at = {}, 0
            return self._fold(window, early, trained_from=0)
        trained_from = self.pos.window
        self._arrived_at = 0 if trained_from >= window else None
        self._abandoned = False
        self._start_forecast(window)
        job = WindowJob(
            window,
            self.params,
            self.pos.base,
            self.feedback.view(),
            report=self.display.update,
            should_stop=lambda: self._stop or self._abandoned,
            stand_in=self._stand_in,
            alpha=self.spec.outer.alpha,
            between_steps=functools.partial(self._between_steps, window),
        )
        work = self.trainer.train(job)
        if isinstance(work, Skipped):
            self.inner_s += work.inner_s
            if self._abandoned:
                return Skipped("θ was rebuilt from a checkpoint during the window", work.inner_s)
            return work
        self.inner_s += work.stats.inner_s
        if not self._window_open(window):  # nothing of it reaches e
            return Skipped("deadline passed during training", work.stats.inner_s)
        stale = self.spec.inner.steps if self._arrived_at is None else self._arrived_at
        return self._fold(
            window, dataclasses.replace(work, stats=dataclasses.replace(work.stats, stale_steps=stale)), trained_from
        )

    def _fold(self, window: int, work: Trained, trained_from: int) -> Staged:
        """e ← compress(e, Δ) in place and the signed contribution; the lane drains first (its
        commits read e, and the last put's outcome may give Δ̂ back to it)."""
        self.flush()
        t0 = time.perf_counter()
        encoded = work.fold(self.feedback, self._stand_in)
        contribution = Contribution(
            self.spec.hash(), window, self.pos.base, self.spec.codec, dict(encoded), dict(work.metadata)
        )
        blob = encode_contribution(contribution, self.identity)
        stats = dataclasses.replace(work.stats, compress_s=work.stats.compress_s + time.perf_counter() - t0)
        return Staged(window, blob, encoded, stats, work.optimizer_after, trained_from)

    # ------------------------------------------------------------------ upload
    def upload(self, staged: Staged) -> None:
        """Adopt the staged contribution (one commit with e), then put it; both on the lane."""
        saved = self._adopt(staged)

        def put() -> tuple[str, str | None, bool, float]:
            saved.result()  # write-ahead: a commit that failed means the bytes are never put
            t0 = time.perf_counter()
            outcome, reason, refused = self._put_contribution(staged)
            return outcome, reason, refused, time.perf_counter() - t0

        self._upload = _Upload(staged, self.lane.submit(put))
        self.display.update(phase="uploading")

    def _adopt(self, staged: Staged) -> Future[None]:
        """The signed bytes become the peer's staged contribution, committed with e (write-ahead);
        with the moments every ``peer.moments_every`` windows, and then the commit is waited for
        (training changes the moments in place)."""
        self.pending = staged
        self.windows_trained += 1
        self._last_trained = max(self._last_trained, staged.window)
        every = self.local.peer.moments_every
        moments = self._moments_at is None or staged.window - self._moments_at >= every
        saved = self._commit(feedback=True, moments=moments, optimizer=staged.optimizer_after)
        if moments:
            saved.result()
            self._moments_at, self._moments_step = staged.window, self.trainer.step
        return saved

    def _reap(self, block: bool = False) -> None:
        """Report the last put once it is done (``block``: wait for it and every commit), give Δ̂
        back to e if it failed; on the main thread only, between inner steps and before e changes."""
        upload = self._upload
        if upload is not None and (block or upload.put.done()):
            self._upload = None
            self._reported(upload.staged, *upload.put.result())
        if block:
            self.lane.drain()

    def _reported(self, staged: Staged, outcome: str, reason: str | None, refused: bool, upload_s: float) -> None:
        """The put of ``staged`` ended: count a refusal, give Δ̂ back if it failed, report it."""
        if outcome == "uploaded":
            self._refused = 0
        elif refused:
            self._refused += 1  # AccessDenied, or a store that keeps failing our writes
        if outcome != "uploaded":
            self._give_back(staged)
        read = self.store.bytes_read
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
                trained_from=staged.trained_from,
                stale_steps=st.stale_steps,
                download_bytes=read - self._downloaded + st.data.fetched_bytes,  # the data feed reads on its own
                data_bytes=st.data.fetched_bytes,
                data_hits=st.data.hits,
                data_misses=st.data.misses,
            )
        )
        self._downloaded = read
        if self._refused >= self.local.peer.max_upload_failures:
            raise UploadsRefused(self._refused_message(reason))

    def _refused_message(self, reason: str | None) -> str:
        key = f"{self.run_id}/contrib/<window>/{self.identity.peer_id}"
        return (
            f"the store refused this peer's contribution in {self._refused} consecutive windows "
            f"(last: {reason}) while reading from it works: this peer may not write {key} in "
            f"{self.local.store.location()}. Ask the operator for a credential (or grants) that may write there; "
            "training on without uploading would only hold the run's windows open"
        )

    def _give_back(self, staged: Staged) -> None:
        """The staged bytes never reached the store: Δ̂ goes back into e, the contribution is dropped."""
        self.lane.drain()  # no commit may be reading e while it changes
        self.feedback.give_back(staged.sent)
        if self.pending is staged:
            self.pending = None
        self._commit(feedback=True)

    def _put_contribution(self, staged: Staged) -> tuple[str, str | None, bool]:
        """(outcome, reason, whether the store refused it); safe on the lane (touches no state)."""
        key = layout.contrib_key(self.run_id, staged.window, self.identity.peer_id)
        try:
            # Our own earlier attempt (a restart, a retried put that did land) counts when identical.
            created = self._put_with_retry(key, staged.blob, once=True)
        except ObjectExists:
            return "failed", "a different contribution exists", False
        except StoreError as exc:
            return "failed", f"{exc.reason}: {exc}", True
        return "uploaded", None if created else "already present", False

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

    def _failed(self, window: int, exc: ProtocolError | StoreError) -> None:
        """A window that broke on a store or protocol error: record it (nothing was adopted) and
        move on to the next one."""
        self._last_trained = max(self._last_trained, window)
        self.display.emit(PeerWindow(window=window, outcome="failed", reason=exc.reason, detail=str(exc)))
        time.sleep(max(self.sync.poll_s, 1.0))  # a persistent fault (a forged aggregate) must not spin

    def _skip(self, window: int, skipped: Skipped) -> None:
        """Record a window with nothing to send; e and the staged state stay as they are."""
        self._last_trained = max(self._last_trained, window)
        self.display.emit(
            PeerWindow(window=window, outcome="skipped", reason=skipped.reason, inner_s=round(skipped.inner_s, 3))
        )

    def _base_of(self, window: int) -> str | None:
        """The base an aggregate of ``window`` must chain onto, when this peer knows it."""
        return self.pos.base if window == self.pos.window else None

    def _window_open(self, window: int) -> bool:
        """Whether a contribution for ``window`` may still count: its aggregate is not published,
        and, for the window θ opens, its deadline has not passed (a window that has not opened yet,
        the next one while the last aggregate is in flight, has no deadline yet)."""
        if self.sync.aggregate_published(window, self._base_of(window)):
            return False
        if self.pos.opened_at is None or window != self.pos.window:
            return True
        return time.time() < upload_deadline(self.pos.opened_at, self.spec.windows)

    # ------------------------------------------------------------------ state
    def _commit(
        self, *, feedback: bool, moments: bool = False, optimizer: Mapping[str, Any] | None = None
    ) -> Future[None]:
        """Queue a commit of the peer's state on the lane: position, the staged contribution, the
        optimizer's scalars, and e (``feedback``) and the moments (``moments``) when asked.

        θ is not stored: a restart re-derives it from the store's checkpoint and aggregates.
        """
        pending = self.pending
        snap = Snapshot(
            run_hash=self.spec.hash(),
            window=self.pos.window,
            base=self.pos.base,
            fingerprint=self.pos.fingerprint,
            feedback=self.feedback.state_dict(),
            # The structure is copied here (not the tensors): the lane reads it while training goes on.
            optimizer=detached(self.trainer.state_dict() if optimizer is None else optimizer),
            pending=pending.window if pending else None,
            pending_blob=pending.blob if pending else None,
        )
        return self.lane.submit(self.state.save, snap, feedback=feedback, moments=moments)
