"""The peer's position: θ's master copy, where it stands on the chain, and keeping it there.

:class:`Theta` owns θ (CPU float32, changed only by signed aggregates and checkpoints, through
:class:`client.peer.sync.Sync` and :mod:`protocol.replay`), its :class:`~protocol.replay.Position`,
whether it must be rebuilt from a checkpoint, and what the forecast of the next aggregate needs
from the last one applied. Advancing it yields each change as a value
(:class:`~client.peer.sync.Advanced`, :class:`~client.peer.sync.Reloaded`) after θ's state moved
with it::

    theta = Theta(spec, store, poll_interval_s=0.5)
    theta.load()                        # newest checkpoint (NotReady while there is no genesis)
    for step in theta.advance():        # every aggregate published since
        ...

:class:`CatchUp` acts on those values for the rest of the peer: each applied aggregate is recorded
in the state directory and shown (with the validator's verdict on our contribution to it), a
rebuilt θ is reported, a staged contribution that is aggregated now is dropped and the new position
committed. It catches up between windows (waiting while θ is too far behind) and in the middle of
one (:mod:`client.peer.inflight`), and replays the chain when the peer joins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from torch import Tensor

from client.peer.context import PeerContext
from client.peer.sync import Advanced, Reloaded, Step, Sync
from client.peer.uploads import Uploads
from client.uplink import transient
from protocol.aggregate import SparseDict
from protocol.chain import delta_of
from protocol.config import RunSpec
from protocol.errors import ProtocolError, StoreError
from protocol.events import Applied, Resynced, SyncFailed
from protocol.outcomes import PeerOutcome, read_outcomes, verdict
from protocol.quorum import Signatures
from protocol.replay import Position
from protocol.store.base import ObjectStore
from protocol.store.fetch import Watch
from protocol.windows import upload_deadline
from protocol.wire import Aggregate, Verified

__all__ = ["CatchUp", "Theta"]

_log = logging.getLogger(__name__)
DUE_SHARE = 0.8  # the next aggregate is expected no sooner than this share of the last window's length


def overdue_at(deadline: float, spec: RunSpec) -> float:
    """When an aggregate whose window's upload deadline is ``deadline`` counts as late: the
    validator closes the window ``gather_grace_s`` after it, then a whole ``upload_deadline_s``
    more for checking, scoring and publishing."""
    return deadline + spec.windows.gather_grace_s + spec.windows.upload_deadline_s


class Theta:
    """θ's master copy and where it stands (module docstring)."""

    def __init__(
        self, spec: RunSpec, store: ObjectStore, *, poll_interval_s: float, watch: Watch | None = None
    ) -> None:
        self.spec = spec
        self.sync = Sync(spec, store, poll_interval_s=poll_interval_s, watch=watch)
        self.params: dict[str, Tensor] = {}  # θ master copy: CPU float32, changed only by signed objects
        self.pos = Position(0, "", "")
        self.diverged = False  # θ must be rebuilt from a checkpoint before training again
        self.last_manifest: frozenset[str] | None = None  # the peers of the last aggregate applied
        self.previous_base = ""  # the base of the window before θ's (what aggregate pos.window−1 built on)
        self.window_s: float | None = None  # how long the last window took (published_at to published_at)

    def load(self) -> int:
        """θ from the newest checkpoint that verifies (``NotReady`` while there is none); its window."""
        self.pos = self.sync.resync(self.params)
        return self.pos.window

    def advance(self) -> Iterator[Step]:
        """Every aggregate published after θ, applied; θ's state holds each step before it is
        yielded, so that one that fails later does not undo it."""
        for step in self.sync.steps(self.params, self.pos):
            before, self.pos = self.pos, step.pos
            if before.opened_at is not None and step.pos.opened_at is not None and isinstance(step, Advanced):
                self.window_s = step.pos.opened_at - before.opened_at
            if isinstance(step, Advanced):
                agg = step.aggregate.value
                self.last_manifest = frozenset(m.peer_id for m in agg.manifest)
                self.previous_base = agg.base
            yield step

    def rebuild(self) -> Iterator[Advanced]:
        """θ from the newest checkpoint, then every aggregate after it (a divergence on the way
        rebuilds again, unreported); ``diverged`` is cleared once it is through."""
        self.load()
        for step in self.advance():
            if isinstance(step, Advanced):
                yield step
        self.diverged = False

    def failed(self, exc: ProtocolError | StoreError) -> None:
        """Reading or applying the chain failed: after a bad object θ may be half-updated, so it is
        rebuilt before the next window; a failing store leaves θ at the last aggregate applied."""
        if isinstance(exc, ProtocolError):
            self.diverged = True

    def base_of(self, window: int) -> str | None:
        """The base an aggregate of ``window`` must chain onto, when this peer knows it."""
        return self.pos.base if window == self.pos.window else None

    def window_open(self, window: int) -> bool:
        """Whether a contribution for ``window`` may still count: its aggregate is not published,
        and, for the window θ opens, its deadline has not passed (a window that has not opened yet,
        the next one while the last aggregate is in flight, has no deadline yet). A store that does
        not answer (a link down) tells nothing: the window counts as open until it is known closed."""
        try:
            if self.sync.aggregate_published(window, self.base_of(window)):
                return False
        except StoreError as exc:
            if not transient(exc):
                raise
        if self.pos.opened_at is None or window != self.pos.window:
            return True
        return time.time() < upload_deadline(self.pos.opened_at, self.spec.windows)

    def deadline(self, window: int) -> float | None:
        """Unix time by which a contribution for ``window`` must be uploaded: its upload deadline
        once θ opens it, 0 once θ is past it (its aggregate is out), ``None`` while it has not
        opened yet. Read from the upload lane too: ``pos`` is replaced whole, never changed."""
        pos = self.pos
        if window < pos.window:
            return 0.0
        if pos.opened_at is None or window != pos.window:
            return None
        return upload_deadline(pos.opened_at, self.spec.windows)

    def wait_for_next(
        self, should_stop: Callable[[], bool], on_waiting: Callable[[Signatures], None] | None = None
    ) -> None:
        """Until the aggregate that follows θ is published (or ``should_stop()``); with several
        validators ``on_waiting`` hears every few seconds whose signatures it still waits for."""
        self.sync.wait_until_published(
            self.pos.window, base=self.pos.base, should_stop=should_stop, on_waiting=on_waiting, due_at=self.due_at()
        )

    def due_at(self) -> float | None:
        """When the aggregate that follows θ is expected at the soonest: :data:`DUE_SHARE` of the
        last window's length after θ's window opened (None while that is unknown). Before, a wait
        for it backs off; a window that runs faster than the last one costs its waiting peers at
        most :func:`protocol.windows.max_poll_s`."""
        if self.pos.opened_at is None or self.window_s is None or self.window_s <= 0:
            return None
        return self.pos.opened_at + DUE_SHARE * self.window_s

    @property
    def poll_s(self) -> float:
        return self.sync.poll_s


class CatchUp:
    """θ kept with the chain, and what each step of it means for the rest of the peer (module docstring)."""

    def __init__(self, ctx: PeerContext, theta: Theta, uploads: Uploads) -> None:
        self.ctx, self.theta, self.uploads = ctx, theta, uploads
        self._signatures: Signatures | None = None  # the last one reported
        self._quiet_until = 0.0  # monotonic: no mid-window look before (the store did not answer)

    def between_windows(self, need: int) -> None:
        """Apply every published aggregate (rebuilding θ first if it diverged); while θ opens a
        window before ``need``, wait for the next one. A failure is reported, not raised, except
        a store that does not answer: the loop waits for it and says so once
        (:class:`~client.peer.context.Outage`), rather than once per look."""
        theta = self.theta
        before = theta.pos.window
        try:
            for step in theta.rebuild() if theta.diverged else theta.advance():
                self._report(step)
            if theta.pos.window < need:
                self.wait()
                for step in theta.advance():
                    self._report(step)
        except (ProtocolError, StoreError) as exc:
            if not theta.diverged:
                self.uploads.moved(before)  # what was applied before the store failed stands
            if isinstance(exc, StoreError) and transient(exc):
                raise
            self._sync_failed(exc)
            time.sleep(max(theta.poll_s, 1.0))  # a persistent fault must not spin
            return
        self.uploads.moved(before)

    def in_window(self) -> list[SparseDict] | None:
        """Apply what is published to θ mid-window; the Δ̄ applied, or None when the working model
        cannot follow (θ was rebuilt from a checkpoint, or a bad object leaves θ to be rebuilt). A
        store that does not answer (an outage, a link drop) only means nothing more arrived yet: what
        was applied before it stopped answering stands, the window trains on, and the next look (at
        most every ``poll_interval_s``) tries again, so a short outage does not cost the window."""
        before = self.theta.pos.window
        if time.monotonic() < self._quiet_until:
            return []
        applied: list[SparseDict] = []
        rebuilt = False
        try:
            for step in self.theta.advance():
                if isinstance(step, Advanced):
                    applied.append(delta_of(step.aggregate.value))
                else:
                    rebuilt = True
                self._report(step)
        except (ProtocolError, StoreError) as exc:
            if not (isinstance(exc, StoreError) and transient(exc)):
                self._sync_failed(exc)
                if rebuilt or self.theta.diverged:
                    return None
            else:
                self.ctx.outage.down(exc)  # what was applied before it stopped answering stands
                self._quiet_until = time.monotonic() + max(self.theta.poll_s, 1.0)
        else:
            self.ctx.outage.up()
        self.uploads.moved(before)
        return None if rebuilt else applied

    def replay(self) -> None:
        """Joining: every aggregate after the checkpoint θ was loaded from (errors are raised)."""
        for step in self.theta.advance():
            self._report(step)

    def wait(self) -> None:
        """Until the aggregate that follows θ is published; our last upload is reported first (it
        may be what that window waits for). An aggregate still missing a whole upload deadline
        after the validator closes its window (:func:`overdue_at`) is said to be late, once, and
        when it arrives how late it was: a validator that is down or stuck is not silence."""
        self.uploads.flush()
        self.ctx.display.update(phase="waiting for aggregate")
        window, closes = self.theta.pos.window, self.theta.deadline(self.theta.pos.window)
        late = threading.Event()
        timer = None
        if closes:
            delay = max(0.0, overdue_at(closes, self.ctx.spec) - time.time())
            timer = threading.Timer(delay, self._overdue, args=(window, closes, late))
            timer.daemon = True
            timer.start()
        try:
            self.theta.wait_for_next(self.ctx.stopping, self._awaiting)
        finally:
            if timer is not None:
                timer.cancel()
        if late.is_set() and self.theta.pos.window == window and closes:
            _log.warning(
                "aggregate %d was published %.0f s after its window's upload deadline", window, time.time() - closes
            )

    def _overdue(self, window: int, closes: float, late: threading.Event) -> None:
        late.set()
        _log.warning(
            "aggregate %d is not published %.0f s after its window's upload deadline: the validator is slow or "
            "down; waiting for it",
            window,
            time.time() - closes,
        )

    def _awaiting(self, found: Signatures) -> None:
        """Several validators: the next aggregate waits for their signatures. Shown every time it is
        read; reported as an event when the count changed."""
        self.ctx.display.update(phase=found.describe())
        if found != self._signatures:
            self._signatures = found
            self.ctx.display.emit(found.event())

    # ------------------------------------------------------------------ reports
    def _report(self, step: Step) -> None:
        if isinstance(step, Reloaded):
            self.ctx.display.emit(Resynced(window=step.pos.window, reason=step.error.reason, detail=str(step.error)))
        else:
            self._applied(step.aggregate, step.pos)

    def _applied(self, agg: Verified[Aggregate], pos: Position) -> None:
        """θ holds aggregate ``agg`` now: record and report it (the fingerprint of θ after it,
        whether our contribution is in it, and what the validator decided about it)."""
        ctx = self.ctx
        pending = self.uploads.pending
        mine = [m for m in agg.value.manifest if m.peer_id == ctx.identity.peer_id]
        weight = mine[0].weight if mine else None
        contributed = bool(mine) or (pending is not None and pending.window == agg.value.window)
        reported = verdict(self._outcome(agg) if contributed else None)
        ctx.state.record(
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
        ctx.display.update(window=pos.window, fingerprint=pos.fingerprint)
        ctx.display.emit(
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
            table = read_outcomes(self.ctx.store, self.ctx.run_id, agg)
        except (ProtocolError, StoreError) as exc:
            _log.warning("outcomes of window %d unreadable: %s", agg.value.window, exc)
            return None
        return table.get(self.ctx.identity.peer_id) if table is not None else None

    def _sync_failed(self, exc: ProtocolError | StoreError) -> None:
        """A bad object or a failing store: record it (:meth:`Theta.failed` says what it means for θ)."""
        self.ctx.display.emit(SyncFailed(window=self.theta.pos.window, reason=exc.reason, detail=str(exc)))
        self.theta.failed(exc)
