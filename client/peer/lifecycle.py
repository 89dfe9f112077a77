"""Joining a run and leaving it: announce, restore local state, wait for genesis, replay; withdraw.

:meth:`Lifecycle.join` announces the peer (waiting for a store that does not answer yet, such as a
grant server whose validator is starting, within ``peer.join_timeout_s``), restores e, the inner
optimizer and a staged contribution from the state directory, loads the newest checkpoint (waiting
for genesis within the same bound, and training window 0 from θ₀ meanwhile on the overlapped
schedule), replays the aggregates after it and re-puts a staged contribution whose window is still
open. A store that stops answering while the checkpoint or the aggregates are read is waited out,
said once, for as long as ``peer.join_timeout_s`` from the outage's start; the replay goes on from
the last aggregate it applied. :meth:`Lifecycle.withdraw` replaces the announcement by a signed withdrawal, so that the
validator stops waiting for this peer at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from client.peer.context import PeerContext
from client.peer.inflight import InFlight, overlaps
from client.peer.position import CatchUp, Theta
from client.peer.uploads import Uploads, put_with_retry
from client.uplink import transient
from client.window import Trained, WindowJob
from protocol import layout
from protocol.errors import ProtocolError, ReasonedError, StoreError, StoreUnavailable
from protocol.events import Announced, Joined, PeerStarted, WaitingForGenesis
from protocol.replay import initial_params
from protocol.windows import poll_delays
from protocol.wire import Announcement, encode_announcement

__all__ = ["CLIENT_VERSION", "GENESIS_REPORT_S", "JOINED_AT", "Entry", "Lifecycle", "RunNotFound"]

CLIENT_VERSION = "sparseloco-peer/0.1"
JOINED_AT = "joined_at"  # the announcement's metadata: when this peer joined (unix s)
GENESIS_REPORT_S = 10.0  # how often a peer waiting for genesis says so


class RunNotFound(ReasonedError):
    """No signed genesis checkpoint of this peer's run hash appeared within ``peer.join_timeout_s``."""

    reason = "run_not_found"


@dataclass(frozen=True)
class Entry:
    """What joining found: ``last_trained``, the last window this peer trained before a restart
    (None for a fresh peer); ``inner_s``, the training time spent while waiting for genesis."""

    last_trained: int | None
    inner_s: float


class Lifecycle:
    """A peer's membership of its run (module docstring)."""

    def __init__(self, ctx: PeerContext, theta: Theta, catch_up: CatchUp, uploads: Uploads, inflight: InFlight) -> None:
        self.ctx, self.theta, self.catch_up, self.uploads, self.inflight = ctx, theta, catch_up, uploads, inflight
        self.announced = False  # our announcement is in the store: leaving withdraws it
        self.withdrawn = False

    def join(self) -> Entry:
        """Announce, restore local state, load the newest checkpoint and replay aggregates."""
        ctx, t0 = self.ctx, time.time()
        ctx.display.emit(
            PeerStarted(
                peer_id=ctx.identity.peer_id,
                run_id=ctx.run_id,
                run_hash=ctx.spec.hash(),
                store=ctx.local.store.location(),
            )
        )
        self._announce_when_reachable(t0)
        ctx.display.emit(Announced(peer_id=ctx.identity.peer_id))
        snap = ctx.state.load(ctx.spec.hash())
        last_trained = None
        if snap is not None:
            self.uploads.restore(snap)
            last_trained = snap.pending if snap.pending is not None else snap.window - 1
        replayed_from, inner_s = self._wait_for_genesis(early=snap is None)
        pos = self.theta.pos
        if snap is not None and snap.pending is not None and snap.pending >= pos.window and snap.pending_blob:
            self.uploads.resume(snap.pending, snap.pending_blob)
        self.uploads.flush()
        pos = self.theta.pos
        ctx.display.update(peer_id=ctx.identity.peer_id, window=pos.window, fingerprint=pos.fingerprint)
        ctx.display.emit(
            Joined(
                peer_id=ctx.identity.peer_id,
                window=pos.window,
                fingerprint=pos.fingerprint,
                replayed_from=replayed_from,
                resumed=snap is not None,
                resumed_window=snap.window if snap else None,
                staged_window=snap.pending if snap else None,
                feedback_norm=round(self.uploads.feedback.norm(), 6),
                inner_step=ctx.trainer.step,
                join_s=round(time.time() - t0, 3),
            )
        )
        return Entry(last_trained, inner_s)

    # ------------------------------------------------------------------ announcements
    def announce(self) -> None:
        """Sign and put this peer's announcement (hardware and pipeline role from its trainer, and
        when it joined: each join's announcement differs, so a validator holding a window after its
        restart, validator/hold.py, sees a peer that joined again even if it never withdrew)."""
        ctx = self.ctx
        ann = Announcement(
            ctx.spec.hash(),
            0,
            CLIENT_VERSION,
            ctx.trainer.hardware,
            role=ctx.trainer.role,
            metadata={JOINED_AT: round(time.time(), 3)},
        )
        put_with_retry(
            ctx.store, layout.peer_key(ctx.run_id, ctx.identity.peer_id), encode_announcement(ann, ctx.identity)
        )
        self.announced = True

    def withdraw(self) -> bool:
        """Replace our announcement by a signed withdrawal (the key is ours): the validator stops
        waiting for this peer. Best effort: False when the store refused it."""
        ctx = self.ctx
        ann = Announcement(
            ctx.spec.hash(),
            self.theta.pos.window,
            CLIENT_VERSION,
            ctx.trainer.hardware,
            role=ctx.trainer.role,
            withdrawn=True,
        )
        try:
            put_with_retry(
                ctx.store, layout.peer_key(ctx.run_id, ctx.identity.peer_id), encode_announcement(ann, ctx.identity)
            )
        except StoreError:
            return False  # the validator stops waiting after one window anyway
        self.withdrawn = True
        return True

    def _announce_when_reachable(self, started: float) -> None:
        """Announce; while the store is unreachable (a grant server whose validator has not
        started yet) keep trying, as long as a peer waits for genesis (``peer.join_timeout_s``)."""
        timeout = self.ctx.local.peer.join_timeout_s
        reported: float | None = None
        while True:
            try:
                self.announce()
                return
            except StoreUnavailable as exc:
                waited = time.time() - started
                if waited >= timeout or self.ctx.stopping():
                    raise RunNotFound(f"{self._not_found(timeout)}; the store stayed unreachable: {exc}") from exc
                if reported is None or waited - reported >= GENESIS_REPORT_S:
                    reported = waited
                    self._report_waiting(waited, timeout)
                time.sleep(self.theta.poll_s)

    # ------------------------------------------------------------------ genesis
    def _wait_for_genesis(self, *, early: bool) -> tuple[int, float]:
        """Newest checkpoint (waiting for genesis if the validator is not up yet, at most
        ``peer.join_timeout_s``), then replay; (the checkpoint's window, training time spent). With
        ``early`` (a fresh peer) and the overlapped schedule, the wait for genesis trains window 0
        (:meth:`_train_before_genesis`)."""
        ctx = self.ctx
        timeout = ctx.local.peer.join_timeout_s
        start = time.monotonic()
        reported: float | None = None
        inner_s = 0.0
        delays = poll_delays(self.theta.poll_s, ctx.spec.windows)  # each look is a GET: back off
        while True:
            try:
                checkpoint = self.theta.load()
                break
            except StoreError as exc:
                if not self._outlasts(exc):
                    raise
                continue
            except ProtocolError as exc:
                if exc.reason != "not_ready" or ctx.stopping():
                    raise
            waited = time.monotonic() - start
            if waited >= timeout:
                raise RunNotFound(self._not_found(timeout))
            if reported is None or waited - reported >= GENESIS_REPORT_S:
                reported = waited
                self._report_waiting(waited, timeout)
            if early and overlaps(ctx.spec, ctx.trainer):
                early = False  # one window, once
                inner_s += self._train_before_genesis(deadline=start + timeout)
                continue
            ctx.display.update(phase="waiting for genesis")
            time.sleep(next(delays))
        while True:  # each try goes on from the last aggregate applied
            try:
                self.catch_up.replay()
                break
            except StoreError as exc:
                if not self._outlasts(exc):
                    raise
        ctx.outage.up()
        return checkpoint, inner_s

    def _outlasts(self, exc: StoreError) -> bool:
        """The store stopped answering (``exc``) while this peer joins: True after waiting, said
        once (:class:`~client.peer.context.Outage`), to be tried again; False (the join fails with
        ``exc``) for an error that is no outage, once the outage has lasted ``peer.join_timeout_s``
        or when the peer is stopping."""
        ctx = self.ctx
        if not transient(exc) or ctx.stopping():
            return False
        wait = ctx.outage.down(exc)
        since = ctx.outage.since if ctx.outage.since is not None else time.monotonic()
        if time.monotonic() - since >= ctx.local.peer.join_timeout_s:
            return False
        ctx.stop.wait(wait)
        return not ctx.stopping()

    def _train_before_genesis(self, *, deadline: float) -> float:
        """Window 0 from θ₀ while the validator has not published genesis yet: θ₀ is a pure function
        of the RunSpec, and only the base (the genesis manifest's digest) is unknown, which is
        signed only at the fold. The work is used if genesis turns out to open window 0 of this θ₀
        (:meth:`client.peer.Peer.train`), dropped otherwise; it stops at the join deadline. Returns
        the training time."""
        ctx, params = self.ctx, self.theta.params
        params.clear()  # the checkpoint load replaces these tensors in place by the checked θ₀
        params.update(initial_params(ctx.spec.model))
        job = WindowJob(
            0,
            params,
            "",
            self.uploads.feedback.view(),
            report=ctx.display.update,
            should_stop=lambda: ctx.stopping() or time.monotonic() >= deadline,
            alpha=ctx.spec.outer.alpha,
        )
        work = ctx.trainer.train(job)
        self.inflight.hold_early(work if isinstance(work, Trained) else None)
        return work.stats.inner_s if isinstance(work, Trained) else work.inner_s

    def _report_waiting(self, waited: float, timeout: float) -> None:
        ctx = self.ctx
        ctx.display.emit(
            WaitingForGenesis(
                run_id=ctx.run_id,
                run_hash=ctx.spec.hash(),
                store=ctx.local.store.location(),
                waited_s=round(waited, 1),
                timeout_s=timeout,
            )
        )

    def _not_found(self, timeout: float) -> str:
        ctx = self.ctx
        return (
            f"no genesis checkpoint of run {ctx.run_id} (run hash {ctx.spec.hash()}) in "
            f"{ctx.local.store.location()} after {timeout:.0f} s. Either the run's validator has not "
            "started, or this run.toml differs from the operator's: run `sparseloco run-id run.toml` "
            "on both sides and compare the run hashes (only the RunSpec counts; [local], --settings, "
            "SPARSELOCO_* variables and flags do not)"
        )
