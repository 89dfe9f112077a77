"""The window in training, and what may change under it while it trains.

With ``outer.delay = 1`` a peer trains window t before θ opens it: from θ_t−1 while aggregate t−1
is gathered, scored and published (:mod:`client.peer`). :class:`InFlight` owns what that takes:

* the window's job (:meth:`InFlight.begin` builds the :class:`~client.window.WindowJob` the trainer
  trains), and the one call the trainer makes between inner steps, :meth:`InFlight.between_steps`;
* the stand-in (``outer.eager``): the forecast of aggregate t−1 the working model holds until the
  aggregate arrives (:mod:`client.forecast`), refreshed between steps;
* the wait for that forecast before the first inner step (``outer.forecast_wait``, bounded by the
  peer's own measured step time), so that steps are not trained from its own contribution alone
  while the others' uploads are seconds away;
* when the aggregate arrived (``stale_steps``: the inner steps taken before θ held it), and whether
  the window was abandoned (θ rebuilt from a checkpoint mid-window: the working model cannot follow);
* window 0 trained from θ₀ while genesis was not out yet (:meth:`InFlight.hold_early`).

Between inner steps the last upload's put is reported once it is done; while θ lacks the aggregate
that opens the window it is applied as soon as it is published (:class:`client.peer.position.CatchUp`)
and the working model moves by the same step, less the stand-in (nothing moves when the forecast
was exact); once ``outer.overlap`` of the window is trained without it the peer waits for it there.
"""

from __future__ import annotations

import logging
import time

from client.forecast import Forecast, same_delta
from client.peer.context import PeerContext
from client.peer.position import CatchUp, Theta
from client.peer.uploads import Uploads
from client.window import Trained, WindowJob, WindowTrainer
from protocol.aggregate import SparseDict
from protocol.config import RunSpec
from protocol.feedback import FeedbackState

__all__ = ["InFlight", "overlap_steps", "overlaps"]

log = logging.getLogger(__name__)

Moves = list[tuple[SparseDict, float]]
"""How the working model moves: each ``(Δ, scale)`` means θ_local ← θ_local − scale·Δ (client/window.py)."""


def overlap_steps(spec: RunSpec) -> int:
    """Inner steps a window may take before θ holds the aggregate that opens it."""
    return spec.outer.overlap_steps(spec.inner.steps)


def overlaps(spec: RunSpec, trainer: WindowTrainer) -> bool:
    """Whether a peer trains a window before θ opens it (``outer.delay = 1``, a trainer that can take
    the aggregate mid-window, ``outer.overlap`` > 0)."""
    return spec.outer.delay == 1 and trainer.shifts and overlap_steps(spec) > 0


class InFlight:
    """The window in training (module docstring)."""

    def __init__(self, ctx: PeerContext, theta: Theta, catch_up: CatchUp, uploads: Uploads) -> None:
        self.ctx, self.theta, self.catch_up, self.uploads = ctx, theta, catch_up, uploads
        self.window = -1  # the window in training
        self.stand_in: SparseDict = {}  # what of the forecast the working model holds (outer.eager)
        self.forecast: Forecast | None = None
        self.abandoned = False  # θ was rebuilt from a checkpoint mid-window: the window is lost
        self._arrived_at: int | None = None  # inner steps taken when θ came to open the window
        self._refreshed = 0.0  # monotonic time of the forecast's last refresh
        self._early: Trained | None = None  # window 0, trained from θ₀ while genesis was not out yet
        self._step_s = 0.0  # this peer's inner step time (moving mean; 0 until one was measured)
        self._returned: float | None = None  # monotonic time between_steps last returned
        self.waited_s = 0.0  # the window's wait for the forecast before its first step
        self.aggregate_wait_s = 0.0  # the window's wait mid-window for the aggregate that opens it

    # ------------------------------------------------------------------ window 0 before genesis
    def hold_early(self, work: Trained | None) -> None:
        """Keep window 0 trained from θ₀ before genesis was out, for :meth:`take_early`."""
        self._early = work

    def take_early(self) -> Trained | None:
        """The early window 0, once (the next window trained takes it or drops it)."""
        early, self._early = self._early, None
        return early

    def begin_early(self) -> None:
        """The early window 0 is the window in training: θ₀ opened it, nothing stands in."""
        self.window, self.stand_in, self._arrived_at = 0, {}, 0

    # ------------------------------------------------------------------ one window
    def begin(self, window: int, feedback: FeedbackState) -> WindowJob:
        """Start ``window`` from the newest θ (less the forecast stand-in): the trainer's job."""
        theta = self.theta
        self.window = window
        self._arrived_at = 0 if theta.pos.window >= window else None
        self.abandoned = False
        self._returned, self.waited_s, self.aggregate_wait_s = None, 0.0, 0.0
        self._start_forecast(window)
        return WindowJob(
            window,
            theta.params,
            theta.pos.base,
            feedback,
            report=self.ctx.display.update,
            should_stop=self.should_stop,
            stand_in=self.stand_in,
            alpha=self.ctx.spec.outer.alpha,
            between_steps=self.between_steps,
        )

    def should_stop(self) -> bool:
        """Whether the trainer stops the window: the peer stops, or the window was abandoned."""
        return self.ctx.stopping() or self.abandoned

    @property
    def stale_steps(self) -> int:
        """Inner steps the window took before θ held the aggregate that opens it (all of them when
        it never arrived)."""
        return self.ctx.spec.inner.steps if self._arrived_at is None else self._arrived_at

    def between_steps(self, done: int) -> Moves:
        """Between inner steps (``done`` taken): report the lane's last put, and while θ lacks the
        aggregate that opens the window, apply it as soon as it is published (waiting for it once
        ``outer.overlap`` of the window is trained) or refresh its forecast (waiting for it to be
        complete before the first step). Returns how the working model moves (client/window.py)."""
        now = time.monotonic()
        if done > 0 and self._returned is not None:
            step = now - self._returned
            self._step_s = step if self._step_s == 0 else 0.8 * self._step_s + 0.2 * step
        moves = self._between_steps(done)
        self._returned = time.monotonic()
        return moves

    def _between_steps(self, done: int) -> Moves:
        self.uploads.reap()
        spec, window = self.ctx.spec, self.window
        if self.theta.pos.window >= window or self.abandoned:
            return []
        alpha = spec.outer.alpha
        arrived = self._arrivals()
        cap = overlap_steps(spec)
        if not arrived and self.theta.pos.window < window and done >= cap < spec.inner.steps:  # 1.0: never waits
            started = time.monotonic()
            try:
                self.catch_up.wait()
            finally:
                self.aggregate_wait_s += time.monotonic() - started
            arrived = self._arrivals()
        if arrived:
            return self._arrive(arrived, done, alpha)
        if done == 0:
            return self._await_forecast(alpha)
        return self._refresh(alpha)

    def _arrive(self, arrived: list[SparseDict], done: int, alpha: float) -> Moves:
        """θ now holds the aggregate(s) that open the window: the stand-in makes way for them."""
        exact = len(arrived) == 1 and same_delta(arrived[0], self.stand_in)
        moves = [] if exact else [(self.stand_in, -alpha), *((d, alpha) for d in arrived)]
        self.stand_in, self.forecast, self._arrived_at = {}, None, done
        return moves

    def _await_forecast(self, alpha: float) -> Moves:
        """Before the first inner step (``outer.forecast_wait``): wait until the forecast holds
        every trusted peer's contribution, or the aggregate is out, for at most that share of this
        peer's time for a window's inner steps (no wait until a step time was measured)."""
        forecast, spec = self.forecast, self.ctx.spec
        budget = spec.outer.forecast_wait * spec.inner.steps * self._step_s
        if forecast is None or budget <= 0 or forecast.complete:
            return self._refresh(alpha)
        started = time.monotonic()
        self.ctx.display.update(phase="waiting for contributions")
        while True:
            arrived = self._arrivals()
            if arrived:
                self.waited_s = time.monotonic() - started
                return self._arrive(arrived, 0, alpha)
            forecast.refresh()
            left = budget - (time.monotonic() - started)
            if forecast.complete or self.abandoned or self.ctx.stopping() or left <= 0:
                break
            time.sleep(min(self.theta.poll_s, left))  # idle: poll_s (the forecast's reads are GETs)
        self.waited_s = time.monotonic() - started
        self._refreshed = time.monotonic()
        log.info(
            "window %d: waited %.2f s for contributions; the forecast holds %d of %d",
            self.window,
            self.waited_s,
            forecast.contributors,
            len(forecast.trusted or ()),
        )
        return self._adopt(forecast.delta, alpha)

    def _arrivals(self) -> list[SparseDict]:
        """The aggregates applied to θ just now (none once the window is abandoned)."""
        arrived = self.catch_up.in_window()
        if arrived is None:
            self.abandoned = True
        return [] if self.abandoned or arrived is None else arrived

    def _refresh(self, alpha: float) -> Moves:
        """A newer forecast replaces the stand-in (at most every ``poll_interval_s``)."""
        forecast = self.forecast
        if forecast is None or forecast.complete or time.monotonic() - self._refreshed < self.theta.poll_s:
            return []  # complete: nothing more can come before the aggregate
        self._refreshed = time.monotonic()
        if not forecast.refresh():
            return []
        return self._adopt(forecast.delta, alpha)

    def _adopt(self, delta: SparseDict, alpha: float) -> Moves:
        """``delta`` (a newer forecast) replaces the stand-in: the working model moves by the difference."""
        old, self.stand_in = self.stand_in, delta
        return [] if old is delta else [(old, -alpha), (delta, alpha)]

    def _start_forecast(self, window: int) -> None:
        """``outer.eager``: the forecast of the aggregate θ lacks to open ``window`` (client/forecast.py)."""
        self.stand_in, self.forecast = {}, None
        theta, spec, me = self.theta, self.ctx.spec, self.ctx.identity.peer_id
        if not spec.outer.eager or theta.pos.window != window - 1:
            return
        staged = self.uploads.pending
        own = (me, staged.sent) if staged is not None and staged.window == window - 1 else None
        trusted = None if theta.last_manifest is None else theta.last_manifest | {me}
        bases = {theta.pos.base, theta.previous_base} - {""}
        self.forecast = Forecast(spec, self.ctx.store, window=window - 1, bases=bases, trusted=trusted, own=own)
        self.forecast.refresh()
        self._refreshed = time.monotonic()
        self.stand_in = self.forecast.delta
