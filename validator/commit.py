"""Committing windows: publish a decision, advance the state, checkpoints, retention, late rows.

:class:`Committer` owns where the validator stands: the state (:class:`validator.state.ValidatorState`:
window t, its base, θ_t, the norm reference, every peer's standing), the re-compression buffer that
opens window t, and the live model's parameters (θ_t, what is scored against and evaluated).
Only it moves them, in one order:

1. :meth:`Committer.publish` writes the window's rows (status ``decided``) and its outcomes, the
   error-feedback buffer after the aggregate (write-ahead, with ``outer.recompress``), then puts
   the signed aggregate — the commit point in the store;
2. :meth:`Committer.advance` folds the window's rows into the standings, publishes a checkpoint when
   t + 1 is a checkpoint window, replaces the state file (θ only at checkpoint windows and every
   ``THETA_EVERY`` windows), drops the buffer of window t, loads θ_{t+1} into the model and applies
   the retention policy.

A crash or store error anywhere before the state file is replaced leaves the state at window t;
a restart (or the retry) adopts the aggregate if it got out (:meth:`Committer.adopt`, with the
decisions as logged, or as the aggregate's manifest proves them when the log lost them), and
otherwise decides the window again.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from protocol import broadcast, layout
from protocol.caps import object_caps, published_bytes
from protocol.config import RunSpec
from protocol.errors import StoreError
from protocol.events import CheckpointSkipped, Event, StoreObjectRejected, WindowPublished
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import parameters_of
from protocol.outcomes import OUTCOMES, encode_outcomes, outcomes_digest
from protocol.quorum import Quorum
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.windows import is_checkpoint_window
from protocol.wire import Aggregate, Verified
from validator import checks, publish, reference, retention
from validator.decide import WindowDecision
from validator.gather import UNANNOUNCED, list_contributions
from validator.log import ContributionLog, ContributionRecord, WindowRecord
from validator.reputation import LATE, standings
from validator.state import ValidatorState, load_feedback, prune_feedback, save_feedback, save_state
from validator.window import PhaseClock

__all__ = ["MAX_DELETES_PER_WINDOW", "REFERENCE_DIGEST", "THETA_EVERY", "VIEW", "Committer", "Proposed"]

VIEW = "view"  # the aggregate metadata key of the view its leader proposed it in (several validators)
# ... and of the sha256 of the norm reference after the window, which its proposal carries: every
# validator continues from the reference the certified aggregate names (validator/follow.py)
REFERENCE_DIGEST = "reference_sha256"

# Keys the retention policy deletes after one publish at most: a long run that turns retention on
# spreads its backlog over the next windows (`sparseloco-validator gc` collects it at once).
MAX_DELETES_PER_WINDOW = 1000
# θ is written to the state directory at checkpoint windows, and at least this often (a run without
# checkpoints still restarts by replaying a bounded number of aggregates).
THETA_EVERY = 64

log = logging.getLogger(__name__)


class Committer:
    """Publishes decided windows and advances the validator's state; see the module docstring.
    ``max_late``: at most this many late rows are written per window."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state_dir: Path,
        log: ContributionLog,
        model: nn.Module,
        *,
        local: LocalSettings,
        clock: Callable[[], float],
        emit: Callable[[Event], None],
        max_late: int,
    ) -> None:
        self.spec, self.store, self.identity = spec, store, identity
        self.state_dir, self.log, self.model = state_dir, log, model
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.signers = sorted(set(spec.validator.public_keys))
        quorum = Quorum.of(spec)
        self.quorum: int | None = quorum.m if quorum.several else None  # certificates at aggregate keys
        self.max_aggregate_bytes = object_caps(spec).aggregate
        v = local.validator
        self.retention = retention.Retention(v.retain_windows, v.retain_checkpoint_every)
        self._verified_files: set[tuple[str, str]] = set()  # checkpoint files retention has read and verified
        self._rejections: set[tuple[str, str]] = set()  # (key, reason) retention has reported
        self.max_windows = local.max_windows
        self.clock, self.emit, self.max_late = clock, emit, max_late
        self.state: ValidatorState | None = None
        self.feedback = FeedbackState()  # the re-compression buffer that opens the current window
        self.theta_window = 0  # the window whose θ the state directory holds

    # ------------------------------------------------------------------ where the validator stands
    def start(self, state: ValidatorState, theta_window: int) -> None:
        """Stand at ``state`` (θ of its window; the state directory holds θ of ``theta_window``)."""
        self.state, self.theta_window = state, theta_window
        self.feedback = self.saved_feedback(state.window, state.base)
        self._load(state.params)

    def current(self) -> ValidatorState:
        if self.state is None:
            raise RuntimeError("Validator.resume() has not run")
        return self.state

    def saved_feedback(self, window: int, base: str) -> FeedbackState:
        """The re-compression buffer that opens ``window`` after ``base``, as written ahead of that
        aggregate's put. Empty without a buffer to keep (``broadcast.keeps_feedback``), at genesis,
        and when the state directory was lost (what it had not sent yet is then dropped, as a
        peer's would be)."""
        if not broadcast.keeps_feedback(self.spec.outer):
            return FeedbackState()
        return load_feedback(self.state_dir, window, base) or FeedbackState()

    # ------------------------------------------------------------------ publish
    def publish(
        self, st: ValidatorState, d: WindowDecision, unannounced: int, clock: PhaseClock | None = None
    ) -> WindowPublished:
        """Publish window ``st.window``'s decision ``d`` and advance to the next window."""
        t, rows, trial, clock = st.window, d.rows, d.trial, clock or PhaseClock()
        published_at = self.clock()
        outcomes = encode_outcomes(self.run_hash, t, [r.outcome() for r in rows])
        blob = self._encode(st, d, outcomes_digest(outcomes), published_at)
        self.log.record_window(self._window_record(st, d, unannounced, published_at), list(rows))
        publish.publish_outcomes(self.store, self.run_id, t, outcomes)
        digest = hashlib.sha256(blob).hexdigest()  # how the chain names it (its own bytes: nothing to verify)
        if broadcast.keeps_feedback(self.spec.outer):  # write-ahead: the buffer after this aggregate exists first
            save_feedback(self.state_dir, t + 1, digest, trial.feedback)
        publish.publish_aggregate(
            self.store,
            self.run_id,
            self.run_hash,
            t,
            blob,
            base=st.base,
            allowed_signers=self.signers,
            max_bytes=self.max_aggregate_bytes,
        )
        self.log.mark_published(t, digest=digest, published_at=published_at)
        self.advance(st, digest, published_at, trial.params, trial.feedback, d.reference)
        clock.lap("publish")
        report = _report(d, unannounced, digest, published_at, clock)
        self.emit(report)
        return report

    # ------------------------------------------------------------------ several validators
    def propose(self, st: ValidatorState, d: WindowDecision, unannounced: int, *, view: int) -> Proposed:
        """A run with several validators (:mod:`validator.agreement`): write the decision down
        (rows, status ``decided``) and the buffer after it (write-ahead), and return the signed
        aggregate for the proposal. Nothing is published and the state does not move until a
        quorum endorses it (:meth:`certified`)."""
        t, published_at = st.window, self.clock()
        outcomes = encode_outcomes(self.run_hash, t, [r.outcome() for r in d.rows])
        blob = self._encode(st, d, outcomes_digest(outcomes), published_at, view=view)
        self.log.record_window(self._window_record(st, d, unannounced, published_at), list(d.rows))
        # out before the proposal (a peer may read the certificate before its leader does); put again
        # once certified, in case another view's leader put its own meanwhile
        publish.publish_outcomes(self.store, self.run_id, t, outcomes)
        digest = hashlib.sha256(blob).hexdigest()
        if broadcast.keeps_feedback(self.spec.outer):
            save_feedback(self.state_dir, t + 1, digest, d.trial.feedback)
        return Proposed(blob, digest, d, outcomes, unannounced, published_at, view)

    def certified(
        self, st: ValidatorState, mine: Proposed, signers: tuple[str, ...], clock: PhaseClock | None = None
    ) -> WindowPublished:
        """This validator's proposal ``mine`` was certified: its outcomes out, the window published
        in the log, the state advanced with the decision's θ_{t+1}, buffer and reference."""
        clock, d = clock or PhaseClock(), mine.decision
        publish.publish_outcomes(self.store, self.run_id, st.window, mine.outcomes)
        self.log.mark_published(st.window, digest=mine.digest, published_at=mine.published_at)
        self.advance(st, mine.digest, mine.published_at, d.trial.params, d.trial.feedback, d.reference)
        clock.lap("publish")
        report = replace(
            _report(d, mine.unannounced, mine.digest, mine.published_at, clock),
            leader=self.identity.peer_id,
            view=mine.view,
            signers=list(signers),
        )
        self.emit(report)
        return report

    def _encode(
        self, st: ValidatorState, d: WindowDecision, outcomes: str, published_at: float, view: int | None = None
    ) -> bytes:
        """The signed aggregate of the decision: the published Δ̄, the accepted manifest, θ_{t+1}'s
        fingerprint, the randomness metadata, the counts, the outcomes' digest and the loss."""
        accepted = [r for r in d.rows if r.accepted]
        meta: dict[str, int | float | str | bool] = {
            **d.metadata,
            "accepted": len(accepted),
            "rejected": len(d.rows) - len(accepted),
            OUTCOMES: outcomes,  # the peers' scores and reasons, vouched for here
        }
        if d.trial.val_loss is not None:  # the wire refuses a non-finite number, and so do peers
            meta["val_loss"] = d.trial.val_loss
        if view is not None:  # several validators: the view its leader proposed it in, the reference after it
            meta[VIEW] = view
            meta[REFERENCE_DIGEST] = hashlib.sha256(d.reference.to_json().encode()).hexdigest()
        return publish.encode_window_aggregate(
            run_hash=self.run_hash,
            window=st.window,
            base=st.base,
            alpha=self.spec.outer.alpha,
            tensors=d.trial.tensors,
            manifest=[(r.peer, r.digest or "", r.weight) for r in accepted],
            fingerprint_next=d.fingerprint,
            published_at=published_at,
            metadata=meta,
            identity=self.identity,
        )

    def _window_record(
        self, st: ValidatorState, d: WindowDecision, unannounced: int, published_at: float
    ) -> WindowRecord:
        accepted = len(d.accepted)
        return WindowRecord(
            window=st.window,
            status="decided",
            opened_at=st.opened_at,
            closed_at=published_at,
            base=st.base,
            fingerprint=d.fingerprint,
            val_loss=d.trial.val_loss,
            accepted=accepted,
            rejected=len(d.rows) - accepted,
            unannounced=unannounced,
        )

    # ------------------------------------------------------------------ adopt
    def adopt(
        self,
        verified: Verified[Aggregate],
        params: dict[str, torch.Tensor],
        feedback: FeedbackState | None = None,
        ref: reference.NormReference | None = None,
    ) -> None:
        """Advance past an aggregate already published for the open window (θ after it:
        ``params``; ``feedback``: the buffer after it when this validator computed it, else the one
        written ahead, if any): the decisions as logged, or as its manifest proves them when the
        log lost them or holds another aggregate's (a proposal of this validator's that was not
        certified). ``ref``: the norm reference after it (None: unchanged)."""
        st = self.current()
        agg = verified.value
        logged = self.log.window(agg.window)
        if logged is not None and logged.fingerprint != agg.fingerprint:
            self.log.forget_window(agg.window)
            logged = None
        if logged is None:
            rows = [
                ContributionRecord(window=agg.window, peer=m.peer_id, digest=m.digest, accepted=True, weight=m.weight)
                for m in agg.manifest
            ]
            win = WindowRecord(window=agg.window, accepted=len(rows), fingerprint=agg.fingerprint, base=agg.base)
            self.log.record_window(win, rows)
        self.log.mark_published(agg.window, digest=verified.digest, published_at=agg.published_at)
        if feedback is None:
            feedback = self.saved_feedback(st.window + 1, verified.digest)
        elif broadcast.keeps_feedback(self.spec.outer):
            save_feedback(self.state_dir, st.window + 1, verified.digest, feedback)
        self.advance(st, verified.digest, agg.published_at, params, feedback, ref)

    # ------------------------------------------------------------------ advance
    def advance(
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
        rows = self.log.rows(windows=(st.window, st.window))
        nxt = ValidatorState(
            self.run_hash,
            st.window + 1,
            digest,
            published_at,
            params,
            launch=st.launch,
            launched_at=st.launched_at,
            previous_base=st.base,
            reference=st.reference if ref is None else ref,
            standings=standings(map(ContributionRecord.outcome, rows), self.spec.validator, start=st.standings),
        )
        checkpoint = is_checkpoint_window(nxt.window, self.spec.windows, self.max_windows)
        if checkpoint:
            self._checkpoint(nxt, digest, params)
        theta = checkpoint or nxt.window - self.theta_window >= THETA_EVERY
        save_state(self.state_dir, nxt, params=theta)
        if theta:
            self.theta_window = nxt.window
        self.state = nxt
        self.feedback = feedback
        prune_feedback(self.state_dir, before=nxt.window)
        self._load(params)
        self.collect(nxt.window)

    def _checkpoint(self, nxt: ValidatorState, digest: str, params: dict[str, torch.Tensor]) -> None:
        """Publish the checkpoint that opens ``nxt.window``. The aggregate is already out, so a store
        error skips the checkpoint (CheckpointSkipped) instead of failing the window: retrying the
        window would adopt the aggregate and fail here again, for as long as the error lasts."""
        try:
            publish.publish_checkpoint(
                self.store,
                self.run_id,
                self.run_hash,
                nxt.window,
                aggregate=digest,
                params=params,
                identity=self.identity,
                published_at=nxt.opened_at,
                launch=nxt.launch,
                signers=self.signers,
            )
        except StoreError as exc:
            log.warning("checkpoint %d not published, the run goes on without it: %s", nxt.window, exc)
            self.emit(CheckpointSkipped(window=nxt.window, reason=exc.reason, detail=str(exc)))

    def _rejected(self, key: str, reason: str, detail: str) -> None:
        """A store object retention could not verify: a warning and a StoreObjectRejected event,
        once per (key, reason) — retention plans every window and would repeat it."""
        if (key, reason) in self._rejections:
            return
        self._rejections.add((key, reason))
        log.warning("%s %s: %s", key, reason, detail)
        self.emit(StoreObjectRejected(key=key, reason=reason, detail=detail))

    def collect(self, current: int) -> None:
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
                verified=self._verified_files,
                rejected=self._rejected,
                quorum=self.quorum,
                max_aggregate_bytes=published_bytes(self.spec),
            )
            deleted = retention.collect(self.store, plan)
        except StoreError as exc:
            log.warning("retention at window %d failed, retried next window: %s", current, exc)
            return
        if deleted:
            log.info("retention at window %d deleted %d objects (anchor %d)", current, deleted, plan.anchor)

    def record_late(self, window: int, announced: Mapping[str, object]) -> None:
        """Rows for ``announced`` peers whose upload to ``window`` arrived after it closed."""
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
            if peer in announced
        ][: self.max_late]
        if late:
            self.log.record_rows(late)

    def _load(self, params: Mapping[str, torch.Tensor]) -> None:
        """The live model holds θ = ``params``."""
        with torch.no_grad():
            for name, p in parameters_of(self.model).items():
                p.copy_(params[name])


@dataclass(frozen=True)
class Proposed:
    """This validator's proposal of a window, kept until the window is certified: the signed
    aggregate (``blob``, ``digest``), the decision behind it, its outcomes, and its view."""

    blob: bytes
    digest: str
    decision: WindowDecision
    outcomes: bytes
    unannounced: int
    published_at: float
    view: int


def _report(
    d: WindowDecision, unannounced: int, digest: str, published_at: float, clock: PhaseClock
) -> WindowPublished:
    """What ``run_window`` returns and emits for a published window."""
    rows, accepted = d.rows, len(d.accepted)
    reasons: dict[str, int] = {}
    for r in rows:
        if r.reason:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    if unannounced:
        reasons[UNANNOUNCED] = unannounced
    return WindowPublished(
        window=d.window,
        accepted=accepted,
        rejected=len(rows) - accepted,
        val_loss=d.trial.val_loss if d.trial.val_loss is not None else math.nan,
        digest=digest,
        fingerprint=d.fingerprint,
        published_at=published_at,
        reasons=reasons,
        seconds=clock.seconds,
        uploaded=len(rows),
        download_bytes=sum(r.bytes or 0 for r in rows),
    )
