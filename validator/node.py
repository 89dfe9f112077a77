"""The validator: one window at a time, every phase a call.

    v = Validator(spec, open_store(url), Identity.load(key), state_dir, emit=EventWriter(sys.stdout))
    v.run(windows=10)            # resumes where the state directory and the store say it stopped

It reports through ``emit`` (:mod:`protocol.events`): WindowOpened when it starts gathering a
window, WindowPublished (also ``run_window``'s return value) and WindowRetry after a store error.

Per window t (docs/ARCHITECTURE.md, "One window, end to end"): gather the contributions under
``contrib/<t>/`` until the deadline or until every active peer (announced, and uploaded or
announced lately) has uploaded; run the cheap
checks on all of them; score a budgeted sample by loss; decide; aggregate the accepted ones;
publish the signed aggregate (opening window t + 1) and, every ``checkpoint_every`` windows, a
checkpoint. Every decision is a row of the contribution log. Crash safety: decisions are written
(status ``decided``) before the aggregate is put, and the state file moves to t + 1 after it; a
restart adopts an aggregate it finds already published for its window, and otherwise re-decides
the window (rows are keyed by (window, peer) and reputation is derived from them, so nothing is
lost or counted twice). The published Δ̄ is the bfloat16-rounded or re-compressed form of the
aggregate (:mod:`protocol.broadcast`), and θ_{t+1} is θ_t minus exactly that; with re-compression
the validator's error-feedback buffer is written ahead of the put (``validator/state.py``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from protocol import broadcast, layout
from protocol.aggregate import SparseDict, aggregate, apply_outer
from protocol.caps import object_caps
from protocol.chain import delta_of, read_aggregate
from protocol.config import RunSpec
from protocol.data import assigned_batches, open_dataset, random_batches, validation_batches
from protocol.errors import ConfigError, ObjectNotFound, ProtocolError, StoreError
from protocol.events import Event, WindowOpened, WindowPublished, WindowRetry
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import build_model, eval_loss, fingerprint, param_schema, parameters_of
from protocol.store.base import ObjectStore
from protocol.windows import is_checkpoint_window
from protocol.wire import GENESIS, Aggregate, Verified, decode_aggregate
from validator import checks, publish, window_checks
from validator.gather import PeerRegistry, Received, gather, list_contributions
from validator.log import LOG_FILE, ContributionLog, ContributionRecord, WindowRecord
from validator.reputation import LATE, Outcome, Standing, is_excluded, standings, update
from validator.scoring import LossScore, pick_sample, score_update, scoring_units, take_sequences
from validator.state import (
    ValidatorState,
    load_feedback,
    load_state,
    prune_feedback,
    save_feedback,
    save_state,
)

__all__ = ["LOG_FILE", "Validator"]


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
        emit: Callable[[Event], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if identity.public_key_hex not in spec.validator.public_keys:
            raise ConfigError(
                f"this validator's public key {identity.public_key_hex} is not in validator.public_keys of the "
                "RunSpec; peers would reject its aggregates (run `sparseloco-validator keygen`)"
            )
        self.spec, self.store, self.identity = spec, store, identity
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.state_dir = Path(state_dir)
        self.log = ContributionLog(self.state_dir / LOG_FILE)
        self.device = torch.device(device)
        self.schema = param_schema(spec.model)
        self.model = build_model(spec.model).to(self.device)
        self.dataset = open_dataset(spec.data)
        self.stop = threading.Event()
        self.emit = emit or _ignore  # WindowOpened, WindowPublished, WindowRetry (protocol.events)
        self._gathering: int | None = None  # the window whose WindowOpened was emitted last
        self.clock = clock
        self.registry = PeerRegistry(store, self.run_id, self.run_hash, clock)
        self.signers = sorted(set(spec.validator.public_keys))
        self.caps = object_caps(spec)
        self.state: ValidatorState | None = None
        self.feedback = FeedbackState()  # the re-compression buffer that opens the current window

    def close(self) -> None:
        self.log.close()
        self.store.close()

    # ------------------------------------------------------------------ the loop
    def run(self, windows: int | None = None) -> list[WindowPublished]:
        """Resume (or start at genesis) and run ``windows`` windows (None: until stopped or
        ``windows.max_windows``)."""
        state = self.state or self.resume()
        reports: list[WindowPublished] = []
        limit = self.spec.windows.max_windows
        while not self.stop.is_set() and (windows is None or len(reports) < windows):
            if limit and state.window >= limit:
                break
            try:
                report = self.run_window()
            except StoreError as exc:  # a value at the window boundary: retry (or adopt what got out)
                self.emit(WindowRetry(window=state.window, reason=exc.reason, detail=str(exc)))
                self.stop.wait(self.spec.windows.poll_interval_s)
                self._adopt_published()
                state = self._state()
                self._load_params(state.params)  # the model may hold the unpublished θ_{t+1}
                continue
            if report is None:  # stopped mid-window: nothing published, a restart redoes it
                break
            reports.append(report)
            state = self._state()
        return reports

    def run_window(self) -> WindowPublished | None:
        st, clock = self._state(), _PhaseClock()
        t = st.window
        self._opened(st)
        ctx = self._context(t, st.base)  # registered keys, exclusions, expected base
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

    def _opened(self, st: ValidatorState) -> None:
        """Emit WindowOpened once per window gathered by this process (a retry does not reopen it)."""
        if self._gathering != st.window:
            self._gathering = st.window
            self.emit(WindowOpened(window=st.window, base=st.base, opened_at=st.opened_at))

    # ------------------------------------------------------------------ start / resume
    def resume(self) -> ValidatorState:
        state = load_state(self.state_dir, self.run_hash) or self._genesis()
        self._load_params(state.params)
        self.state = state
        self.feedback = self._saved_feedback(state.window, state.base)
        self._adopt_published()
        return self._state()

    def _genesis(self) -> ValidatorState:
        params = {n: p.detach().clone() for n, p in parameters_of(build_model(self.spec.model)).items()}
        try:
            _, stored, opened_at = publish.load_checkpoint(
                self.store, self.run_id, self.run_hash, 0, allowed_signers=self.signers
            )
            if fingerprint(stored) != fingerprint(params):
                raise ConfigError("the store's genesis checkpoint differs from θ₀ built from this RunSpec")
        except ProtocolError as exc:
            raise ConfigError(f"the store's genesis checkpoint is unusable: {exc}") from exc
        except ObjectNotFound:
            opened_at = self.clock()
            publish.publish_checkpoint(
                self.store,
                self.run_id,
                self.run_hash,
                0,
                aggregate=GENESIS,
                params=params,
                identity=self.identity,
                published_at=opened_at,
            )
        state = ValidatorState(self.run_hash, 0, GENESIS, opened_at, params)
        save_state(self.state_dir, state)
        return state

    def _adopt_published(self) -> None:
        """Apply aggregates already published for the saved window (a crash after publishing, or a
        lost state directory): the chain in the store is the truth."""
        while True:
            st = self._state()
            try:
                agg = read_aggregate(
                    self.store,
                    self.run_id,
                    self.run_hash,
                    st.window,
                    allowed_signers=self.signers,
                    max_bytes=self.caps.aggregate,
                    schema=self.schema,
                )
            except ProtocolError as exc:
                raise ConfigError(
                    f"the store's aggregate {st.window} is invalid; cannot continue the chain: {exc}"
                ) from exc
            if agg is None:
                return
            if agg.value.base != st.base:
                raise ConfigError(f"published aggregate {st.window} does not follow this validator's state")
            params = {n: p.detach().clone() for n, p in st.params.items()}
            apply_outer(params, delta_of(agg.value), agg.value.alpha)
            if fingerprint(params) != agg.value.fingerprint:
                raise ConfigError(f"aggregate {st.window} does not reproduce its fingerprint from this state")
            self._adopt_rows(agg)
            self._advance(st, agg, params, self._saved_feedback(st.window + 1, agg.digest))

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
    def _context(self, t: int, base: str) -> checks.Context:
        registered = self.registry.refresh()
        standing = self._standings(t)
        excluded = frozenset(p for p, s in standing.items() if is_excluded(s, t))
        return checks.Context(
            run_hash=self.run_hash,
            window=t,
            expected_base=base,
            codec=self.spec.codec,
            schema=self.schema,
            max_bytes=self.caps.contribution,
            registered=registered,
            excluded=excluded,
        )

    def _gather(self, t: int, opened_at: float, ctx: checks.Context) -> dict[str, Received]:
        """Until the deadline, or until every active peer (see ``gather.active_peers``) uploaded."""
        cfg = self.spec.validator
        rows = self.log.rows(windows=(max(0, t - cfg.active_windows), t - 1))
        recent = {r.peer for r in rows if r.reason != "bad_signature"}  # forged uploads prove nothing

        def seen(peer: str, now: float) -> float:
            recent.add(peer)  # an upload in this window is activity too
            return self.log.note_received(t, peer, received_at=now, nbytes=None)

        return gather(
            self.store,
            self.run_id,
            t,
            opened_at=opened_at,
            windows=self.spec.windows,
            max_bytes=self.caps.contribution,
            concurrency=cfg.max_gather_concurrency,
            expected=lambda: self.registry.active(recent, cfg.announcement_ttl_s) - ctx.excluded,
            stop=self.stop,
            clock=self.clock,
            on_seen=seen,
        )

    def _screen(self, r: Received, ctx: checks.Context) -> checks.Screened:
        if r.data is None:
            name = "size" if r.reason == "too_large" else "fetch"
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
        tensors, feedback = broadcast.publishable(delta, self.schema, self.spec.outer, self.spec.codec, self.feedback)
        nxt = {n: p.detach().clone() for n, p in st.params.items()}
        apply_outer(nxt, broadcast.applied(tensors), self.spec.outer.alpha)  # what is signed, not Δ̄ itself
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
            tensors=tensors,
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
        if broadcast.keeps_feedback(self.spec.outer):  # write-ahead: the buffer after this aggregate exists first
            save_feedback(self.state_dir, t + 1, hashlib.sha256(blob).hexdigest(), feedback)
        self.store.put(layout.aggregate_key(self.run_id, t), blob, if_absent=True)
        agg = decode_aggregate(blob, run_hash=self.run_hash, max_bytes=len(blob), allowed_signers=self.signers)
        self.log.mark_published(t, digest=agg.digest, published_at=published_at)
        self._advance(st, agg, nxt, feedback)
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

    def _advance(
        self, st: ValidatorState, agg: Verified[Aggregate], params: dict[str, torch.Tensor], feedback: FeedbackState
    ) -> None:
        """Move to window t + 1: checkpoint when due, then the state file (the commit point), then
        drop the error-feedback buffer of window t."""
        nxt = ValidatorState(self.run_hash, st.window + 1, agg.digest, agg.value.published_at, params)
        if is_checkpoint_window(nxt.window, self.spec.windows):
            publish.publish_checkpoint(
                self.store,
                self.run_id,
                self.run_hash,
                nxt.window,
                aggregate=agg.digest,
                params=params,
                identity=self.identity,
                published_at=nxt.opened_at,
            )
        save_state(self.state_dir, nxt)
        self.state = nxt
        self.feedback = feedback
        prune_feedback(self.state_dir, before=nxt.window)
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


def _ignore(event: Event) -> None:
    """The default event sink: a Validator driven from code reads run_window's return value instead."""
