"""The peer's loop: join, then per window catch up, train, fold and sign, upload; withdraw on leaving.

:class:`Peer` holds the phases (:mod:`client.peer`) and decides what comes next; each phase owns its
state: θ and its position (:class:`~client.peer.position.Theta`, kept with the chain by
:class:`~client.peer.position.CatchUp`), the window in training (:class:`~client.peer.inflight.InFlight`),
e and the uploads (:class:`~client.peer.uploads.Uploads`), and the peer's membership of the run
(:class:`~client.peer.lifecycle.Lifecycle`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from torch import Tensor

from client.clock import Offset
from client.metered import MeteredStore
from client.peer.context import PeerContext
from client.peer.inflight import InFlight, overlaps
from client.peer.lifecycle import Lifecycle
from client.peer.position import CatchUp, Theta
from client.peer.uploads import Staged, Uploads
from client.progress import PeerDisplay
from client.state import LocalState
from client.uplink import transient
from client.window import Skipped, Trained, WindowTrainer
from protocol import layout
from protocol.config import RunSpec
from protocol.errors import ProtocolError, StoreError
from protocol.events import PeerWindow, Stopped
from protocol.feedback import FeedbackBuffers
from protocol.identity import Identity
from protocol.replay import Position
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.wire import Contribution, encode_contribution

__all__ = ["Peer"]

log = logging.getLogger(__name__)

CLOSED_HINT_AFTER = 3  # consecutive windows closed before training: the clock may be off


class Peer:
    """One participant; see :mod:`client.peer` for the window loop."""

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
        clock_offset: Offset | None = None,
    ) -> None:
        self.spec, self.identity, self.state, self.trainer = spec, identity, state, trainer
        self.store = MeteredStore(store)  # what this peer downloads, reported per window
        self.local = local or LocalSettings()
        self.display = display or PeerDisplay(json_lines=True)
        self.run_id = layout.run_id(spec.hash())
        self.ctx = PeerContext(spec, self.store, identity, state, trainer, self.local, self.display, self.run_id)
        self.theta = Theta(spec, self.store, poll_interval_s=self.local.poll_interval_s, watch=self.display.watch)
        self.uploads = Uploads(self.ctx, self.theta)
        self.catchup = CatchUp(self.ctx, self.theta, self.uploads)
        self.inflight = InFlight(self.ctx, self.theta, self.catchup, self.uploads)
        self.lifecycle = Lifecycle(self.ctx, self.theta, self.catchup, self.uploads, self.inflight)
        self.inner_s = 0.0
        self.windows_trained = 0
        self._last_trained = -1  # the last window trained, skipped or failed here: the next one follows it
        self.clock_offset = clock_offset  # this machine's clock against the store's, measured at join
        self._closed_in_a_row = 0  # windows found closed before training, consecutive

    def stop(self) -> None:
        """Ask the loop to stop at the next phase boundary (Ctrl-C raises instead, also safely)."""
        self.ctx.stop.set()

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
                        if not self._caught_up(need):  # apply what is published; wait while θ is too far behind
                            continue
                        window, need = self._plan(until_window, max_windows)
                        if window is None or self.pos.window < need or self.theta.diverged or self.ctx.stopping():
                            continue
                        work = self.train(window)  # H steps → Δ folded into e → signed Δ̂, or a skip
                        if isinstance(work, Staged):
                            self.upload(work)  # commit e with the bytes, then put: on the lane
                        else:
                            self._skip(window, work)
                    except (ProtocolError, StoreError) as exc:
                        if not self._retried(window, exc):
                            self._failed(self.pos.window if window is None else window, exc)
            finally:
                self.uploads.finish()  # the lane's last commit and put, and the moments, before leaving
        finally:
            if self.announced:  # also on Ctrl-C and on the errors that stop the peer
                self.lifecycle.withdraw()
        self.display.emit(self.stopped("stopped" if self.ctx.stopping() else "done"))

    def stopped(self, reason: str) -> Stopped:
        """The ``stopped`` event of this process: where θ stands, the windows it trained and
        their inner time since it started, and whether the withdrawal is in the store. ``join``
        emits it with ``interrupted`` after Ctrl-C or SIGTERM, with the same counts."""
        return Stopped(
            reason=reason,
            window=self.pos.window,
            windows_trained=self.windows_trained,
            inner_s=round(self.inner_s, 3),
            fingerprint=self.pos.fingerprint,
            withdrawn=self.withdrawn,
        )

    def _done(self, until_window: int | None, max_windows: int | None) -> bool:
        if self.ctx.stopping():
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
        return window, window - 1 if overlaps(self.spec, self.trainer) else window

    # ------------------------------------------------------------------ the phases
    def join(self) -> None:
        """Announce, restore local state, load the newest checkpoint and replay aggregates."""
        entry = self.lifecycle.join()
        if entry.last_trained is not None:
            self._last_trained = entry.last_trained
        self.inner_s += entry.inner_s

    def announce(self) -> None:
        """Sign and put this peer's announcement."""
        self.lifecycle.announce()

    def catch_up(self, need: int) -> None:
        """Apply every published aggregate; while θ opens a window before ``need``, wait for the
        next one (our last upload is reported first: it may be what that window waits for)."""
        self.catchup.between_windows(need)

    def train(self, window: int) -> Staged | Skipped:
        """The trainer's window from the newest θ, then its Δ folded into e and the signed
        contribution (staged by :meth:`upload`). θ does not change in between."""
        early = self.inflight.take_early()
        if not self.theta.window_open(window):
            self._closed_in_a_row += 1
            return Skipped(self._closed_reason())
        self._closed_in_a_row = 0
        if early is not None and window == 0 == self.pos.window:  # trained while genesis was not out yet
            self.inflight.begin_early()
            return self._fold(window, early, trained_from=0)
        trained_from = self.pos.window
        work = self.trainer.train(self.inflight.begin(window, self.feedback.view()))
        if isinstance(work, Skipped):
            self.inner_s += work.inner_s
            if self.inflight.abandoned:
                return Skipped("θ was rebuilt from a checkpoint during the window", work.inner_s)
            return work
        self.inner_s += work.stats.inner_s
        if not self.theta.window_open(window):  # nothing of it reaches e
            return Skipped("deadline passed during training", work.stats.inner_s)
        stats = dataclasses.replace(
            work.stats,
            stale_steps=self.inflight.stale_steps,
            forecast_wait_s=self.inflight.waited_s,
            aggregate_wait_s=self.inflight.aggregate_wait_s,
        )
        return self._fold(window, dataclasses.replace(work, stats=stats), trained_from)

    def _closed_reason(self) -> str:
        """Why a window was skipped before training: with the clock offset measured at join, or,
        after :data:`CLOSED_HINT_AFTER` such skips in a row, a hint that the clock may be off."""
        reason = "window closed before training started"
        if self.clock_offset is not None:
            return f"{reason} ({self.clock_offset.worded()}, ± {self.clock_offset.uncertainty_s:.1f} s)"
        if self._closed_in_a_row >= CLOSED_HINT_AFTER:
            return (
                f"{reason} ({self._closed_in_a_row} windows in a row: check this machine's clock, "
                "`sparseloco-peer preflight` measures it)"
            )
        return reason

    def _fold(self, window: int, work: Trained, trained_from: int) -> Staged:
        """e ← compress(e, Δ) in place and the signed contribution; the lane drains first (its
        commits read e, and the last put's outcome may give Δ̂ back to it)."""
        self.flush()
        t0 = time.perf_counter()
        encoded = work.fold(self.feedback, self.inflight.stand_in)
        contribution = Contribution(
            self.spec.hash(), window, self.pos.base, self.spec.codec_at(window), dict(encoded), dict(work.metadata)
        )
        blob = encode_contribution(contribution, self.identity)
        stats = dataclasses.replace(work.stats, compress_s=work.stats.compress_s + time.perf_counter() - t0)
        return Staged(window, blob, encoded, stats, work.optimizer_after, trained_from)

    def upload(self, staged: Staged) -> None:
        """Adopt the staged contribution (one commit with e), then put it; both on the lane."""
        self.windows_trained += 1
        self._last_trained = max(self._last_trained, staged.window)
        self.uploads.upload(staged)

    def flush(self) -> None:
        """Wait for the lane (commits, the last put) and report what it did."""
        self.uploads.flush()

    def _skip(self, window: int, skipped: Skipped) -> None:
        """Record a window with nothing to send; e and the staged state stay as they are."""
        self._last_trained = max(self._last_trained, window)
        self.display.emit(
            PeerWindow(window=window, outcome="skipped", reason=skipped.reason, inner_s=round(skipped.inner_s, 3))
        )

    def _caught_up(self, need: int) -> bool:
        """:meth:`catch_up`; False when the store or the grant server did not answer (the link or
        the store is down): no window is lost to that, the loop waits with backoff and looks
        again, saying so once when it starts and once when it ends (a refusal or a bad object is
        the window's failure, as before)."""
        try:
            self.catch_up(need)
        except StoreError as exc:
            if not transient(exc):
                raise
            self.ctx.stop.wait(self.ctx.outage.down(exc))
            return False
        self.ctx.outage.up()
        return True

    def _retried(self, window: int | None, exc: ProtocolError | StoreError) -> bool:
        """Whether a window that broke because the store did not answer is tried again: while
        nothing of it was adopted and it is still open, the loop waits (saying so once, as
        :meth:`_caught_up` does) and trains it anew; once it has closed it is recorded as failed
        with the store's error."""
        if window is None or not isinstance(exc, StoreError) or not transient(exc):
            return False
        if self._last_trained >= window or not self.theta.window_open(window):
            return False
        self.ctx.stop.wait(self.ctx.outage.down(exc))
        return True

    def _failed(self, window: int, exc: ProtocolError | StoreError) -> None:
        """A window that broke on a store or protocol error: record it (nothing was adopted) and
        move on to the next one."""
        self._last_trained = max(self._last_trained, window)
        self.display.emit(PeerWindow(window=window, outcome="failed", reason=exc.reason, detail=str(exc)))
        time.sleep(max(self.theta.poll_s, 1.0))  # a persistent fault (a forged aggregate) must not spin

    # ------------------------------------------------------------------ what the phases hold
    @property
    def pos(self) -> Position:
        """Where θ stands."""
        return self.theta.pos

    @property
    def params(self) -> dict[str, Tensor]:
        """θ's master copy (CPU float32)."""
        return self.theta.params

    @property
    def feedback(self) -> FeedbackBuffers:
        """e."""
        return self.uploads.feedback

    @property
    def pending(self) -> Staged | None:
        """The staged contribution not yet known to be aggregated."""
        return self.uploads.pending

    @property
    def announced(self) -> bool:
        """Whether our announcement is in the store (leaving withdraws it)."""
        return self.lifecycle.announced

    @property
    def withdrawn(self) -> bool:
        """Whether leaving replaced the announcement by a withdrawal."""
        return self.lifecycle.withdrawn
