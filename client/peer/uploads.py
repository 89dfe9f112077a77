"""The peer's uploads: staged contributions committed with e, then put, on the background lane.

:class:`Uploads` owns e (the error-feedback buffer), the staged contribution not yet known to be
aggregated, the lane (:mod:`client.lane`) its commits and puts run on, the count of puts the store
refused, and when the inner optimizer's moments were last written::

    uploads.upload(staged)      # commit e with the signed bytes (write-ahead), then put: on the lane
    uploads.reap()              # between inner steps: the last put, once done, reported
    uploads.flush()             # the lane drained and its last put reported

A put is retried until the window's upload deadline and not started when the measured uplink
cannot make it (:func:`client.uplink.put_by_deadline`; the rate is this peer's own completed puts).
It ends as one :class:`PutOutcome` (uploaded; skipped or failed with a reason; whether the store
refused the write; how long it took, in how many attempts, how long the link was down), logged as
one line per window. One that was not uploaded gives its Δ̂ back to e (e ← e′ + decode(Δ̂)); each is
reported as a :class:`~protocol.events.PeerWindow` event, and ``peer.max_upload_failures``
refusals in a row stop the peer (:class:`UploadsRefused`). e changes only on the main thread, after
the lane has drained (:mod:`client.peer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from client.lane import Lane
from client.peer.context import PeerContext
from client.state import Snapshot, detached
from client.uplink import LinkRate, Sent, put_by_deadline
from client.window import WindowStats
from protocol import layout
from protocol.codec import Encoded
from protocol.errors import ConfigError, ObjectExists, ProtocolError, ReasonedError, StoreError
from protocol.events import PeerWindow, ResumedUpload
from protocol.feedback import FeedbackBuffers
from protocol.store.base import ObjectStore, put_once
from protocol.wire import Contribution, decode_contribution

if TYPE_CHECKING:
    from client.peer.position import Theta

__all__ = ["UPLOAD_RETRIES", "PutOutcome", "Staged", "Uploads", "UploadsRefused", "put_with_retry"]

log = logging.getLogger(__name__)

UPLOAD_RETRIES = 3  # announcements and withdrawals (put_with_retry); contributions retry until their deadline

PutOutcome = Sent
"""How the put of a staged contribution ended (:class:`client.uplink.Sent`)."""


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
    """A staged contribution on the lane: its commit, then its put."""

    staged: Staged
    put: Future[PutOutcome]


def put_with_retry(store: ObjectStore, key: str, data: bytes, *, once: bool = False) -> bool:
    """``store.put``, or with ``once`` :func:`put_once`, retried on store errors other than
    ``ObjectExists``; whether this call created the object."""
    for attempt in range(UPLOAD_RETRIES):
        try:
            if once:
                return put_once(store, key, data)
            store.put(key, data)
            return True
        except ObjectExists:
            raise
        except StoreError:
            if attempt == UPLOAD_RETRIES - 1:
                raise
            time.sleep(0.2 * 2**attempt)
    raise AssertionError("UPLOAD_RETRIES is at least 1")


class Uploads:
    """e, the staged contribution and the lane that commits and puts it (module docstring)."""

    def __init__(self, ctx: PeerContext, theta: Theta) -> None:
        self.ctx, self.theta = ctx, theta
        self.feedback = FeedbackBuffers()  # e, in place; changed only on the main thread
        self.pending: Staged | None = None  # staged, not yet known to be aggregated
        self.lane = Lane()  # commits and puts, in order, off the training thread
        self._upload: _Upload | None = None  # the last staged contribution, until its put is reported
        self._refused = 0  # consecutive contributions the store refused
        self._moments_at: int | None = None  # the window whose commit last wrote the moments
        self._moments_step = -1  # the trainer's step then (moments newer than that are unsaved)
        self._downloaded = 0  # store bytes read when the last window was reported
        self._wire = (0, 0)  # the store's socket bytes (sent, received) when the last window was reported
        self.rate = LinkRate()  # the uplink, measured by this peer's puts (used on the lane only)
        self._requested: dict[str, int] = {}  # requests sent to the bucket by then, by kind

    def restore(self, snap: Snapshot) -> None:
        """A restart: e, the inner optimizer and the moments' window as the state directory holds them."""
        self.feedback = FeedbackBuffers.from_state_dict(snap.feedback)
        if snap.optimizer is not None:
            self.ctx.trainer.load_state_dict(snap.optimizer)
        self._moments_at, self._moments_step = self.ctx.state.moments_window(), self.ctx.trainer.step

    # ------------------------------------------------------------------ staging and putting
    def upload(self, staged: Staged) -> None:
        """Adopt the staged contribution (one commit with e), then put it; both on the lane."""
        saved = self.adopt(staged)

        def put() -> PutOutcome:
            saved.result()  # write-ahead: a commit that failed means the bytes are never put
            return self.put_contribution(staged)

        self._upload = _Upload(staged, self.lane.submit(put))
        self.ctx.display.update(phase="uploading")

    def adopt(self, staged: Staged) -> Future[None]:
        """The signed bytes become the peer's staged contribution, committed with e (write-ahead);
        with the moments every ``peer.moments_every`` windows, and then the commit is waited for
        (training changes the moments in place)."""
        self.pending = staged
        every = self.ctx.local.peer.moments_every
        moments = self._moments_at is None or staged.window - self._moments_at >= every
        saved = self.commit(feedback=True, moments=moments, optimizer=staged.optimizer_after)
        if moments:
            saved.result()
            self._moments_at, self._moments_step = staged.window, self.ctx.trainer.step
        return saved

    def put_contribution(self, staged: Staged) -> PutOutcome:
        """Put the staged bytes until the window's upload deadline (safe on the lane: it touches
        only the link's rate). Our own earlier attempt (a restart, a retried put whose answer was
        lost) counts when its bytes are identical."""
        key = layout.contrib_key(self.ctx.run_id, staged.window, self.ctx.identity.peer_id)
        # Until the window opens its deadline is unknown; it is at least the deadline's length away.
        bound = time.time() + self.ctx.spec.windows.upload_deadline_s

        def deadline_at() -> float:
            at = self.theta.deadline(staged.window)
            return bound if at is None else at

        stop = self.ctx.stop  # a peer that leaves stops retrying (its wait between attempts ends at once)
        return put_by_deadline(
            self.ctx.store,
            key,
            staged.blob,
            deadline_at=deadline_at,
            rate=self.rate,
            sleep=stop.wait,
            stopping=stop.is_set,
        )

    def resume(self, window: int, blob: bytes) -> None:
        """A contribution staged before a restart (e and the moments were restored with it):
        upload it if its window is still open."""
        if not self.theta.window_open(window):
            return  # like a late upload: its Δ̂ may have been sent before the restart
        unknown = WindowStats(float("nan"), float("nan"), 0, 0.0, 0.0)
        contribution = self._read_own(blob)
        pos = self.theta.pos
        trained_from = pos.window if contribution.base == pos.base else pos.window - 1
        staged = Staged(window, blob, dict(contribution.tensors), unknown, self.ctx.trainer.state_dict(), trained_from)
        self.pending = staged
        outcome = self.put_contribution(staged)
        self._refused += outcome.refused
        if not outcome.uploaded:
            self._give_back(staged)
        self.ctx.display.emit(ResumedUpload(window=window, outcome=outcome.outcome, reason=outcome.reason))

    def _read_own(self, blob: bytes) -> Contribution:
        """Our own staged contribution, read back from its signed bytes."""
        try:
            return decode_contribution(blob, run_hash=self.ctx.spec.hash(), max_bytes=len(blob)).value
        except ProtocolError as exc:
            raise ConfigError(f"the contribution staged in {self.ctx.state.root} is unreadable: {exc}") from exc

    # ------------------------------------------------------------------ outcomes
    def reap(self, block: bool = False) -> None:
        """Report the last put once it is done (``block``: wait for it and every commit), give Δ̂
        back to e if it failed; on the main thread only, between inner steps and before e changes."""
        upload = self._upload
        if upload is not None and (block or upload.put.done()):
            self._upload = None
            self._reported(upload.staged, upload.put.result())
        if block:
            self.lane.drain()

    def flush(self) -> None:
        """Wait for the lane (commits, the last put) and report what it did."""
        self.reap(block=True)

    def finish(self) -> None:
        """Leaving: the lane's work done and reported, and the moments written if they moved."""
        self.flush()
        if self.ctx.trainer.step != self._moments_step and self.theta.pos.fingerprint:
            self.commit(feedback=False, moments=True)
            self.lane.drain()

    def _reported(self, staged: Staged, put: PutOutcome) -> None:
        """The put of ``staged`` ended: count a refusal, give Δ̂ back if it failed, report it."""
        if put.uploaded:
            self._refused = 0
        elif put.refused:
            self._refused += 1  # AccessDenied, or a store that keeps failing our writes
        if not put.uploaded:
            self._give_back(staged)
        summary = put.summary(f"upload of window {staged.window}")
        log.log(logging.INFO if put.uploaded and put.attempts <= 1 else logging.WARNING, "%s", summary)
        read, requested = self.ctx.store.bytes_read, self.ctx.store.requests()
        sent = {kind: n - self._requested.get(kind, 0) for kind, n in requested.items()}
        wire = (self.ctx.store.wire_sent, self.ctx.store.wire_received)
        wire_up, wire_down = wire[0] - self._wire[0], wire[1] - self._wire[1]
        self.ctx.display.update(
            upload_bytes=len(staged.blob), upload_s=put.seconds, wire_up_bytes=wire_up, wire_down_bytes=wire_down
        )
        self.ctx.display.emit(self._window_event(staged, put, read - self._downloaded, (wire_up, wire_down), sent))
        self._downloaded, self._wire, self._requested = read, wire, requested
        if self._refused >= self.ctx.local.peer.max_upload_failures:
            raise UploadsRefused(self._refused_message(put.reason))

    def _window_event(
        self, staged: Staged, put: PutOutcome, read: int, wire: tuple[int, int], requests: dict[str, int]
    ) -> PeerWindow:
        """The window's report: its training, its fold and its put (``read``: store bytes read since
        the last report; ``wire``: what the store's sockets sent and received since; ``requests``:
        requests sent to the bucket since then, by kind)."""
        st = staged.stats
        return PeerWindow(
            window=staged.window,
            outcome=put.outcome,
            reason=put.reason,
            loss_first=round(st.loss_first, 5),
            loss=round(st.loss_last, 5),
            tokens=st.tokens,
            inner_s=round(st.inner_s, 3),
            compress_s=round(st.compress_s, 3),
            upload_bytes=len(staged.blob),
            upload_s=round(put.seconds, 3),
            upload_attempts=put.attempts,
            upload_down_s=round(put.down_s, 3),
            feedback_norm=round(self.feedback.norm(), 6),
            trained_from=staged.trained_from,
            stale_steps=st.stale_steps,
            forecast_wait_s=round(st.forecast_wait_s, 3),
            aggregate_wait_s=round(st.aggregate_wait_s, 3),
            download_bytes=read + st.data.fetched_bytes,  # the data feed reads on its own
            data_bytes=st.data.fetched_bytes,
            data_hits=st.data.hits,
            data_misses=st.data.misses,
            wire_up_bytes=wire[0],
            wire_down_bytes=wire[1],
            requests=requests,
        )

    def _refused_message(self, reason: str | None) -> str:
        key = f"{self.ctx.run_id}/contrib/<window>/{self.ctx.identity.peer_id}"
        return (
            f"the store refused this peer's contribution in {self._refused} consecutive windows "
            f"(last: {reason}) while reading from it works: this peer may not write {key} in "
            f"{self.ctx.local.store.location()}. Ask the operator for a credential (or grants) that may write there; "
            "training on without uploading would only hold the run's windows open"
        )

    def _give_back(self, staged: Staged) -> None:
        """The staged bytes never reached the store: Δ̂ goes back into e, the contribution is dropped."""
        self.lane.drain()  # no commit may be reading e while it changes
        self.feedback.give_back(staged.sent)
        if self.pending is staged:
            self.pending = None
        self.commit(feedback=True)

    # ------------------------------------------------------------------ state
    def moved(self, before: int) -> None:
        """θ moved from window ``before``: drop a staged contribution that is aggregated now, and
        commit the position."""
        if self.pending is not None and self.pending.window < self.theta.pos.window:
            self.pending = None
        if self.theta.pos.window != before:
            self.commit(feedback=False)  # only the position (and the dropped staged bytes) moved

    def commit(
        self, *, feedback: bool, moments: bool = False, optimizer: Mapping[str, Any] | None = None
    ) -> Future[None]:
        """Queue a commit of the peer's state on the lane: position, the staged contribution, the
        optimizer's scalars, and e (``feedback``) and the moments (``moments``) when asked.

        θ is not stored: a restart re-derives it from the store's checkpoint and aggregates.
        """
        pending, pos = self.pending, self.theta.pos
        snap = Snapshot(
            run_hash=self.ctx.spec.hash(),
            window=pos.window,
            base=pos.base,
            fingerprint=pos.fingerprint,
            feedback=self.feedback.state_dict(),
            # The structure is copied here (not the tensors): the lane reads it while training goes on.
            optimizer=detached(self.ctx.trainer.state_dict() if optimizer is None else optimizer),
            pending=pending.window if pending else None,
            pending_blob=pending.blob if pending else None,
        )
        return self.lane.submit(self.ctx.state.save, snap, feedback=feedback, moments=moments)
