"""The validator: one window at a time, every phase a call.

    v = Validator(spec, open_from_settings(local.store), Identity.load(key), state_dir, local=local,
                  emit=EventWriter(sys.stdout))
    v.run(windows=10)            # resumes where the state directory and the store say it stopped

It reports through ``emit`` (:mod:`protocol.events`): WindowOpened when it starts gathering a
window, WindowWaiting while expected peers have not uploaded (every few seconds, naming them),
WindowPublished (also ``run_window``'s return value), WindowRetry after a store error and, with
``validator.eval_every`` (a local setting), ModelEvaluated (:mod:`validator.evaluation`).

Per window t (docs/ARCHITECTURE.md, "One window, end to end"): gather the uploads of announced,
non-excluded peers under ``contrib/<t>/``, within the window's budgets, until the deadline or until
every expected peer has uploaded (announced, not withdrawn, not excluded, and uploaded in window
t − 1 or announced since it opened: :func:`validator.gather.expected_peers`); run the cheap checks as each one is read; compare norms with the
validator's reference and look for copies; fix the window's seed (its secret, committed one window
earlier, mixed with the digests of what was received) and score a budgeted sample by loss, in the
clipped form that would be aggregated; decide (probation, capacity); aggregate the accepted ones,
dropping any whose update would make θ or the loss non-finite; publish the signed aggregate
(revealing the secret, committing to the next one, opening window t + 1) and, every
``checkpoint_every`` windows, a checkpoint. Every decision about an announced peer is a row of the
contribution log.

The swarm is open: identities cost nothing, so nothing here assumes honest peers are the majority.
New identities are on probation until scored (:mod:`validator.reputation`); norms are compared
with and clipped to a reference learned from earlier accepted updates, never the window's median
(:mod:`validator.reference`); what is scored is unknown until uploads close
(:mod:`validator.randomness`).

Crash safety: decisions are written (status ``decided``) before the aggregate is put, and the state
file moves to t + 1 after it; a restart adopts an aggregate it finds already published for its
window, and otherwise re-decides the window (rows are keyed by (window, peer) and reputation is
derived from them, so nothing is lost or counted twice). The published Δ̄ is the bfloat16-rounded or
re-compressed form of the aggregate (:mod:`protocol.broadcast`), and θ_{t+1} is θ_t minus exactly
that; with re-compression the validator's error-feedback buffer is written ahead of the put
(``validator/state.py``).

Launches: the chain grows from the digest of a genesis manifest (:mod:`protocol.chain`). Without a
state directory the validator continues the launch whose genesis the store holds, or publishes a
new genesis; with one, it continues only its own launch and refuses a store holding another
(``ConfigError``). Objects of other launches, and anything at a chain key that does not verify, are
never adopted: they are overwritten when the validator publishes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocol import broadcast, layout
from protocol.aggregate import NormLimit, SparseDict, SparseSum, apply_outer, clip_to_limits
from protocol.caps import object_caps
from protocol.chain import checkpoint_base
from protocol.config import RunSpec
from protocol.data.assignment import assigned_batches, validation_batches
from protocol.data.run_data import dataset_of, run_tokenizer
from protocol.data.tokens import TokenDataset
from protocol.errors import ConfigError, DigestMismatch, ObjectNotFound, ProtocolError, StoreError
from protocol.events import Event, ModelEvaluated, WindowOpened, WindowPublished, WindowRetry, WindowWaiting
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import build_model, eval_loss, fingerprint, param_schema, parameters_of
from protocol.outcomes import OUTCOMES, PeerOutcome, encode_outcomes, outcomes_digest
from protocol.replay import Chain, Position, apply_aggregate, initial_params, replayed
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.windows import gather_close, is_checkpoint_window
from protocol.wire import GENESIS, Aggregate, AggregateTensor, CheckpointManifest, Verified
from validator import checks, publish, randomness, reference, retention, window_checks
from validator.budgets import Budgets
from validator.consensus import agreement
from validator.copies import CopyRule
from validator.evaluation import PeriodicEval
from validator.gather import (
    EXCLUDED,
    OVER_BUDGET,
    UNANNOUNCED,
    Gathered,
    PeerRegistry,
    Received,
    gather,
    list_contributions,
)
from validator.held import Held, clipped_entries, decoded
from validator.held import decode as held_decode
from validator.log import LOG_FILE, CheckRow, ContributionLog, ContributionRecord, WindowRecord
from validator.reputation import (
    LATE,
    UNATTRIBUTABLE_CHECKS,
    Standing,
    is_established,
    is_excluded,
    standings,
    update,
)
from validator.scoring import (
    LossScore,
    plan_sample,
    probation_order,
    score_update,
    scoring_batches,
    scoring_units,
    suspicion_order,
    take_sequences,
)
from validator.sketch import Sketcher, expected_nnz, offsets, sample_every
from validator.state import (
    ValidatorState,
    load_feedback,
    load_state,
    prune_feedback,
    save_feedback,
    save_state,
)

__all__ = ["LOG_FILE", "Validator"]

# How often the validator re-reads the announcement of a peer it waits for (a withdrawal ends the
# wait) and reports whom it waits for.
RECHECK_S = 1.0
WAITING_REPORT_S = 5.0
# An announcement tracked this long (in upload deadlines) by an identity with no record may make
# room for others when the registry is full.
IDLE_WINDOWS = 4
# Keys the retention policy deletes after one publish at most: a long run that turns retention on
# spreads its backlog over the next windows (`sparseloco-validator gc` collects it at once).
MAX_DELETES_PER_WINDOW = 1000
# θ is written to the state directory at checkpoint windows, and at least this often (a run without
# checkpoints still restarts by replaying a bounded number of aggregates).
THETA_EVERY = 64

log = logging.getLogger(__name__)
Limits = Mapping[str, NormLimit] | None  # one contribution's clip caps (None: not clipped)


class _PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = round(now - self._last, 3)
        self._last = now


@dataclass(frozen=True)
class _Window:
    """What the phases of one window share: its number, secret, the standings before it, and who
    is past probation."""

    t: int
    secret: bytes
    standing: Mapping[str, Standing]
    established: frozenset[str]


@dataclass(frozen=True)
class _Result:
    """An aggregate that keeps θ finite: Δ̄'s published form (:mod:`protocol.broadcast`), the
    validator's error-feedback buffer after it, θ_{t+1} (θ_t minus exactly the published form), its
    validation loss (None: not finite) and the contributions left out to get there."""

    tensors: dict[str, AggregateTensor]
    feedback: FeedbackState
    params: dict[str, torch.Tensor]
    val_loss: float | None
    dropped: frozenset[str] = frozenset()


class Validator:
    """Owns θ_t, the store handle, the contribution log and the state directory.

    ``budgets``: what a window may cost this validator (:class:`~validator.budgets.Budgets`;
    local, not part of the RunSpec; default: the local settings' ``budgets``)."""

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
    ) -> None:
        if identity.public_key_hex not in spec.validator.public_keys:
            raise ConfigError(
                f"this validator's public key {identity.public_key_hex} is not in validator.public_keys of the "
                "RunSpec; peers would reject its aggregates (run `sparseloco-validator keygen`)"
            )
        self.spec, self.store, self.identity = spec, store, identity
        self.local = local or LocalSettings()
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.state_dir = Path(state_dir)
        self.log = ContributionLog(self.state_dir / LOG_FILE)
        self.device = torch.device(device)
        self.schema = param_schema(spec.model)
        self.offsets = offsets(self.schema)  # one global index space for sampled entries
        self.sample_every = sample_every(expected_nnz(self.schema, spec.codec))
        self.workers = self.local.validator.workers or os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="validator")  # decoding, clipping, summing
        self.model = build_model(spec.model).to(self.device)
        self.dataset = _open_dataset(spec, store, self.local)  # scoring reads the peers' dataset
        self.periodic = PeriodicEval(
            every=self.local.validator.eval_every,
            sequences=self.local.validator.eval_sequences,
            dataset=self.dataset,
            data=spec.data,
            tokenizer=lambda: run_tokenizer(spec, store, self.local.data),
        )
        self.stop = threading.Event()
        self.emit = emit or _ignore  # WindowOpened, WindowWaiting, WindowPublished, WindowRetry
        self._gathering: int | None = None  # the window whose WindowOpened was emitted last
        self.clock = clock
        self.budgets = budgets or self.local.budgets
        self.registry = PeerRegistry(
            store,
            self.run_id,
            self.run_hash,
            clock,
            secret=randomness.window_secret(identity, self.run_hash, -1),  # never revealed
            max_per_poll=self.budgets.max_announcements_per_poll,
            max_tracked=self.budgets.max_tracked_peers,
        )
        self.signers = sorted(set(spec.validator.public_keys))
        v = self.local.validator
        self.retention = retention.Retention(v.retain_windows, v.retain_checkpoint_every)
        self.caps = object_caps(spec)
        self.chain = Chain(spec, store)  # the signed chain, read and replayed as every peer does
        self.state: ValidatorState | None = None
        self.feedback = FeedbackState()  # the re-compression buffer that opens the current window
        self._theta_window = 0  # the window whose θ the state directory holds

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.log.close()
        self.store.close()

    # ------------------------------------------------------------------ the loop
    def run(self, windows: int | None = None) -> list[WindowPublished]:
        """Resume (or start at genesis) and run ``windows`` windows (None: until stopped or
        the local setting ``max_windows``)."""
        state = self.state or self.resume()
        reports: list[WindowPublished] = []
        limit = self.local.max_windows
        while not self.stop.is_set() and (windows is None or len(reports) < windows):
            if limit and state.window >= limit:
                break
            try:
                report = self.run_window()
            except StoreError as exc:  # a value at the window boundary: retry (or adopt what got out)
                self.emit(WindowRetry(window=state.window, reason=exc.reason, detail=str(exc)))
                self.stop.wait(self.local.poll_interval_s)
                self._adopt_published()
                state = self._state()
                self._load_params(state.params)  # the model may hold the unpublished θ_{t+1}
                continue
            if report is None:  # stopped mid-window: nothing published, a restart redoes it
                break
            reports.append(report)
            self._evaluate(report)
            state = self._state()
        return reports

    def run_window(self) -> WindowPublished | None:
        st, clock = self._state(), _PhaseClock()
        t, cfg = st.window, self.spec.validator
        self._opened(st)
        standing = self._standings(t)
        w = _Window(
            t=t,
            secret=randomness.window_secret(self.identity, self.run_hash, t),
            standing=standing,
            established=frozenset(p for p, s in standing.items() if is_established(s, cfg)),
        )
        ctx = self._context(w, st)  # registered keys, exclusions, accepted bases, the sample
        gathered = self._gather(w, st.opened_at, ctx)  # announced peers only, within budgets
        if self.stop.is_set():
            return None
        clock.lap("gather")
        received = gathered.received
        screened, read_at, listed_at = self._screened(t, received)  # read, checked and summarised while gathering
        screened = window_checks.norms(
            screened, st.reference, max_ratio=cfg.norm_max_ratio, min_ratio=cfg.norm_min_ratio
        )
        rule = CopyRule(cfg.copy_overlap_threshold, cfg.copy_rare_threshold, cfg.copy_sign_agreement)
        screened = window_checks.copies(screened, read_at, rule, listed_at)
        clock.lap("checks")
        live = {s.peer: s.held for s in screened if s.reason is None and s.held is not None}
        root = randomness.contributions_root({p: h.digest for p, h in live.items()})
        seed = randomness.window_seed(w.secret, root)
        limits = self._limits(st.reference, [h for p, h in live.items() if p in w.established])
        newcomer_limits = self._newcomer_limits(limits, st.reference)
        caps = {p: limits if p in w.established else newcomer_limits for p in live}
        scores = self._score(w, live, caps, ctx, seed)  # budgeted, on the clipped form
        screened = window_checks.scores(screened, scores, cfg.eval_harm_tolerance, self._min_gain(w, scores))
        screened = window_checks.probation(screened, w.established, scores)
        ref, bootstrapped = st.reference, False
        if ref.empty:  # no history yet: start one
            ref, first = self._bootstrap(screened, scores, live)
            if self.spec.outer.clip == "median":
                caps = {p: first for p in live}
            bootstrapped = not ref.empty
        screened = window_checks.capacity(screened, self._rank(w, scores, seed), cfg.max_contributors)
        clock.lap("scoring")
        accepted = sorted(s.peer for s in screened if s.reason is None)  # order-free Δ̄
        result = self._aggregate(st, {p: live[p] for p in accepted}, caps)  # decoded again, clipped, summed
        screened = window_checks.stable(screened, result.dropped)
        clock.lap("aggregate")
        rows = self._decide(screened, received, scores, w)  # reputation, weights
        self._record_late(t - 1)  # uploads that missed the previous window are accounted for too
        nxt_ref = ref if bootstrapped else self._advance_reference(ref, screened, w)
        meta: dict[str, int | float | str | bool] = {
            randomness.SECRET: w.secret.hex(),
            randomness.COMMITMENT: randomness.commitment(randomness.window_secret(self.identity, self.run_hash, t + 1)),
            randomness.ROOT: root,
        }
        return self._publish(t, st, rows, result, meta, nxt_ref, gathered.unannounced, clock)

    def _evaluate(self, report: WindowPublished) -> None:
        """The periodic evaluation of θ after the aggregate just published, when due."""
        if not self.periodic.due(report.window):
            return
        rec = self.periodic.evaluate(self.model, report.window, report.fingerprint, self.device)
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
        saved = load_state(self.state_dir, self.run_hash)
        state = self._genesis() if saved is None else self._replayed(self._same_launch(saved))
        if state.standings is None:  # a state directory of an older version: folded from the log once
            state = replace(state, standings=self._folded(state.window))
        self._load_params(state.params)
        self.state = state
        self.feedback = self._saved_feedback(state.window, state.base)
        self._adopt_published()
        return self._state()

    def _genesis(self) -> ValidatorState:
        """Without a state: continue the launch whose genesis the store holds (a lost state
        directory: the chain in the store is the truth), or start a new launch by publishing a
        genesis manifest, whose digest roots the chain. A genesis that does not verify counts as
        absent; objects of earlier launches never chain onto a new one."""
        params = initial_params(self.spec.model)
        launch = self._stored_launch()
        if launch is not None and launch.value.fingerprint != fingerprint(params):
            raise ConfigError("the store's genesis checkpoint differs from θ₀ built from this RunSpec")
        if launch is None:
            launch = self._publish_genesis(params, self.clock())
        at = launch.value.published_at
        state = ValidatorState(
            self.run_hash,
            0,
            launch.digest,
            at,
            params,
            launch=launch.digest,
            launched_at=at,
            previous_base=launch.digest,
            standings={},
        )
        state = self._from_checkpoint(state) or state
        save_state(self.state_dir, state)
        self._theta_window = state.window
        return state

    def _from_checkpoint(self, genesis: ValidatorState) -> ValidatorState | None:
        """When the aggregates after genesis are gone (retention, ``sparseloco-validator gc``),
        continue the store's launch from its newest checkpoint that verifies (what a joining peer
        loads); None when aggregate 0 is still there (the whole chain is replayed) or no later
        checkpoint verifies."""
        if self._next_aggregate(genesis.window, genesis.base) is not None:
            return None
        for window in reversed([w for w in self.chain.checkpoint_windows() if w > 0]):
            try:
                verified = self.chain.manifest(window)
                base = checkpoint_base(verified, genesis.launch)
                params = self.chain.checkpoint_params(verified.value)
            except (ProtocolError, StoreError) as exc:
                log.warning("checkpoint %d cannot restart the validator: %s", window, exc)
                continue
            # The aggregate before ``base`` is not known from a checkpoint: a delayed run accepts only
            # contributions on ``base`` in this first window.
            at = verified.value.published_at
            return replace(genesis, window=window, base=base, previous_base=base, opened_at=at, params=params)
        return None

    def _same_launch(self, state: ValidatorState) -> ValidatorState:
        """A saved state continues its own launch only: the store's genesis must be that launch
        (written again, byte for byte, when the store lost it); another launch is a ConfigError."""
        stored = self._stored_launch()
        if stored is None:
            params = initial_params(self.spec.model)
            stored = self._publish_genesis(params, state.launched_at)
        if stored.digest != state.launch:
            raise ConfigError(
                f"the store holds launch {stored.digest[:16]} of this run, but the state in {self.state_dir} "
                f"continues launch {state.launch[:16]}: use a store without the other launch, or move "
                "the state directory away to continue the store's launch"
            )
        return state

    def _replayed(self, state: ValidatorState) -> ValidatorState:
        """θ of the saved window: θ as last written (at a checkpoint window; θ₀ when none was) with
        the aggregates published since applied, each checked against its signed fingerprint, and
        the chain checked against the saved base (:mod:`validator.state`)."""
        if state.current:
            self._theta_window = state.window
            return state
        w = state.params_window or 0
        params = state.params or initial_params(self.spec.model)
        base = state.params_base or state.launch
        try:
            pos = replayed(self.chain, params, Position(w, base, ""), until=state.window)
        except DigestMismatch as exc:
            raise ConfigError(f"the saved θ does not reproduce the chain's fingerprints: {exc}") from exc
        if pos.window != state.window:
            raise ConfigError(
                f"cannot rebuild θ of window {state.window} from θ of window {w} in {self.state_dir}: "
                f"aggregate {pos.window} is not in the store"
            )
        base = pos.base
        if base != state.base:
            raise ConfigError(f"the store's chain up to window {state.window} is not the one saved in {self.state_dir}")
        self._theta_window = w
        return replace(state, params=params, params_window=None, params_base=None)

    def _next_aggregate(self, window: int, base: str) -> Verified[Aggregate] | None:
        return self.chain.next_aggregate(window, base)

    def _stored_launch(self) -> Verified[CheckpointManifest] | None:
        """The store's genesis manifest; None when there is none or it does not verify."""
        try:
            return self.chain.launch()
        except ObjectNotFound:
            return None
        except ProtocolError as exc:
            log.warning("the store's genesis manifest does not verify; treated as absent: %s", exc)
            return None

    def _publish_genesis(self, params: dict[str, torch.Tensor], published_at: float) -> Verified[CheckpointManifest]:
        return publish.publish_checkpoint(
            self.store,
            self.run_id,
            self.run_hash,
            0,
            aggregate=GENESIS,
            params=params,
            identity=self.identity,
            published_at=published_at,
        )

    def _adopt_published(self) -> None:
        """Apply aggregates already published for the saved window (a crash after publishing, or a
        lost state directory): the chain in the store is the truth. What lies at the key without
        verifying or chaining onto this state (junk, another launch's) is not published."""
        while True:
            st = self._state()
            agg = self._next_aggregate(st.window, st.base)
            if agg is None:
                return
            params = {n: p.detach().clone() for n, p in st.params.items()}
            try:
                apply_aggregate(params, Position(st.window, st.base, ""), agg)
            except DigestMismatch as exc:
                raise ConfigError(f"aggregate {st.window} does not reproduce its fingerprint from this state") from exc
            self._adopt_rows(agg)
            self._advance(
                st, agg.digest, agg.value.published_at, params, self._saved_feedback(st.window + 1, agg.digest)
            )

    def _saved_feedback(self, window: int, base: str) -> FeedbackState:
        """The re-compression buffer that opens ``window`` after ``base``, as written ahead of that
        aggregate's put. Empty without a buffer to keep (``broadcast.keeps_feedback``), at genesis,
        and when the state directory was lost (what it had not sent yet is then dropped, as a
        peer's would be)."""
        if not broadcast.keeps_feedback(self.spec.outer):
            return FeedbackState()
        return load_feedback(self.state_dir, window, base) or FeedbackState()

    def _adopt_rows(self, verified: Verified[Aggregate]) -> None:
        agg = verified.value
        win = self.log.window(agg.window)
        if win is None:  # decisions lost with the state directory: keep what the manifest proves
            rows = [
                ContributionRecord(window=agg.window, peer=m.peer_id, digest=m.digest, accepted=True, weight=m.weight)
                for m in agg.manifest
            ]
            win = WindowRecord(window=agg.window, accepted=len(rows), fingerprint=agg.fingerprint, base=agg.base)
            self.log.record_window(win, rows)
        self.log.mark_published(agg.window, digest=verified.digest, published_at=agg.published_at)

    # ------------------------------------------------------------------ phases
    def _context(self, w: _Window, st: ValidatorState) -> checks.Context:
        registered = self.registry.refresh()
        excluded = frozenset(p for p, s in w.standing.items() if is_excluded(s, w.t))
        return checks.Context(
            run_hash=self.run_hash,
            window=w.t,
            expected_base=st.base,
            # One-window-delayed outer step: a peer trains window t from θ_{t−1} while aggregate
            # t−1 is published; its update is scored and applied against θ_t like any other.
            previous_base=st.previous_base if self.spec.outer.delay else None,
            codec=self.spec.codec,
            schema=self.schema,
            max_bytes=self.caps.contribution,
            registered=registered,
            excluded=excluded,
            sketch=Sketcher(self.offsets, self.sample_every, key=w.secret),  # peers cannot know the sample
        )

    def _gather(self, w: _Window, opened_at: float, ctx: checks.Context) -> Gathered:
        """Until the deadline, or until every expected peer (:func:`validator.gather.expected_peers`)
        uploaded. Identities without an upload in the previous window (newcomers) hold the window
        open only for ``budgets.newcomer_wait`` of the upload deadline."""
        t = w.t
        prev = self.log.rows(windows=(t - 1, t - 1)) if t > 0 else []
        uploaded_last = {r.peer for r in prev if _shows_activity(r)}  # forged or foreign uploads prove nothing
        opened_last = self.log.window(t - 1) if t > 0 else None
        since = opened_last.opened_at if opened_last is not None else None
        self.registry.make_room(uploaded_last | w.established, IDLE_WINDOWS * self.spec.windows.upload_deadline_s)
        newcomers_until = opened_at + self.budgets.newcomer_wait * self.spec.windows.upload_deadline_s
        waiting = _WaitingReport(t, gather_close(opened_at, self.spec.windows), self.clock, self.emit)

        def expected(uploaded: frozenset[str]) -> frozenset[str]:
            self.registry.refresh()
            # Re-read the announcements of the peers still awaited (a withdrawal ends the wait) and
            # of the withdrawn ones (a peer that comes back is expected again).
            awaited = self.registry.expected(uploaded_last, since) - uploaded
            self.registry.recheck(awaited | self.registry.withdrawn, RECHECK_S)
            want = self.registry.expected(uploaded_last, since) - ctx.excluded
            if since is not None and self.clock() >= newcomers_until:
                want = frozenset(p for p in want if p in uploaded_last or p in uploaded)
            waiting.report(want - uploaded, len(uploaded))
            return want

        def admit(peer: str) -> str | None:
            if peer not in self.registry.announcements:
                return UNANNOUNCED
            return EXCLUDED if peer in ctx.excluded else None

        def priority(peer: str) -> tuple[int, float, bytes]:
            st = w.standing.get(peer)
            rep = st.reputation if st is not None else 0.0
            return (0 if peer in w.established else 1, -rep, randomness.keyed_key(w.secret, "fetch", peer))

        def screen(peer: str, data: bytes) -> checks.Screened:
            # admitted peers are announced; checking against this one avoids sharing the registry across threads
            return checks.screen(peer, data, replace(ctx, registered=frozenset({peer})))

        return gather(
            self.store,
            self.run_id,
            w.t,
            opened_at=opened_at,
            windows=self.spec.windows,
            poll_interval_s=self.local.poll_interval_s,
            max_bytes=self.caps.contribution,
            concurrency=self.local.validator.gather_concurrency,
            expected=expected,
            admit=admit,
            screen=screen,
            priority=priority,
            budgets=self.budgets,
            stop=self.stop,
            clock=self.clock,
        )

    def _screened(
        self, t: int, received: Mapping[str, Received]
    ) -> tuple[list[checks.Screened], dict[str, float], dict[str, float]]:
        """The per-contribution verdicts, when each peer's bytes were first read (kept in the log
        across restarts) and its key listed, and the ``immutable`` check against the first digest."""
        out: list[checks.Screened] = []
        read_at: dict[str, float] = {}
        listed_at: dict[str, float] = {}
        first_digest: dict[str, str | None] = {}
        for peer in sorted(received):
            r = received[peer]
            read_at[peer] = r.received_at
            listed_at[peer] = r.received_at if r.listed_at is None else r.listed_at
            if r.screened is None:
                out.append(_unread(r))
                continue
            if r.screened.held is not None:  # signed by the peer: its bytes, its time
                first, first_digest[peer] = self.log.note_received(
                    t, peer, received_at=r.received_at, nbytes=r.nbytes, digest=r.screened.held.digest
                )
                if first < r.received_at:  # read before a restart: when it was listed is unknown
                    read_at[peer], listed_at[peer] = first, -math.inf
            out.append(r.screened)
        return window_checks.immutable(out, first_digest), read_at, listed_at

    def _limits(self, ref: reference.NormReference, established: Sequence[Held]) -> dict[str, NormLimit] | None:
        """The clip caps of this window (None: no reference yet, or the run does not clip)."""
        cfg = self.spec.validator
        if ref.empty or self.spec.outer.clip != "median":
            return None
        norms = [h.norms for h in established]
        return reference.clip_limits(ref, norms, self.schema, headroom=cfg.clip_headroom, rows=cfg.row_clip)

    def _newcomer_limits(
        self, limits: Mapping[str, NormLimit] | None, ref: reference.NormReference
    ) -> dict[str, NormLimit] | None:
        """The caps for identities on probation: the window's, but never above the reference
        (no headroom until they have a record)."""
        if limits is None:
            return None
        out = {}
        for name, lim in limits.items():
            r = ref.tensors[name]
            rows = None if lim.rows is None else lim.rows / self.spec.validator.clip_headroom
            out[name] = replace(lim, norm=min(lim.norm, r.norm), row=min(lim.row, r.row), rows=rows)
        return out

    def _clip(self, sparse: SparseDict, limits: Mapping[str, NormLimit] | None) -> SparseDict:
        return sparse if limits is None else clip_to_limits([sparse], limits)[0]

    def _bootstrap(
        self, screened: Sequence[checks.Screened], scores: Mapping[str, LossScore], live: Mapping[str, Held]
    ) -> tuple[reference.NormReference, dict[str, NormLimit] | None]:
        """The first window with no history: the reference starts at the scored, accepted update that
        lowered the loss on its own data most; without one, the accepted updates' lower median."""
        standing = [s.peer for s in screened if s.reason is None]
        helped = [p for p in standing if p in scores]
        cfg = self.spec.validator
        if helped:
            best = max(helped, key=lambda p: (scores[p].own_gain, p))
            ref = reference.bootstrap(live[best].norms.tensors)
            limits = reference.clip_limits(ref, [live[best].norms], self.schema, headroom=1.0, rows=cfg.row_clip)
            return ref, limits
        if not standing:
            return reference.NormReference(), None
        median = reference.window_value([live[p].norms.tensors for p in standing])
        fallback = reference.NormReference(median)
        return reference.NormReference(), reference.clip_limits(fallback, [], self.schema, headroom=1.0, rows=False)

    def _score(
        self, w: _Window, live: Mapping[str, Held], caps: Mapping[str, Limits], ctx: checks.Context, seed: bytes
    ) -> dict[str, LossScore]:
        """Score a budgeted sample of units, ordered by agreement (on the clipped sampled entries);
        only the sampled contributions are decoded again."""
        cfg, data = self.spec.validator, self.spec.data
        roles = {p: a.role for p, a in self.registry.announcements.items() if p in live}
        units = scoring_units(live, roles, pipelines=self.spec.pipeline.enabled)
        known = [u for u, ps in units.items() if all(p in w.established for p in ps)]
        sk = ctx.sketch or Sketcher(self.offsets)
        entries = {p: clipped_entries(h, caps[p], sk, self.schema) for p, h in live.items()}
        agree = agreement(entries, w.established, np.array(sorted(self.offsets.values()), dtype=np.int64))
        unit_agree = {u: min(agree.get(p, 0.5) for p in ps) for u, ps in units.items()}
        sample = plan_sample(
            established=suspicion_order(known, unit_agree, seed),
            probation=probation_order([u for u in units if u not in known], unit_agree, seed),
            budget=cfg.eval_peers_per_window,
            probation_slots=cfg.eval_probation_peers,
            seed=seed,
        )
        if not sample:
            return {}
        rand = scoring_batches(self.dataset, seed, cfg.eval_sequences, data.batch_size, data.seq_len)
        rand_before = eval_loss(self.model, rand, self.device)
        scale = cfg.eval_scale * self.spec.outer.alpha
        out: dict[str, LossScore] = {}
        for key in sample:  # a peer, or the stages of one pipeline replica (disjoint slices)
            items = [(p, live[p]) for p in units[key]]
            update = {name: v for _, sp in self._clipped(items, caps) for name, v in sp.items()}
            own = take_sequences(
                assigned_batches(
                    self.dataset, self.spec.seed, key, w.t, self.spec.inner.steps, data.batch_size, data.seq_len
                ),
                cfg.eval_sequences,
            )
            score = score_update(
                self.model, update, own=own, random=rand, random_before=rand_before, scale=scale, device=self.device
            )
            out.update((peer, score) for peer in units[key])
        return out

    def _min_gain(self, w: _Window, scores: Mapping[str, LossScore]) -> float | None:
        """What a scored update must at least lower its own loss by: ``eval_min_gain_ratio`` × the
        lower median of the established peers' helpful updates in this window (None: none scored)."""
        gains = [sc.own_gain for p, sc in scores.items() if p in w.established and sc.own_gain > 0]
        if not gains:
            return None
        return self.spec.validator.eval_min_gain_ratio * reference.lower_median(gains)

    def _rank(self, w: _Window, scores: Mapping[str, LossScore], seed: bytes) -> Callable[[str], Any]:
        """Who is kept when too many pass: established peers first, then reputation so far plus
        this window's score if measured, then a draw from the window's seed (ids cannot be ground)."""

        def rank(peer: str) -> tuple[int, float, bytes]:
            st = w.standing.get(peer)
            value = (st.reputation if st is not None else 0.0) + (scores[peer].score if peer in scores else 0.0)
            value = value if math.isfinite(value) else -math.inf
            return (0 if peer in w.established else 1, -value, randomness.keyed_key(seed, "capacity", peer))

        return rank

    def _aggregate(self, st: ValidatorState, held: Mapping[str, Held], caps: Mapping[str, Limits]) -> _Result:
        """Δ̄ of the ``held`` contributions, each clipped to its ``caps``; if θ_{t+1} or its
        validation loss would not be finite, the contributions responsible are found by bisection
        and left out (nothing non-finite is ever signed)."""
        full = self._try(st, held, caps, sorted(held))
        if full is not None:
            return full
        dropped = frozenset(_culprits(sorted(held), lambda ps: self._try(st, held, caps, ps) is not None))
        kept = sorted(set(held) - dropped)
        result = self._try(st, held, caps, kept)
        if result is None:  # only together do they break it: publish nothing rather than guess
            dropped, result = frozenset(held), self._try(st, held, caps, [], require_loss=False)
        assert result is not None  # an empty Δ̄ leaves θ_t, which is finite
        return replace(result, dropped=dropped)

    def _try(
        self,
        st: ValidatorState,
        held: Mapping[str, Held],
        caps: Mapping[str, Limits],
        peers: Sequence[str],
        require_loss: bool = True,
    ) -> _Result | None:
        o = self.spec.outer
        total = SparseSum(self.schema)
        batch: list[SparseDict] = []
        for _, sparse in self._clipped([(p, held[p]) for p in peers], caps):  # decoded a few at a time
            batch.append(sparse)
            if len(batch) >= self.workers:
                total.add(batch, self.pool)
                batch = []
        total.add(batch, self.pool)
        delta = total.mean(o.aggregation)
        if not all(bool(torch.isfinite(v).all()) for _, v in delta.values()):
            return None
        tensors, feedback = broadcast.publishable(delta, self.schema, o, self.spec.codec, self.feedback)
        published = broadcast.applied(tensors)  # what is signed, not Δ̄ itself
        if not all(bool(torch.isfinite(v).all()) for _, v in published.values()):
            return None
        nxt = {n: p.detach().clone() for n, p in st.params.items()}
        apply_outer(nxt, published, o.alpha)
        if not all(bool(torch.isfinite(p).all()) for p in nxt.values()):
            return None
        self._load_params(nxt)
        loss = self._val_loss()
        if not math.isfinite(loss):
            if require_loss:
                return None
            return _Result(tensors, feedback, nxt, None)
        return _Result(tensors, feedback, nxt, loss)

    def _clipped(
        self, items: Sequence[tuple[str, Held]], caps: Mapping[str, Limits]
    ) -> Iterator[tuple[str, SparseDict]]:
        """Every item decoded again and clipped to its caps, in order, on the worker pool
        (:func:`validator.held.decoded`: a few in memory at a time)."""

        def work(peer: str, h: Held) -> SparseDict:
            return self._clip(held_decode(h, self.schema, self.spec.codec), caps[peer])

        return decoded(items, work, self.pool, 2 * self.workers)

    def _advance_reference(
        self, ref: reference.NormReference, screened: Sequence[checks.Screened], w: _Window
    ) -> reference.NormReference:
        """Move the reference towards the updates accepted from established peers (all accepted
        ones when none is established yet)."""
        accepted = [s for s in screened if s.reason is None]
        known = [s for s in accepted if s.peer in w.established] or accepted
        if not known or ref.empty:
            return ref
        value = reference.window_value([s.held.norms.tensors for s in known if s.held is not None])
        return reference.advance(ref, value, self.spec.validator.reference_step)

    def _decide(
        self,
        screened: list[checks.Screened],
        received: Mapping[str, Received],
        scores: Mapping[str, LossScore],
        w: _Window,
    ) -> list[ContributionRecord]:
        rows = []
        for s in sorted(screened, key=lambda s: s.peer):
            r, sc, h = received[s.peer], scores.get(s.peer), s.held
            accepted = s.reason is None
            st = update(
                w.standing.get(s.peer, Standing()),
                PeerOutcome(
                    s.peer, accepted, s.reason, sc.score if sc else None, window=w.t, check=_failed_check(s.checks)
                ),
                self.spec.validator,
            )
            rows.append(
                ContributionRecord(
                    window=w.t,
                    peer=s.peer,
                    received_at=r.received_at,
                    bytes=r.nbytes,
                    digest=h.digest if h else None,
                    accepted=accepted,
                    reason=s.reason,
                    detail=s.detail,
                    norm=h.norms.total if h and h.nnz else None,
                    overlap=s.overlap,
                    loss_own_before=sc.loss_own_before if sc else None,
                    loss_own_after=sc.loss_own_after if sc else None,
                    loss_random_before=sc.loss_random_before if sc else None,
                    loss_random_after=sc.loss_random_after if sc else None,
                    score=sc.score if sc else None,
                    reputation=st.reputation,
                    weight=1.0 if accepted else 0.0,
                    checks=s.checks,
                )
            )
        return rows

    def _publish(
        self,
        t: int,
        st: ValidatorState,
        rows: list[ContributionRecord],
        result: _Result,
        extra: Mapping[str, int | float | str | bool],
        ref: reference.NormReference,
        unannounced: int,
        clock: _PhaseClock,
    ) -> WindowPublished:
        fp = fingerprint(result.params)
        self._load_params(result.params)
        published_at = self.clock()
        accepted = [r for r in rows if r.accepted]
        outcomes = encode_outcomes(self.run_hash, t, [r.outcome() for r in rows])
        meta: dict[str, int | float | str | bool] = {
            **extra,
            "accepted": len(accepted),
            "rejected": len(rows) - len(accepted),
            OUTCOMES: outcomes_digest(outcomes),  # the peers' scores and reasons, vouched for here
        }
        if result.val_loss is not None:  # the wire refuses a non-finite number, and so do peers
            meta["val_loss"] = result.val_loss
        blob = publish.encode_window_aggregate(
            run_hash=self.run_hash,
            window=t,
            base=st.base,
            alpha=self.spec.outer.alpha,
            tensors=result.tensors,
            manifest=[(r.peer, r.digest or "", r.weight) for r in accepted],
            fingerprint_next=fp,
            published_at=published_at,
            metadata=meta,
            identity=self.identity,
        )
        win = WindowRecord(
            window=t,
            status="decided",
            opened_at=st.opened_at,
            closed_at=published_at,
            base=st.base,
            fingerprint=fp,
            val_loss=result.val_loss,
            accepted=len(accepted),
            rejected=len(rows) - len(accepted),
            unannounced=unannounced,
        )
        self.log.record_window(win, rows)
        publish.publish_outcomes(self.store, self.run_id, t, outcomes)
        if broadcast.keeps_feedback(self.spec.outer):  # write-ahead: the buffer after this aggregate exists first
            save_feedback(self.state_dir, t + 1, hashlib.sha256(blob).hexdigest(), result.feedback)
        publish.publish_aggregate(
            self.store,
            self.run_id,
            self.run_hash,
            t,
            blob,
            base=st.base,
            allowed_signers=self.signers,
            max_bytes=self.caps.aggregate,
        )
        digest = hashlib.sha256(blob).hexdigest()  # how the chain names it (its own bytes: nothing to verify)
        self.log.mark_published(t, digest=digest, published_at=published_at)
        self._advance(st, digest, published_at, result.params, result.feedback, ref)
        reasons: dict[str, int] = {}
        for r in rows:
            if r.reason:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
        if unannounced:
            reasons[UNANNOUNCED] = unannounced
        clock.lap("publish")
        report = WindowPublished(
            window=t,
            accepted=len(accepted),
            rejected=len(rows) - len(accepted),
            val_loss=result.val_loss if result.val_loss is not None else math.nan,
            digest=digest,
            fingerprint=fp,
            published_at=published_at,
            reasons=reasons,
            seconds=clock.seconds,
            uploaded=len(rows),
            download_bytes=sum(r.bytes or 0 for r in rows),
        )
        self.emit(report)
        return report

    def _advance(
        self,
        st: ValidatorState,
        digest: str,
        published_at: float,
        params: dict[str, torch.Tensor],
        feedback: FeedbackState,
        ref: reference.NormReference | None = None,
    ) -> None:
        """Move to window t + 1 after aggregate ``digest`` of window t: the window's rows folded into
        the standings, a checkpoint when due, then the state file (the commit point), with θ only at
        checkpoint windows (:mod:`validator.state`), then drop the error-feedback buffer of window t
        (``feedback`` opens window t + 1). ``ref``: the norm reference after this window (None:
        unchanged, an adopted aggregate)."""
        ref = st.reference if ref is None else ref
        rows = self.log.rows(windows=(st.window, st.window))
        folded = standings(map(ContributionRecord.outcome, rows), self.spec.validator, start=st.standings)
        nxt = ValidatorState(
            self.run_hash,
            st.window + 1,
            digest,
            published_at,
            params,
            launch=st.launch,
            launched_at=st.launched_at,
            previous_base=st.base,
            reference=ref,
            standings=folded,
        )
        checkpoint = is_checkpoint_window(nxt.window, self.spec.windows, self.local.max_windows)
        if checkpoint:
            publish.publish_checkpoint(
                self.store,
                self.run_id,
                self.run_hash,
                nxt.window,
                aggregate=digest,
                params=params,
                identity=self.identity,
                published_at=nxt.opened_at,
                launch=st.launch,
            )
        theta = checkpoint or nxt.window - self._theta_window >= THETA_EVERY
        save_state(self.state_dir, nxt, params=theta)
        if theta:
            self._theta_window = nxt.window
        self.state = nxt
        self.feedback = feedback
        prune_feedback(self.state_dir, before=nxt.window)
        self._load_params(params)
        self._collect(nxt.window)

    def _collect(self, current: int) -> None:
        """Apply the local retention policy now that window ``current`` is open
        (:mod:`validator.retention`), at most ``MAX_DELETES_PER_WINDOW`` keys. The window is already
        committed: a store error here is logged and the next window collects again."""
        if not self.retention.enabled:
            return
        try:
            plan = retention.plan_collection(
                self.store,
                self.run_id,
                self.run_hash,
                current=current,
                policy=self.retention,
                signers=self.signers,
                max_deletes=MAX_DELETES_PER_WINDOW,
            )
            deleted = retention.collect(self.store, plan)
        except StoreError as exc:
            log.warning("retention at window %d failed, retried next window: %s", current, exc)
            return
        if deleted:
            log.info("retention at window %d deleted %d objects (anchor %d)", current, deleted, plan.anchor)

    def _record_late(self, window: int) -> None:
        """Rows for announced peers whose upload to ``window`` arrived after it closed."""
        if window < 0:
            return
        decided = {r.peer for r in self.log.rows(windows=(window, window))}
        try:
            listed = list_contributions(self.store, self.run_id, window)
        except StoreError:
            return  # best effort: they are looked for again at the next window
        late = [
            ContributionRecord(
                window=window,
                peer=peer,
                received_at=self.clock(),
                reason=LATE,
                detail="uploaded after the window closed",
                checks=(checks.fail("deadline", LATE),),
            )
            for peer in sorted(set(listed) - decided)
            if peer in self.registry.announcements
        ][: self.budgets.max_fetches]
        if late:
            self.log.record_rows(late)

    # ------------------------------------------------------------------ helpers
    def _state(self) -> ValidatorState:
        if self.state is None:
            raise RuntimeError("Validator.resume() has not run")
        return self.state

    def _standings(self, t: int) -> dict[str, Standing]:
        """Every peer's standing before window ``t``: for the open window the standings saved with
        the state (folded one window at a time, :meth:`_advance`), so that a window's cost does not
        grow with history; for any other window, folded from the log."""
        st = self._state()
        if t == st.window and st.standings is not None:
            return st.standings
        return self._folded(t)

    def _folded(self, t: int) -> dict[str, Standing]:
        """The standings before window ``t`` from the whole log (older state directories, diagnostics)."""
        return standings(
            map(ContributionRecord.outcome, self.log.rows(windows=(None, t - 1))), self.spec.validator, before=t
        )

    def _load_params(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in parameters_of(self.model).items():
                p.copy_(params[name])

    def _val_loss(self) -> float:
        d = self.spec.data
        if not hasattr(self, "_val"):
            self._val = validation_batches(self.dataset, self.spec.validator.eval_sequences, d.batch_size, d.seq_len)
        return eval_loss(self.model, self._val, self.device)


class _WaitingReport:
    """Emits WindowWaiting for one window: the peers it waits for, at most every
    ``WAITING_REPORT_S`` seconds, the first time once it has waited that long."""

    def __init__(self, window: int, closes_at: float, clock: Callable[[], float], emit: Callable[[Event], None]):
        self.window, self.closes_at, self.clock, self.emit = window, closes_at, clock, emit
        self.last = clock()

    def report(self, missing: frozenset[str], uploaded: int) -> None:
        now = self.clock()
        if not missing or now - self.last < WAITING_REPORT_S:
            return
        self.last = now
        closes_in = round(max(0.0, self.closes_at - now), 1)
        self.emit(
            WindowWaiting(window=self.window, waiting_for=sorted(missing), uploaded=uploaded, closes_in_s=closes_in)
        )


def _failed_check(rows: Sequence[CheckRow]) -> str | None:
    return next((c.name for c in rows if not c.passed), None)


def _shows_activity(r: ContributionRecord) -> bool:
    """The row says the peer itself uploaded (not a store failure, nor bytes someone else signed)."""
    if r.accepted or r.reason == LATE:
        return True
    return r.reason not in (EXCLUDED, OVER_BUDGET) and _failed_check(r.checks) not in UNATTRIBUTABLE_CHECKS


def _unread(r: Received) -> checks.Screened:
    """The verdict on an upload that was not read: excluded, over the budget, or a store failure."""
    reason = r.reason or "store_error"
    name = {"too_large": "size", EXCLUDED: "excluded"}.get(reason, "fetch")
    return checks.Screened(peer=r.peer, checks=(checks.fail(name, reason),), reason=reason, detail=r.detail)


def _culprits(peers: Sequence[str], fine: Callable[[Sequence[str]], bool]) -> list[str]:
    """The members of ``peers`` that break ``fine`` on their own, by bisection (each half is
    tested alone; a single member that fails is a culprit)."""
    if not peers or fine(peers):
        return []
    if len(peers) == 1:
        return list(peers)
    mid = len(peers) // 2
    return _culprits(peers[:mid], fine) + _culprits(peers[mid:], fine)


def _open_dataset(spec: RunSpec, store: ObjectStore, local: LocalSettings) -> TokenDataset:
    """The run's dataset (its manifest verified now; shards are fetched when scoring needs them).
    A run without a usable dataset manifest cannot be validated: ConfigError."""
    try:
        return dataset_of(spec, store, local.data)
    except ObjectNotFound as exc:
        raise ConfigError(
            f"the store holds no dataset manifest for run {layout.run_id(spec.hash())} ({exc}): create the run "
            "with `sparseloco-validator init`, or check store.url"
        ) from exc
    except ProtocolError as exc:
        raise ConfigError(f"the run's dataset manifest does not verify: {exc}") from exc


def _ignore(event: Event) -> None:
    """The default event sink: a Validator driven from code reads run_window's return value instead."""
