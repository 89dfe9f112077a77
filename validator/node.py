"""The validator: one window at a time, every phase an object that owns its state.

    v = Validator(spec, open_from_settings(local.store), Identity.load(key), state_dir, local=local,
                  emit=EventWriter(sys.stdout))
    v.run(windows=10)            # resumes where the state directory and the store say it stopped

It reports through ``emit`` (:mod:`protocol.events`): WindowOpened when it starts gathering a
window, WindowWaiting while expected peers have not uploaded (every few seconds, naming them),
WindowHeld when a restarted validator holds a window nobody uploaded to until a peer is back
(:mod:`validator.hold`), StoreErrors once per window when store requests failed while gathering
(:mod:`validator.outage`), WindowPublished (also ``run_window``'s return value), WindowRetry after a store error (at most
``validator.window_retries`` in a row, then :class:`~validator.retry.WindowFailed`:
:mod:`validator.retry`), CheckpointSkipped and, with
``validator.eval_every`` (a local setting), ModelEvaluated (:mod:`validator.evaluation`).

The phases (docs/ARCHITECTURE.md, "One window, end to end"):

* **launch** (:mod:`validator.launch`): genesis or the store's launch, the same launch only, θ of
  the saved window replayed from the chain, aggregates already published adopted;
* **intake** (:mod:`validator.intake`): gather the uploads of announced, non-excluded peers under
  ``contrib/<t>/``, within the window's budgets, until the deadline or until every expected peer
  has uploaded (:func:`validator.gather.expected_peers`), the cheap checks run as each one is read;
* **decide** (:mod:`validator.decide`): norms against the validator's reference, copies, the
  window's seed (its secret, committed one window earlier, mixed with the digests of what was
  received), loss scores of a budgeted sample in the clipped form that would be aggregated,
  probation, capacity, and the aggregate of the accepted ones, dropping any whose update would make
  θ or the loss non-finite (on scratch copies: :mod:`validator.trial`) — one
  :class:`~validator.decide.WindowDecision`, with a contribution-log row for every announced peer;
* **commit** (:mod:`validator.commit`): publish the signed aggregate (revealing the secret,
  committing to the next one, opening window t + 1), advance the state, a checkpoint every
  ``checkpoint_every`` windows, the retention policy, rows for late uploads.

The swarm is open: identities cost nothing, so nothing here assumes honest peers are the majority.
New identities are on probation until scored (:mod:`validator.reputation`); norms are compared
with and clipped to a reference learned from earlier accepted updates, never the window's median
(:mod:`validator.reference`); what is scored is unknown until uploads close
(:mod:`validator.randomness`).

Crash safety: decisions are written (status ``decided``) before the aggregate is put, and the state
file moves to t + 1 after it; a restart — or the retry after a store error — adopts an aggregate it
finds already published for its window, and otherwise re-decides the window (rows are keyed by
(window, peer) and reputation is derived from them, so nothing is lost or counted twice). Deciding
never writes θ_t, so a store error in any phase leaves nothing to restore. The published Δ̄ is the
bfloat16-rounded or re-compressed form of the aggregate (:mod:`protocol.broadcast`), and θ_{t+1}
is θ_t minus exactly that; with re-compression the validator's error-feedback buffer is written
ahead of the put (``validator/state.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from protocol import layout
from protocol.config import RunSpec
from protocol.data.run_data import dataset_of, run_tokenizer
from protocol.data.tokens import TokenDataset
from protocol.errors import ConfigError, ObjectNotFound, ProtocolError, StoreError
from protocol.events import Event, ModelEvaluated, WindowOpened, WindowPublished, WindowRetry
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import build_model
from protocol.quorum import Quorum
from protocol.replay import Chain
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.store.fetch import FINAL, Retry
from validator.agreement import Agreement
from validator.budgets import Budgets
from validator.commit import Committer
from validator.decide import Decider, WindowDecision
from validator.evaluation import PeriodicEval
from validator.follow import Follower
from validator.gather import PeerRegistry
from validator.hold import RestartHold
from validator.intake import Intake
from validator.launch import Launcher, LaunchStopped
from validator.log import LOG_FILE, ContributionLog
from validator.reputation import Standing
from validator.retry import Retries, bound_s
from validator.rows import folded
from validator.state import ValidatorState
from validator.trial import Aggregator
from validator.window import PhaseClock, open_window

__all__ = ["LOG_FILE", "Validator"]

log = logging.getLogger(__name__)


class Validator:
    """One validator of one run: the phases of a window (:mod:`validator.intake`,
    :mod:`validator.decide`, :mod:`validator.commit`) and its launch (:mod:`validator.launch`),
    each owning its part of the state; the live model holds θ of the open window.

    ``budgets``: what a window may cost this validator (:class:`~validator.budgets.Budgets`;
    local, not part of the RunSpec)."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state_dir: str | Path,
        *,
        device: str = "cpu",
        local: LocalSettings | None = None,
        emit: Callable[[Event], None] | None = None,
        clock: Callable[[], float] = time.time,
        budgets: Budgets | None = None,
        fault: str = "",
    ) -> None:
        if identity.public_key_hex not in spec.validator.public_keys:
            raise ConfigError(
                f"this validator's public key {identity.public_key_hex} is not in validator.public_keys of the "
                "RunSpec; peers would reject its aggregates (run `sparseloco-validator keygen`)"
            )
        self.spec, self.store, self.identity = spec, store, identity
        self.run_hash = spec.hash()
        self.local = local = local or LocalSettings()
        budgets = budgets or local.budgets
        state_dir = Path(state_dir)
        self.log = ContributionLog(state_dir / LOG_FILE)
        self.device = torch.device(device)
        workers = local.validator.workers or os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="validator")  # decoding, clipping, summing
        self.model = build_model(spec.model).to(self.device)  # θ of the open window (Committer loads it)
        self.dataset = _open_dataset(spec, store, local)  # scoring reads the peers' dataset
        self.periodic = PeriodicEval(
            every=local.validator.eval_every,
            sequences=local.validator.eval_sequences,
            dataset=self.dataset,
            data=spec.data,
            tokenizer=lambda: run_tokenizer(spec, store, local.data),
        )
        self.stop = threading.Event()
        self.emit = emit or _ignore  # WindowOpened, WindowWaiting, WindowPublished, WindowRetry
        self._gathering: int | None = None  # the window whose WindowOpened was emitted last
        chain = Chain(spec, store)  # the signed chain, read and replayed as every peer does
        self.launcher = Launcher(
            spec,
            store,
            identity,
            state_dir,
            chain=chain,
            clock=clock,
            wait=self.stop.wait,
            poll_s=local.poll_interval_s,
        )
        self.intake = Intake(
            spec, store, identity, self.log, local=local, budgets=budgets, clock=clock, emit=self.emit, stop=self.stop
        )
        aggregator = Aggregator(spec, self.model, self.dataset, self.pool, workers=workers, device=self.device)
        self.decider = Decider(spec, self.model, self.dataset, aggregator, device=self.device)
        self.committer = Committer(
            spec,
            store,
            identity,
            state_dir,
            self.log,
            self.model,
            local=local,
            clock=clock,
            emit=self.emit,
            max_late=budgets.max_fetches,
        )
        self.clock = clock
        self.hold = RestartHold(
            self.intake.registry,
            limit_s=local.validator.restart_hold_s,
            poll_s=local.poll_interval_s,
            emit=self.emit,
            stop=self.stop,
            clock=clock,
        )
        self.agreement: Agreement | None = None  # several validators: each window agreed on first
        if Quorum.of(spec).several:
            self.agreement = Agreement(
                spec,
                store,
                identity,
                state_dir,
                self.log,
                Follower(spec, store, aggregator),
                self.committer,
                chain,
                clock=clock,
                emit=self.emit,
                wait=self.stop.wait,
                poll_s=local.poll_interval_s,
                fault=fault,
            )
        elif fault:
            raise ConfigError(f"fault {fault!r} needs a run with several validators")

    @property
    def run_id(self) -> str:
        """The run's prefix in the store."""
        return layout.run_id(self.run_hash)

    @property
    def registry(self) -> PeerRegistry:
        """The announced peers (:class:`validator.gather.PeerRegistry`), as the intake tracks them."""
        return self.intake.registry

    @property
    def budgets(self) -> Budgets:
        """What a window may cost this validator, as the intake spends it."""
        return self.intake.budgets

    @property
    def state(self) -> ValidatorState | None:
        """Where the validator stands (None before :meth:`resume`)."""
        return self.committer.state

    @property
    def feedback(self) -> FeedbackState:
        """The re-compression error-feedback buffer that opens the current window."""
        return self.committer.feedback

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.log.close()
        self.store.close()

    # ------------------------------------------------------------------ the loop
    def run(self, windows: int | None = None) -> list[WindowPublished]:
        """Resume (or start at genesis) and run ``windows`` windows (None: until stopped or
        the local setting ``max_windows``)."""
        try:
            state = self.state or self.resume()
        except LaunchStopped:  # stopped while waiting for another validator's genesis
            return []
        reports: list[WindowPublished] = []
        limit = self.local.max_windows
        retries = Retries(self.local.validator.window_retries, self.local.poll_interval_s)
        while not self.stop.is_set() and (windows is None or len(reports) < windows):
            if limit and state.window >= limit:
                break
            try:
                report = self.run_window()
            except StoreError as exc:  # a value at the window boundary: retry (or adopt what got out)
                self._retry(state.window, exc, retries)  # WindowFailed past validator.window_retries
                state = self._state()
                continue
            if report is None:  # stopped mid-window: nothing published, a restart redoes it
                break
            reports.append(report)
            self._evaluate(report)
            state = self._state()
        return reports

    def _retry(self, window: int, exc: StoreError, retries: Retries) -> None:
        """Wait before the next attempt of ``window`` (:mod:`validator.retry`), then adopt the
        aggregate if it got out; a store error while looking for it is one more failure."""
        while True:
            wait = retries.failed(window, exc)
            self.emit(
                WindowRetry(
                    window=window,
                    reason=exc.reason,
                    detail=str(exc),
                    attempt=retries.attempts,
                    limit=retries.limit,
                    wait_s=wait,
                )
            )
            if self.stop.wait(wait):
                return
            try:
                self._adopt_published()
                return
            except StoreError as again:
                exc = again

    def run_window(self) -> WindowPublished | None:
        st, clock = self._state(), PhaseClock()
        self._opened(st)
        w = open_window(st.window, self.identity, self.run_hash, self._standings(st.window), self.spec.validator)
        ctx = self.intake.context(w, st)  # registered keys, exclusions, accepted bases, the sample
        gathered = self.intake.gather(w, st.opened_at, ctx)  # announced peers only, within budgets
        if self.stop.is_set():
            return None
        held = self.agreement is None and self.hold.needed(w.t, gathered)  # restarted, nobody back yet
        if held and not self.hold.wait(w.t):
            return None
        clock.lap("gather")
        uploads = self.intake.uploads(w.t, gathered, ctx)  # read, checked and summarised while gathering

        def decide(view: int = 0) -> WindowDecision:  # window checks, seed, scores, capacity, the aggregate
            return self.decider.decide(
                w, uploads, reference=st.reference, params=st.params, feedback=self.committer.feedback, clock=clock
            )

        self.committer.record_late(w.t - 1, self.registry.announcements)  # uploads that missed the previous window
        if self.agreement is not None:  # several validators: proposed, endorsed, certified
            read = {s.peer: s.held.data for s in uploads.screened if s.held is not None and s.held.data}
            report = self.agreement.run(st, self.clock(), decide, uploads.unannounced, read)
        else:
            report = self.committer.publish(st, decide(), uploads.unannounced, clock)
        if report is not None:
            self.hold.published()
        return report

    def heard_from(self, peer: str) -> None:
        """``peer`` asked the grant server for something: it is alive (ends a restart's hold,
        :mod:`validator.hold`)."""
        self.hold.heard_from(peer)

    def _evaluate(self, report: WindowPublished) -> None:
        """The periodic evaluation of θ after the aggregate just published, when due."""
        if not self.periodic.due(report.window):
            return
        try:
            rec = self.periodic.evaluate(self.model, report.window, report.fingerprint, self.device)
        except StoreError as exc:  # data or tokenizer unavailable: the next due window tries again
            log.warning("θ after window %d is not evaluated: %s", report.window, exc)
            return
        self.log.record_evaluation(rec)
        self.emit(
            ModelEvaluated(
                window=rec.window,
                fingerprint=rec.fingerprint,
                sequences=rec.sequences,
                loss=rec.loss,
                perplexity=rec.perplexity,
                bits_per_byte=rec.bits_per_byte,
                seconds=rec.seconds,
            )
        )

    def _opened(self, st: ValidatorState) -> None:
        """Emit WindowOpened once per window gathered by this process (a retry does not reopen it)."""
        if self._gathering != st.window:
            self._gathering = st.window
            self.emit(WindowOpened(window=st.window, base=st.base, opened_at=st.opened_at))

    # ------------------------------------------------------------------ start / resume
    def resume(self) -> ValidatorState:
        """Stand where the state directory and the store say this validator stopped
        (:mod:`validator.launch`), past every aggregate already published."""
        resumed = self.launcher.resume()
        state = resumed.state
        if state.standings is None:  # a state directory of an older version: folded from the log once
            state = replace(state, standings=self._folded(state.window))
        self.committer.start(state, resumed.theta_window)
        self._adopt_published()
        return self._state()

    def _adopt_published(self) -> None:
        """Apply aggregates already published for the saved window (a crash after publishing, or a
        lost state directory): the chain in the store is the truth."""
        while (found := self.launcher.published(self._state())) is not None:
            agg, params = found
            ref = None if self.agreement is None else self.agreement.reference_after(agg)
            self.committer.adopt(agg, params, ref=ref)

    # ------------------------------------------------------------------ helpers
    def _state(self) -> ValidatorState:
        return self.committer.current()

    def _standings(self, t: int) -> dict[str, Standing]:
        """Every peer's standing before window ``t``: for the open window the standings saved with
        the state (folded one window at a time, :meth:`validator.commit.Committer.advance`), so that
        a window's cost does not grow with history; for any other window, folded from the log."""
        st = self._state()
        if t == st.window and st.standings is not None:
            return st.standings
        return self._folded(t)

    def _folded(self, t: int) -> dict[str, Standing]:
        """The standings before window ``t`` from the whole log (older state directories, diagnostics)."""
        return folded(self.log, self.spec.validator, t)


def _open_dataset(spec: RunSpec, store: ObjectStore, local: LocalSettings) -> TokenDataset:
    """The run's dataset (its manifest verified now; shards are fetched when scoring needs them).
    A run without a usable dataset manifest cannot be validated: ConfigError. A store that does
    not answer yet (the validator restarted beside it, a link drop) is waited for, said once, as
    long as a window would retry (:func:`validator.retry.bound_s`) before the error ends the start."""
    said: list[bool] = []

    def read() -> TokenDataset:
        try:
            return dataset_of(spec, store, local.data)
        except StoreError as exc:
            if not said and not isinstance(exc, FINAL):
                said.append(True)
                log.warning("the store does not answer (%s): waiting up to %.0f s for the run's dataset", exc, patience)
            raise

    patience = bound_s(local.validator.window_retries, max(local.poll_interval_s, 1.0))
    try:
        return Retry(None, backoff_s=1.0, patience_s=patience).run(read)
    except ObjectNotFound as exc:
        raise ConfigError(
            f"the store holds no dataset manifest for run {layout.run_id(spec.hash())} ({exc}): create the run "
            "with `sparseloco-validator init`, or check store.url"
        ) from exc
    except ProtocolError as exc:
        raise ConfigError(f"the run's dataset manifest does not verify: {exc}") from exc


def _ignore(event: Event) -> None:
    """The default event sink: a Validator driven from code reads run_window's return value instead."""
