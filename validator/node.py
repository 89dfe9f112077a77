"""The validator: one window at a time, every phase a call.

    v = Validator(spec, open_from_settings(local.store), Identity.load(key), state_dir, local=local,
                  emit=EventWriter(sys.stdout))
    v.run(windows=10)            # resumes where the state directory and the store say it stopped

It reports through ``emit`` (:mod:`protocol.events`): WindowOpened when it starts gathering a
window, WindowWaiting while expected peers have not uploaded (every few seconds, naming them),
WindowPublished (also ``run_window``'s return value), WindowRetry after a store error and, with
``validator.eval_every`` (a local setting), ModelEvaluated (:mod:`validator.evaluation`).

Per window t (docs/ARCHITECTURE.md, "One window, end to end"): gather the contributions under
``contrib/<t>/`` until the deadline or until every expected peer has uploaded (announced, not
withdrawn, not excluded, and uploaded in window t − 1 or announced since it opened:
:func:`validator.gather.expected_peers`); run the cheap
checks on all of them; score a budgeted sample by loss; decide; aggregate the accepted ones;
publish the signed aggregate (opening window t + 1) and, every ``checkpoint_every`` windows, a
checkpoint. Every decision is a row of the contribution log. Crash safety: decisions are written
(status ``decided``) before the aggregate is put, and the state file moves to t + 1 after it; a
restart adopts an aggregate it finds already published for its window, and otherwise re-decides
the window (rows are keyed by (window, peer) and reputation is derived from them, so nothing is
lost or counted twice).

Launches: the chain grows from the digest of a genesis manifest (:mod:`protocol.chain`). Without a
state directory the validator continues the launch whose genesis the store holds, or publishes a
new genesis; with one, it continues only its own launch and refuses a store holding another
(``ConfigError``). Objects of other launches, and anything at a chain key that does not verify, are
never adopted: they are overwritten when the validator publishes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from protocol import layout
from protocol.aggregate import SparseDict, aggregate, apply_outer
from protocol.chain import delta_of, next_aggregate, read_launch
from protocol.config import RunSpec
from protocol.data import assigned_batches, open_dataset, random_batches, validation_batches
from protocol.errors import ConfigError, ObjectNotFound, ProtocolError, StoreError
from protocol.events import Event, ModelEvaluated, WindowOpened, WindowPublished, WindowRetry, WindowWaiting
from protocol.identity import Identity
from protocol.model import build_model, eval_loss, fingerprint, param_schema, parameters_of
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.windows import gather_close, is_checkpoint_window
from protocol.wire import GENESIS, Aggregate, CheckpointManifest, Verified, decode_aggregate
from validator import checks, publish, window_checks
from validator.evaluation import PeriodicEval
from validator.gather import PeerRegistry, Received, gather, list_contributions
from validator.log import LOG_FILE, ContributionLog, ContributionRecord, WindowRecord
from validator.reputation import FOREIGN, LATE, Outcome, Standing, is_excluded, standings, update
from validator.scoring import LossScore, pick_sample, score_update, scoring_units, take_sequences
from validator.state import ValidatorState, load_state, save_state

__all__ = ["LOG_FILE", "Validator"]

# How often the validator re-reads the announcement of a peer it waits for (a withdrawal ends the
# wait) and reports whom it waits for.
RECHECK_S = 1.0
WAITING_REPORT_S = 5.0

log = logging.getLogger(__name__)


class _PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = round(now - self._last, 3)
        self._last = now


class Validator:
    """Owns θ_t, the store handle, the contribution log and the state directory."""

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
        self.model = build_model(spec.model).to(self.device)
        self.dataset = open_dataset(spec.data, self.local.data)
        self.periodic = PeriodicEval(
            every=self.local.validator.eval_every,
            sequences=self.local.validator.eval_sequences,
            dataset=self.dataset,
            data=spec.data,
        )
        self.stop = threading.Event()
        self.emit = emit or _ignore  # WindowOpened, WindowWaiting, WindowPublished, WindowRetry
        self._gathering: int | None = None  # the window whose WindowOpened was emitted last
        self.clock = clock
        self.registry = PeerRegistry(store, self.run_id, self.run_hash, clock)
        self.signers = sorted(set(spec.validator.public_keys))
        self.state: ValidatorState | None = None

    def close(self) -> None:
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
        t = st.window
        self._opened(st)
        ctx = self._context(t, st)  # registered keys, exclusions, accepted bases
        received = self._gather(t, st.opened_at, ctx)  # bounded, size-capped, deadline
        if self.stop.is_set():
            return None
        clock.lap("gather")
        ctx = replace(ctx, registered=frozenset(self.registry.announcements))  # peers may announce mid-window
        screened = [self._screen(r, ctx) for r in received.values()]  # cheap checks on all
        screened = window_checks.norms(screened, self.spec.validator.norm_max_ratio)  # vs the median
        first_seen = {p: r.received_at for p, r in received.items()}
        screened = window_checks.copies(screened, first_seen, self.schema, self.spec.validator.copy_overlap_threshold)
        clock.lap("checks")
        scores = self._score(screened, t, st.base)  # budgeted loss scoring
        screened = window_checks.scores(screened, scores)  # harmful updates rejected
        screened = window_checks.capacity(screened, self._rank(t, scores), self.spec.validator.max_contributors)
        clock.lap("scoring")
        rows = self._decide(screened, received, scores, t)  # reputation, weights
        self._record_late(t - 1)  # uploads that missed the previous window are accounted for too
        accepted = sorted((s for s in screened if s.reason is None), key=lambda s: s.peer)  # order-free Δ̄
        delta = aggregate([s.sparse for s in accepted], self.spec.outer.aggregation, self.spec.outer.clip)
        return self._publish(t, st, rows, delta, clock)  # log, aggregate, checkpoint, state

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
        state = self._genesis() if saved is None else self._same_launch(saved)
        self._load_params(state.params)
        self.state = state
        self._adopt_published()
        return self._state()

    def _genesis(self) -> ValidatorState:
        """Without a state: continue the launch whose genesis the store holds (a lost state
        directory: the chain in the store is the truth), or start a new launch by publishing a
        genesis manifest, whose digest roots the chain. A genesis that does not verify counts as
        absent; objects of earlier launches never chain onto a new one."""
        params = {n: p.detach().clone() for n, p in parameters_of(build_model(self.spec.model)).items()}
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
        )
        save_state(self.state_dir, state)
        return state

    def _same_launch(self, state: ValidatorState) -> ValidatorState:
        """A saved state continues its own launch only: the store's genesis must be that launch
        (written again, byte for byte, when the store lost it); another launch is a ConfigError."""
        stored = self._stored_launch()
        if stored is None:
            params = {n: p.detach().clone() for n, p in parameters_of(build_model(self.spec.model)).items()}
            stored = self._publish_genesis(params, state.launched_at)
        if stored.digest != state.launch:
            raise ConfigError(
                f"the store holds launch {stored.digest[:16]} of this run, but the state in {self.state_dir} "
                f"continues launch {state.launch[:16]}: use a store without the other launch, or move "
                "the state directory away to continue the store's launch"
            )
        return state

    def _stored_launch(self) -> Verified[CheckpointManifest] | None:
        """The store's genesis manifest; None when there is none or it does not verify."""
        try:
            return read_launch(self.store, self.run_id, self.run_hash, allowed_signers=self.signers)
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
            agg = next_aggregate(
                self.store,
                self.run_id,
                self.run_hash,
                st.window,
                st.base,
                allowed_signers=self.signers,
                max_bytes=self.spec.validator.max_aggregate_bytes,
                schema=self.schema,
            )
            if agg is None:
                return
            params = {n: p.detach().clone() for n, p in st.params.items()}
            apply_outer(params, delta_of(agg.value), agg.value.alpha)
            if fingerprint(params) != agg.value.fingerprint:
                raise ConfigError(f"aggregate {st.window} does not reproduce its fingerprint from this state")
            self._adopt_rows(agg)
            self._advance(st, agg, params)

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
    def _context(self, t: int, st: ValidatorState) -> checks.Context:
        registered = self.registry.refresh()
        standing = self._standings(t)
        excluded = frozenset(p for p, s in standing.items() if is_excluded(s, t))
        return checks.Context(
            run_hash=self.run_hash,
            window=t,
            expected_base=st.base,
            # One-window-delayed outer step: a peer trains window t from θ_{t−1} while aggregate
            # t−1 is published; its update is scored and applied against θ_t like any other.
            previous_base=st.previous_base if self.spec.outer.delay else None,
            codec=self.spec.codec,
            schema=self.schema,
            max_bytes=self.spec.validator.max_contribution_bytes,
            registered=registered,
            excluded=excluded,
        )

    def _gather(self, t: int, opened_at: float, ctx: checks.Context) -> dict[str, Received]:
        """Until the deadline, or until every expected peer (:func:`validator.gather.expected_peers`)
        uploaded."""
        cfg = self.spec.validator
        prev = self.log.rows(windows=(t - 1, t - 1)) if t > 0 else []
        uploaded_last = {r.peer for r in prev if r.reason not in ("bad_signature", FOREIGN)}  # forgeries prove nothing
        opened_last = self.log.window(t - 1) if t > 0 else None
        since = opened_last.opened_at if opened_last is not None else None
        waiting = _WaitingReport(t, gather_close(opened_at, self.spec.windows), self.clock, self.emit)

        def expected(uploaded: frozenset[str]) -> frozenset[str]:
            self.registry.refresh()
            # Re-read the announcements of the peers still awaited (a withdrawal ends the wait) and
            # of the withdrawn ones (a peer that comes back is expected again).
            awaited = self.registry.expected(uploaded_last, since) - uploaded
            self.registry.recheck(awaited | self.registry.withdrawn, RECHECK_S)
            want = self.registry.expected(uploaded_last, since) - ctx.excluded
            waiting.report(want - uploaded, len(uploaded))
            return want

        def seen(peer: str, now: float) -> float:
            return self.log.note_received(t, peer, received_at=now, nbytes=None)

        return gather(
            self.store,
            self.run_id,
            t,
            opened_at=opened_at,
            windows=self.spec.windows,
            poll_interval_s=self.local.poll_interval_s,
            max_bytes=cfg.max_contribution_bytes,
            concurrency=self.local.validator.gather_concurrency,
            expected=expected,
            stop=self.stop,
            clock=self.clock,
            on_seen=seen,
        )

    def _screen(self, r: Received, ctx: checks.Context) -> checks.Screened:
        if r.data is None and r.reason == "too_large":  # never read, so nobody can be named
            return checks.foreign(r.peer, "size", f"too_large: {r.detail}")
        if r.data is None:
            name = "fetch"
            return checks.Screened(
                peer=r.peer, checks=(checks.fail(name, r.reason or "store_error"),), reason=r.reason, detail=r.detail
            )
        return checks.screen(r.peer, r.data, ctx)

    def _score(self, screened: list[checks.Screened], t: int, base: str) -> dict[str, LossScore]:
        cfg, data = self.spec.validator, self.spec.data
        live = {s.peer: s for s in screened if s.reason is None}
        units = scoring_units({p: s.contribution.value.metadata if s.contribution else {} for p, s in live.items()})
        sample = pick_sample(sorted(units), cfg.eval_peers_per_window, self.spec.seed, t)
        if not sample:
            return {}
        seed = int.from_bytes(hashlib.sha256(f"{self.spec.seed}|{t}|{base}".encode()).digest()[:8], "little")
        n_batches = -(-cfg.eval_sequences // data.batch_size)
        rand = take_sequences(
            random_batches(self.dataset, seed, n_batches, data.batch_size, data.seq_len), cfg.eval_sequences
        )
        rand_before = eval_loss(self.model, rand, self.device)
        scale = cfg.eval_scale * self.spec.outer.alpha
        out: dict[str, LossScore] = {}
        for key in sample:  # a peer, or the stages of one pipeline replica (disjoint slices)
            update = {name: v for peer in units[key] for name, v in live[peer].sparse.items()}
            own = take_sequences(
                assigned_batches(
                    self.dataset, self.spec.seed, key, t, self.spec.inner.steps, data.batch_size, data.seq_len
                ),
                cfg.eval_sequences,
            )
            score = score_update(
                self.model, update, own=own, random=rand, random_before=rand_before, scale=scale, device=self.device
            )
            out.update((peer, score) for peer in units[key])
        return out

    def _rank(self, t: int, scores: dict[str, LossScore]) -> dict[str, float]:
        """Who is kept when too many pass: reputation so far, plus this window's score if measured."""
        rank = {p: st.reputation for p, st in self._standings(t).items()}
        for p, sc in scores.items():
            rank[p] = rank.get(p, 0.0) + sc.score
        return rank

    def _decide(
        self, screened: list[checks.Screened], received: dict[str, Received], scores: dict[str, LossScore], t: int
    ) -> list[ContributionRecord]:
        standing = self._standings(t)
        rows = []
        for s in sorted(screened, key=lambda s: s.peer):
            r, sc, c = received[s.peer], scores.get(s.peer), s.contribution
            accepted = s.reason is None
            st = update(
                standing.get(s.peer, Standing()),
                Outcome(t, s.peer, accepted, s.reason, sc.score if sc else None),
                self.spec.validator,
            )
            rows.append(
                ContributionRecord(
                    window=t,
                    peer=s.peer,
                    received_at=r.received_at,
                    bytes=r.nbytes,
                    digest=c.digest if c else None,
                    accepted=accepted,
                    reason=s.reason,
                    detail=s.detail,
                    norm=window_checks.total_norm(s.sparse) if s.sparse else None,
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
        self, t: int, st: ValidatorState, rows: list[ContributionRecord], delta: SparseDict, clock: _PhaseClock
    ) -> WindowPublished:
        nxt = {n: p.detach().clone() for n, p in st.params.items()}
        apply_outer(nxt, delta, self.spec.outer.alpha)
        fp = fingerprint(nxt)
        self._load_params(nxt)
        val_loss = self._val_loss()
        published_at = self.clock()
        accepted = [r for r in rows if r.accepted]
        meta = {"val_loss": val_loss, "accepted": len(accepted), "rejected": len(rows) - len(accepted)}
        blob = publish.encode_window_aggregate(
            run_hash=self.run_hash,
            window=t,
            base=st.base,
            alpha=self.spec.outer.alpha,
            delta=delta,
            shapes=self.schema,
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
            val_loss=val_loss,
            accepted=len(accepted),
            rejected=len(rows) - len(accepted),
        )
        self.log.record_window(win, rows)
        publish.publish_aggregate(
            self.store,
            self.run_id,
            self.run_hash,
            t,
            blob,
            base=st.base,
            allowed_signers=self.signers,
            max_bytes=self.spec.validator.max_aggregate_bytes,
        )
        agg = decode_aggregate(blob, run_hash=self.run_hash, max_bytes=len(blob), allowed_signers=self.signers)
        self.log.mark_published(t, digest=agg.digest, published_at=published_at)
        self._advance(st, agg, nxt)
        reasons: dict[str, int] = {}
        for r in rows:
            if r.reason:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
        clock.lap("publish")
        report = WindowPublished(
            window=t,
            accepted=len(accepted),
            rejected=len(rows) - len(accepted),
            val_loss=val_loss,
            digest=agg.digest,
            fingerprint=fp,
            published_at=published_at,
            reasons=reasons,
            seconds=clock.seconds,
        )
        self.emit(report)
        return report

    def _advance(self, st: ValidatorState, agg: Verified[Aggregate], params: dict[str, torch.Tensor]) -> None:
        """Move to window t + 1: checkpoint when due, then the state file (the commit point)."""
        nxt = ValidatorState(
            self.run_hash,
            st.window + 1,
            agg.digest,
            agg.value.published_at,
            params,
            launch=st.launch,
            launched_at=st.launched_at,
            previous_base=st.base,
        )
        if is_checkpoint_window(nxt.window, self.spec.windows, self.local.max_windows):
            publish.publish_checkpoint(
                self.store,
                self.run_id,
                self.run_hash,
                nxt.window,
                aggregate=agg.digest,
                params=params,
                identity=self.identity,
                published_at=nxt.opened_at,
                launch=st.launch,
            )
        save_state(self.state_dir, nxt)
        self.state = nxt
        self._load_params(params)

    def _record_late(self, window: int) -> None:
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
        ]
        if late:
            self.log.record_rows(late)

    # ------------------------------------------------------------------ helpers
    def _state(self) -> ValidatorState:
        if self.state is None:
            raise RuntimeError("Validator.resume() has not run")
        return self.state

    def _standings(self, t: int) -> dict[str, Standing]:
        history = [
            Outcome(r.window, r.peer, r.accepted, r.reason, r.score) for r in self.log.rows(windows=(None, t - 1))
        ]
        return standings(history, self.spec.validator, before=t)

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


def _ignore(event: Event) -> None:
    """The default event sink: a Validator driven from code reads run_window's return value instead."""
