"""One window's agreement among several validators: propose, re-check, endorse or object, certify.

A run with several validator keys (:mod:`protocol.quorum`) publishes an aggregate only when m of
them signed its digest. Every validator gathers the window's uploads as a single validator does
(:mod:`validator.intake`); then, until the window's aggregate is certified, it polls the store and
takes these steps in order, each at most once per window:

1. **read** the proposals, endorsements and objections of the window that it has not read (at
   most one of each kind per validator: their keys name their writer, and the store's write rules
   keep them its own), and log them (:class:`~validator.log.AgreementRecord`);
2. **judge** every proposal whose view has begun (:mod:`validator.follow`); one it cannot endorse
   gets a signed objection with the reasons;
3. **endorse** the valid proposal of the lowest view, once: "I sign digest D for window t" is
   written down first (:mod:`validator.signed`), and a validator never endorses another digest for
   that window, also after a restart;
4. **lead** when the rotation gives it a view that has begun (view 0: right after the intake
   closes; view v: ``handover_s × v(v + 1)/2`` later (:mod:`protocol.quorum`), or as soon as more than n − m validators objected to
   the proposal of view v − 1, which can then never be certified) and it has endorsed nothing:
   decide the window as a
   single validator does (:mod:`validator.decide`), write the decision down, and publish the
   proposal with its own endorsement;
5. **certify** as soon as m endorsements of one digest are in the store: the certificate (the
   aggregate and those endorsements) goes to the aggregate key, where peers read it; what lies
   there and is not a certificate of this chain (junk, a forgery) is replaced.

The window ends when a certificate continuing the chain is at the aggregate key, whoever wrote
it: a validator advances with the θ_{t+1} it decided (its own proposal) or recomputed (one it
judged), or replays the aggregate as a restarted validator does. With fewer than m validators
running, nobody certifies anything: the run stalls and nothing forks; it continues when a quorum
is back.

``fault = "liar"`` makes this validator misbehave on purpose (``sparseloco demo --faults liar``):
as leader it proposes an aggregate whose Δ̄ is not the sum it claims, and it endorses every
proposal it reads without judging it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from protocol import broadcast, layout
from protocol.aggregate import apply_outer
from protocol.caps import proposal_bytes, published_bytes
from protocol.config import RunSpec
from protocol.errors import ConfigError, ObjectExists, ObjectNotFound, ProtocolError
from protocol.events import AgreementStep, Event, WindowPublished
from protocol.identity import Identity
from protocol.model import fingerprint, param_schema
from protocol.quorum import Quorum
from protocol.replay import Chain, Position, apply_aggregate
from protocol.store.base import ObjectStore
from protocol.wire import Aggregate, SparseDelta, Verified
from protocol.wire.delta import round_values
from protocol.wire.quorum import (
    Endorsement,
    Objection,
    Proposal,
    Reason,
    caps_of,
    decode_certificate,
    decode_endorsement,
    decode_objection,
    decode_proposal,
    encode_certificate,
    encode_endorsement,
    encode_objection,
    encode_proposal,
)
from validator import publish
from validator.commit import VIEW, Committer, Proposed
from validator.decide import WindowDecision
from validator.follow import Follower, Judgement, stated_reference
from validator.log import AgreementRecord, ContributionLog
from validator.reference import NormReference
from validator.signed import SigningRecord
from validator.state import ValidatorState
from validator.window import PhaseClock

__all__ = ["FAULTS", "Agreement"]

FAULTS = ("liar",)

log = logging.getLogger(__name__)


@dataclass
class Round:
    """What one validator has read and done in one window's agreement."""

    window: int
    base: str
    closed_at: float
    proposals: dict[str, Verified[Proposal]] = field(default_factory=dict)  # proposer → its proposal
    blobs: dict[str, bytes] = field(default_factory=dict)  # proposer → the aggregate bytes inside it
    unreadable: set[str] = field(default_factory=set)  # keys read once that did not verify
    judged: dict[str, Judgement] = field(default_factory=dict)  # proposer → this validator's verdict
    endorsements: dict[str, tuple[Verified[Endorsement], bytes]] = field(default_factory=dict)
    objections: set[str] = field(default_factory=set)  # objection keys read
    reread: dict[str, int] = field(default_factory=dict)  # signer → the view its endorsement was last read in
    objected: dict[str, set[str]] = field(default_factory=dict)  # aggregate digest → who objected to it
    read: dict[str, bytes] = field(default_factory=dict)  # contributions the intake read: peer → bytes
    mine: Proposed | None = None
    view: int = 0  # the newest view this validator has seen begin


class Agreement:
    """Runs the agreement of each window for one validator of a run with several (module doc)."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state_dir: Path,
        log: ContributionLog,
        follower: Follower,
        committer: Committer,
        chain: Chain,
        *,
        clock: Callable[[], float],
        emit: Callable[[Event], None],
        wait: Callable[[float], bool],
        poll_s: float,
        fault: str = "",
    ) -> None:
        if fault and fault not in FAULTS:
            raise ConfigError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        self.spec, self.store, self.identity = spec, store, identity
        self.log, self.follower, self.committer, self.chain = log, follower, committer, chain
        self.quorum = Quorum.of(spec)
        self.me = identity.peer_id
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.keys = self.quorum.keys
        self.record = SigningRecord(state_dir)
        self.clock, self.emit, self.wait, self.poll_s = clock, emit, wait, max(poll_s, 0.01)
        self.max_proposal = proposal_bytes(spec)
        self.max_published = published_bytes(spec)
        self.schema = param_schema(spec.model)
        self.liar = fault == "liar"

    def run(
        self,
        st: ValidatorState,
        closed_at: float,
        lead: Callable[[int], WindowDecision],
        unannounced: int,
        read: Mapping[str, bytes] | None = None,
    ) -> WindowPublished | None:
        """Agree on window ``st.window`` (its intake closed at ``closed_at``): the report once its
        aggregate is certified, None when stopped first. ``lead(view)``: this validator's decision;
        ``read``: the contributions its intake read (peer → bytes), which judging does not fetch again."""
        r = Round(st.window, st.base, closed_at, read=dict(read or {}))
        clock = PhaseClock()
        while True:
            found = self.chain.next_aggregate(r.window, r.base)
            if found is not None:
                return self._finish(st, r, found, clock)
            r.view = max(r.view, self.quorum.view_at(self.clock() - closed_at), self._refused(r))
            self._read(r)
            self._judge(st, r)
            self._endorse(r)
            self._lead(st, r, lead, unannounced)
            if self._certify(r):
                continue
            if self.wait(self.poll_s):
                return None

    def _refused(self, r: Round) -> int:
        """The view after the newest one whose proposal more than n − m validators objected to:
        it can never be certified, so its successor need not wait for the timeout."""
        doomed = [
            r.proposals[p].value.view + 1
            for p in r.proposals
            if len(r.objected.get(r.proposals[p].value.aggregate.digest, ())) > self.quorum.n - self.quorum.m
        ]
        return max(doomed, default=0)

    # ------------------------------------------------------------------ 1. read
    def _read(self, r: Round) -> None:
        ids = set(self.quorum.ids)
        for key in self.store.list_written_by(layout.proposal_prefix(self.run_id, r.window), ids):
            proposer = key.rsplit("/", 1)[-1]
            if proposer in ids and proposer not in r.proposals and key not in r.unreadable:
                self._read_proposal(r, key, proposer)
        for key in self.store.list_written_by(layout.endorsement_prefix(self.run_id, r.window), ids):
            signer = key.rsplit("/", 1)[-1]
            if signer in ids and (signer not in r.endorsements or self._changed(r, signer)) and key not in r.unreadable:
                self._read_endorsement(r, key, signer)
        for key in self.store.list_written_by(layout.objection_prefix(self.run_id, r.window), ids):
            if key not in r.objections:
                r.objections.add(key)
                self._read_objection(r, key)

    def _changed(self, r: Round, signer: str) -> bool:
        """Whether ``signer``'s endorsement is worth reading again: only a validator that lies
        rewrites its own, so it is read again once per view, and only while the digest it signed
        has no quorum."""
        digest = r.endorsements[signer][0].value.aggregate
        if signer == self.me or r.reread.get(signer, 0) >= r.view:
            return False
        r.reread[signer] = r.view
        return sum(e.value.aggregate == digest for e, _ in r.endorsements.values()) < self.quorum.m

    def _read_proposal(self, r: Round, key: str, proposer: str) -> None:
        try:
            blob = self.store.get(key, max_bytes=self.max_proposal)
            p = decode_proposal(
                blob,
                run_hash=self.run_hash,
                max_bytes=self.max_proposal,
                allowed_signers=self.keys,
                window=r.window,
                schema=self.schema,
            )
            if p.sender != proposer:
                raise ProtocolError(f"signed by {p.sender}, stored under {proposer}")
        except ObjectNotFound:
            return
        except ProtocolError as exc:
            r.unreadable.add(key)
            log.warning("the proposal at %s does not verify (%s): %s", key, exc.reason, exc)
            self._note(
                AgreementRecord(
                    window=r.window, validator=proposer, event="objected", detail=f"unreadable proposal: {exc}"
                )
            )
            return
        r.proposals[proposer] = p
        r.blobs[proposer] = _inner(blob, p.value.aggregate.size)
        self._note(
            AgreementRecord(
                window=r.window,
                validator=proposer,
                event="proposed",
                digest=p.value.aggregate.digest,
                view=p.value.view,
            )
        )

    def _read_endorsement(self, r: Round, key: str, signer: str) -> None:
        try:
            blob = self.store.get(key, max_bytes=2048)
            e = decode_endorsement(
                blob, run_hash=self.run_hash, allowed_signers=self.keys, window=r.window, sender=signer
            )
        except ObjectNotFound:
            return
        except ProtocolError as exc:
            r.unreadable.add(key)
            log.warning("the endorsement at %s does not verify (%s): %s", key, exc.reason, exc)
            return
        before = r.endorsements.get(signer)
        r.endorsements[signer] = (e, blob)
        if before is not None and before[0].value.aggregate == e.value.aggregate:
            return
        self._note(
            AgreementRecord(
                window=r.window, validator=signer, event="endorsed", digest=e.value.aggregate, view=e.value.view
            )
        )

    def _read_objection(self, r: Round, key: str) -> None:
        signer = key.split("/")[-2]
        try:
            o = decode_objection(
                self.store.get(key, max_bytes=1 << 16),
                run_hash=self.run_hash,
                allowed_signers=self.keys,
                window=r.window,
                sender=signer,
            )
        except ObjectNotFound:
            return
        except ProtocolError as exc:
            log.warning("the objection at %s does not verify (%s): %s", key, exc.reason, exc)
            return
        r.objected.setdefault(o.value.aggregate, set()).add(signer)
        detail = "\n".join(f"{x.check} {x.peer or '-'}: {x.detail}" for x in o.value.reasons)
        self._note(
            AgreementRecord(
                window=r.window,
                validator=signer,
                event="objected",
                digest=o.value.aggregate,
                view=o.value.view,
                detail=detail,
            )
        )

    # ------------------------------------------------------------------ 2. judge
    def _judge(self, st: ValidatorState, r: Round) -> None:
        for proposer, p in sorted(r.proposals.items(), key=lambda kv: kv[1].value.view):
            if proposer in r.judged or proposer == self.me or p.value.view > r.view:
                continue  # a view that has not begun here is judged when it does
            if self.liar:
                r.judged[proposer] = Judgement(())
                continue
            verdict = self.follower.judge(
                p,
                base=st.base,
                previous_base=st.previous_base,
                params=st.params,
                feedback=self.committer.feedback,
                reference=st.reference,
                read=r.read,
            )
            r.judged[proposer] = verdict
            if not verdict.endorsed:
                self._object(r, proposer, p, verdict.reasons)

    def _object(self, r: Round, proposer: str, p: Verified[Proposal], reasons: tuple[Reason, ...]) -> None:
        o = Objection(self.run_hash, r.window, p.value.view, proposer, p.value.aggregate.digest, reasons)
        key = layout.objection_key(self.run_id, r.window, self.me, proposer)
        self.store.put(key, encode_objection(o, self.identity))
        # Logged now, not when read back: the window may be certified before the next read.
        r.objections.add(key)
        self._note(
            AgreementRecord(
                window=r.window,
                validator=self.me,
                event="objected",
                digest=o.aggregate,
                view=o.view,
                detail="\n".join(f"{x.check} {x.peer or '-'}: {x.detail}" for x in reasons),
            )
        )
        log.warning(
            "window %d: objection to %s's proposal (view %d): %s",
            r.window,
            proposer,
            p.value.view,
            "; ".join(f"{x.check} {x.peer or '-'}: {x.detail}" for x in reasons),
        )

    # ------------------------------------------------------------------ 3. endorse
    def _endorse(self, r: Round) -> None:
        valid = [
            (self.proposals_view(r, proposer), proposer) for proposer, verdict in r.judged.items() if verdict.endorsed
        ]
        if self.liar:
            for _, proposer in sorted(valid):
                self._sign(r, proposer, force=True)
            return
        signed = self.record.signed(r.window)
        if signed is not None:
            self._resign(r, signed)
            return
        if valid:
            self._sign(r, min(valid)[1])

    def proposals_view(self, r: Round, proposer: str) -> int:
        return r.proposals[proposer].value.view

    def _resign(self, r: Round, digest: str) -> None:
        """After a restart: the endorsement of the digest this validator signed, put again if the
        store lost it (the record says it was signed; signing it again is no new decision)."""
        if self.me in r.endorsements:
            return
        proposer = next((p for p, v in r.proposals.items() if v.value.aggregate.digest == digest), None)
        if proposer is not None:
            self._put_endorsement(r, proposer)

    def _sign(self, r: Round, proposer: str, *, force: bool = False) -> None:
        p = r.proposals[proposer].value
        mine = r.endorsements.get(self.me)
        if mine is not None and mine[0].value.aggregate == p.aggregate.digest:
            return
        if not force and not self.record.claim(r.window, p.aggregate.digest):
            return
        self._put_endorsement(r, proposer)

    def _put_endorsement(self, r: Round, proposer: str) -> None:
        p = r.proposals[proposer].value
        e = Endorsement(self.run_hash, r.window, p.view, proposer, p.aggregate.digest)
        blob = encode_endorsement(e, self.identity)
        self.store.put(layout.endorsement_key(self.run_id, r.window, self.me), blob)
        verified = decode_endorsement(blob, run_hash=self.run_hash, allowed_signers=self.keys, window=r.window)
        r.endorsements[self.me] = (verified, blob)
        self._note(
            AgreementRecord(window=r.window, validator=self.me, event="endorsed", digest=e.aggregate, view=e.view)
        )

    # ------------------------------------------------------------------ 4. lead
    def _lead(self, st: ValidatorState, r: Round, lead: Callable[[int], WindowDecision], unannounced: int) -> None:
        first = self.quorum.first_view_of(r.window, self.me)
        if r.mine is not None or first > r.view:
            return
        if self.record.signed(r.window) is not None and not self.liar:
            return  # it endorsed a proposal of an earlier view: that one is its word for the window
        view = first + self.quorum.n * ((r.view - first) // self.quorum.n)
        if view > 0:
            self._note(AgreementRecord(window=r.window, validator=self.me, event="handover", view=view))
        d = lead(view)
        if not self.liar and self._arrived(st, r):
            return  # a valid proposal came while it decided: it endorsed that one instead of splitting the vote
        if self.liar:
            d = misstated(d, st.params, self.spec.outer.alpha)
        mine = self.committer.propose(st, d, unannounced, view=view)
        if not self.liar and not self.record.claim(r.window, mine.digest):
            return
        live = {p: d.caps.get(p) for p in d.accepted}
        blob = encode_proposal(
            view, caps_of(live), mine.blob, r.window, self.run_hash, self.identity, d.reference.to_json().encode()
        )
        self.store.put(layout.proposal_key(self.run_id, r.window, self.me), blob)
        r.mine = mine
        self._read_proposal(r, layout.proposal_key(self.run_id, r.window, self.me), self.me)
        self._put_endorsement(r, self.me)

    def _arrived(self, st: ValidatorState, r: Round) -> bool:
        """Whether a proposal it can endorse arrived while it decided (read, judged and endorsed
        now, before its own decision is signed)."""
        self._read(r)
        self._judge(st, r)
        self._endorse(r)
        return self.record.signed(r.window) is not None

    # ------------------------------------------------------------------ 5. certify
    def _certify(self, r: Round) -> bool:
        """Write the certificate once a quorum endorsed one digest whose proposal this validator
        holds; whether one was written (or found written)."""
        by_digest: dict[str, list[tuple[str, bytes]]] = {}
        for signer, (e, blob) in r.endorsements.items():
            by_digest.setdefault(e.value.aggregate, []).append((signer, blob))
        for digest, signed in by_digest.items():
            if not self.quorum.quorate([s for s, _ in signed]):
                continue
            proposer = next((p for p, v in r.proposals.items() if v.value.aggregate.digest == digest), None)
            if proposer is None:
                continue
            blobs = [b for _, b in sorted(signed)][: self.quorum.n]
            cert = encode_certificate(r.blobs[proposer], blobs, r.window, self.run_hash, self.identity)
            try:
                publish.put_chain(
                    self.store,
                    layout.aggregate_key(self.run_id, r.window),
                    cert,
                    belongs=lambda found: self._certifies(found, r),
                    max_bytes=self.max_published,
                )
            except ObjectExists:
                pass  # another validator's certificate of this window: the chain reads it
            return True
        return False

    def _certifies(self, data: bytes, r: Round) -> bool:
        try:
            cert = decode_certificate(
                data,
                run_hash=self.run_hash,
                max_bytes=self.max_published,
                allowed_signers=self.keys,
                quorum=self.quorum.m,
                window=r.window,
            )
        except ProtocolError:
            return False
        return cert.value.aggregate.value.base == r.base

    # ------------------------------------------------------------------ the end of a window
    def _finish(self, st: ValidatorState, r: Round, found: Verified[Aggregate], clock: PhaseClock) -> WindowPublished:
        signers = self._signers(r)
        agg = found.value
        view = int(agg.metadata.get(VIEW, 0)) if isinstance(agg.metadata.get(VIEW, 0), int) else 0
        self._note(
            AgreementRecord(
                window=r.window,
                validator=found.sender,
                event="certified",
                digest=found.digest,
                view=view,
                detail=",".join(signers),
            )
        )
        if r.mine is not None and r.mine.digest == found.digest:
            return self.committer.certified(st, r.mine, signers, clock)
        verdict = next(
            (
                r.judged.get(p)
                for p, v in r.proposals.items()
                if v.value.aggregate.digest == found.digest and p in r.judged
            ),
            None,
        )
        if verdict is not None and verdict.params is not None and not self.liar:
            self.committer.adopt(found, verdict.params, verdict.feedback, verdict.reference)
        else:
            params = {n: p.detach().clone() for n, p in st.params.items()}
            apply_aggregate(params, Position(st.window, st.base, ""), found)
            self.committer.adopt(found, params, ref=self.reference_after(found))
        report = _adopted(found, signers, view)
        self.emit(report)
        return report

    def reference_after(self, found: Verified[Aggregate]) -> NormReference | None:
        """The norm reference the certified aggregate ``found`` names, from its leader's proposal
        (None when that is gone or does not match: the validator keeps its own)."""
        key = layout.proposal_key(self.run_id, found.value.window, found.sender)
        try:
            p = decode_proposal(
                self.store.get(key, max_bytes=self.max_proposal),
                run_hash=self.run_hash,
                max_bytes=self.max_proposal,
                allowed_signers=self.keys,
                window=found.value.window,
            )
        except (ObjectNotFound, ProtocolError) as exc:
            log.warning(
                "window %d: the reference after it is not known (%s); keeping this validator's", found.value.window, exc
            )
            return None
        return stated_reference(p.value) if p.value.aggregate.digest == found.digest else None

    def _signers(self, r: Round) -> tuple[str, ...]:
        try:
            data = self.store.get(layout.aggregate_key(self.run_id, r.window), max_bytes=self.max_published)
            cert = decode_certificate(
                data,
                run_hash=self.run_hash,
                max_bytes=self.max_published,
                allowed_signers=self.keys,
                quorum=self.quorum.m,
            )
        except (ObjectNotFound, ProtocolError):
            return ()
        return cert.value.signers

    def _note(self, rec: AgreementRecord) -> None:
        rec = replace(rec, at=self.clock())
        self.log.record_agreement([rec])
        self.emit(
            AgreementStep(
                window=rec.window,
                validator=rec.validator,
                step=rec.event,
                digest=rec.digest,
                view=rec.view,
                detail=rec.detail or "",
            )
        )


def _inner(blob: bytes, size: int) -> bytes:
    """The aggregate bytes a proposal carries: its payload, the ``size`` bytes before the signature."""
    return blob[len(blob) - 64 - size : len(blob) - 64]


def _adopted(found: Verified[Aggregate], signers: tuple[str, ...], view: int) -> WindowPublished:
    agg = found.value
    loss = agg.metadata.get("val_loss")
    return WindowPublished(
        window=agg.window,
        accepted=len(agg.manifest),
        rejected=int(agg.metadata.get("rejected", 0) or 0),
        val_loss=float(loss) if isinstance(loss, (int, float)) else math.nan,
        digest=found.digest,
        fingerprint=agg.fingerprint,
        published_at=agg.published_at,
        leader=found.sender,
        view=view,
        signers=list(signers),
    )


def misstated(d: WindowDecision, params: Mapping[str, torch.Tensor], alpha: float) -> WindowDecision:
    """The decision with Δ̄ four times the sum it claims to be, θ_{t+1} and its fingerprint made to
    match (what a lying leader proposes: only recomputing the sum shows it)."""
    tensors = {
        n: replace(t, values=round_values(t.values * 4.0))
        if isinstance(t, SparseDelta)
        else replace(t, base=t.base * 4.0)
        for n, t in d.trial.tensors.items()
    }
    nxt = {n: p.detach().clone() for n, p in params.items()}
    apply_outer(nxt, broadcast.applied(tensors), alpha)
    return replace(d, trial=replace(d.trial, tensors=tensors, params=nxt), fingerprint=fingerprint(nxt))
