"""An audit of a run from its store alone: every published aggregate recomputed, with no validator key.

Anyone who can read a run's store can check what its validators published, with the settings a
peer uses (``sparseloco-validator audit --run run.toml``). θ is rebuilt from θ₀ (or, from ``--from
W``, from the newest signed checkpoint at or below W and the aggregates after it) and carried window
by window with the published aggregates (:func:`protocol.replay.apply_aggregate`); each window gets
one verdict: ``ok``, ``mismatch`` (with what differs) or ``unchecked`` (with why):

* **the aggregate** — what lies at ``aggregate/<t>`` verifies (a plain signed aggregate with one
  validator; a certificate with m distinct valid endorsements with several) and chains on the
  previous aggregate's digest;
* **several validators** — the proposal of the aggregate's signer (``proposal/<t>/<signer>``)
  exists and carries exactly this aggregate, and :meth:`validator.follow.Follower.judge` re-checks
  it as a follower would: every contribution fetched by digest and screened, Δ̄ (clipped to the
  proposal's caps, weighted by its manifest, in published form) and θ_{t+1} recomputed bit for
  bit; the norm and cap bounds against the reference the certified aggregates name, carried from
  genesis (unknown from a checkpoint: then skipped, :data:`NOTES`);
* **one validator** — no proposal is published, so no clip caps, and the exact Δ̄ cannot be
  recomputed: every contribution the manifest names must exist with its digest and pass the
  per-contribution checks, and θ_t minus the published Δ̄ must have the signed fingerprint;
* **re-compressed Δ̄** (``outer.recompress`` with at least ``outer.recompress_from``
  contributions) depends on the validator's error-feedback buffer; the audit carries it itself from
  θ₀ (the follower's judgement returns it), but from a checkpoint it is unknown: such windows are
  ``unchecked: re-compressed, buffer unknown``, never mismatches;
* **contributions deleted by retention** leave a window ``unchecked: contributions gone``.

A window whose aggregate does not verify, does not chain, or whose θ does not reproduce its
signed fingerprint is a mismatch after which θ cannot be carried: the audit stops there. It also
stops at the head (the first window with nothing published)::

    auditor = Auditor(spec, store)
    for row in auditor.windows(start=0, end=None):
        print(row.window, row.verdict, row.detail)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from protocol import broadcast, layout
from protocol.caps import proposal_bytes, published_bytes
from protocol.chain import checkpoint_base, decode_published
from protocol.config import RunSpec
from protocol.errors import ConfigError, DigestMismatch, ObjectNotFound, ProtocolError
from protocol.feedback import FeedbackState
from protocol.model import param_schema
from protocol.quorum import Quorum
from protocol.replay import Chain, Position, apply_aggregate, replay
from protocol.store.base import ObjectStore
from protocol.wire import Aggregate, Verified
from protocol.wire.quorum import Reason, decode_certificate, decode_proposal
from validator.follow import Follower
from validator.reference import NormReference
from validator.trial import Aggregator

__all__ = ["MISMATCH", "NOTES", "OK", "UNCHECKED", "AuditReport", "Auditor", "WindowAudit"]

OK, MISMATCH, UNCHECKED = "ok", "mismatch", "unchecked"
GONE = "contributions gone"
BUFFER_UNKNOWN = "re-compressed, buffer unknown"

NOTES = {
    "several": "the norm and clip-cap bounds are checked against the norm reference the run's aggregates "
    "name, carried from genesis; from a checkpoint (or past a window that did not verify) that "
    "reference is unknown and those bounds are skipped",
    "single": "Δ̄ is not recomputed: a single validator publishes no clip caps; each contribution "
    "and θ_(t+1)'s fingerprint are checked",
}


@dataclass(frozen=True)
class WindowAudit:
    """The verdict on one window's published aggregate (module doc)."""

    window: int
    verdict: str  # OK, MISMATCH or UNCHECKED
    leader: str = ""  # the validator that signed the aggregate ("" when it does not verify)
    signers: tuple[str, ...] = ()  # the validators whose endorsements the certificate carries
    contributions: int = 0
    detail: str = ""
    digest: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "window": self.window,
            "verdict": self.verdict,
            "leader": self.leader,
            "signers": list(self.signers),
            "contributions": self.contributions,
            "detail": self.detail,
            "digest": self.digest,
        }


@dataclass
class AuditReport:
    """Every window audited, in order, and what the audit could not check."""

    start: int
    rows: list[WindowAudit] = field(default_factory=list)
    notes: tuple[str, ...] = ()

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.rows)

    @property
    def passed(self) -> bool:
        return self.count(MISMATCH) == 0

    def summary(self) -> dict[str, object]:
        return {
            "summary": True,
            "start": self.start,
            "windows": len(self.rows),
            "ok": self.count(OK),
            "mismatch": self.count(MISMATCH),
            "unchecked": self.count(UNCHECKED),
            "notes": list(self.notes),
        }


@dataclass
class _Carried:
    """What the audit carries from one window to the next: θ, its position, the base accepted with
    ``outer.delay`` and the validator's re-compression buffer (None: unknown)."""

    params: MutableMapping[str, torch.Tensor]
    pos: Position
    previous_base: str | None
    feedback: FeedbackState | None
    # the norm reference the aggregates name (several validators; None: unknown, from a checkpoint)
    reference: NormReference | None = None


class Auditor:
    """Audits the run ``spec`` in ``store`` (module doc); needs no key and writes nothing."""

    def __init__(self, spec: RunSpec, store: ObjectStore, *, workers: int = 2) -> None:
        self.spec, self.store = spec, store
        self.chain = Chain(spec, store)
        self.quorum = Quorum.of(spec)
        self.several = self.quorum.several
        self.schema = param_schema(spec.model)
        self.max_published = published_bytes(spec)
        self.max_proposal = proposal_bytes(spec)
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="audit")
        # Δ̄ is formed exactly as a validator forms it; no loss is measured, so no model or dataset
        aggregator = Aggregator(
            spec, torch.nn.Module(), None, self.pool, workers=max(1, workers), device=torch.device("cpu")
        )
        self.follower = Follower(spec, store, aggregator)

    @property
    def notes(self) -> tuple[str, ...]:
        return (NOTES["several"] if self.several else NOTES["single"],)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def audit(
        self, start: int | None = None, end: int | None = None, progress: Callable[[WindowAudit], None] | None = None
    ) -> AuditReport:
        """Every window from ``start`` (None: 0) to ``end`` (inclusive; None: the head)."""
        report = AuditReport(start or 0, notes=self.notes)
        for row in self.windows(start, end):
            report.rows.append(row)
            if progress is not None:
                progress(row)
        return report

    def windows(self, start: int | None = None, end: int | None = None) -> Iterator[WindowAudit]:
        """The verdict of each window from ``start`` to ``end`` (module doc), in order. From θ₀ with a
        re-compression buffer to keep, the windows before ``start`` are recomputed too (silently:
        only one that stops the audit is reported), since the buffer after them is needed."""
        first = start or 0
        c = self._start(first)
        if c.pos.window < first and not (c.pos.window == 0 and broadcast.keeps_feedback(self.spec.outer)):
            self._replay(c, first)  # nothing to recompute before ``first``: θ alone is carried
        while end is None or c.pos.window <= end:
            row = self._window(c)
            if row is None:
                return
            stops = row.verdict == MISMATCH and c.pos.window == row.window  # θ could not be carried past it
            if row.window >= first or stops:
                yield row
            if stops:
                return

    # ------------------------------------------------------------------ where the audit begins
    def _start(self, start: int) -> _Carried:
        """θ of the newest signed checkpoint at or below ``start`` (θ₀ at genesis); the buffer is
        known only at genesis (or when the run keeps none)."""
        try:
            launch = self.chain.launch()
        except ObjectNotFound as exc:
            raise ConfigError(f"the store holds no launch of run {self.chain.run}: {exc}") from exc
        pos = Position(0, launch.digest, launch.value.fingerprint, launch.value.published_at)
        params: MutableMapping[str, torch.Tensor] = self.chain.checkpoint_params(launch.value)
        for w in reversed([w for w in self.chain.checkpoint_windows() if 0 < w <= start]):
            try:
                manifest = self.chain.manifest(w)
                base = checkpoint_base(manifest, launch.digest)
                params = self.chain.checkpoint_params(manifest.value)
            except (ProtocolError, ObjectNotFound):
                continue  # a checkpoint that does not verify is not one to start from
            pos = Position(w, base, manifest.value.fingerprint, manifest.value.published_at)
            break
        known = pos.window == 0 or not broadcast.keeps_feedback(self.spec.outer)
        return _Carried(
            params,
            pos,
            self._previous_base(pos, launch.digest),
            FeedbackState() if known else None,
            NormReference() if pos.window == 0 else None,
        )

    def _replay(self, c: _Carried, until: int) -> None:
        """θ carried to window ``until`` with the published aggregates (their fingerprints checked),
        the buffer then unknown when the run keeps one."""
        for verified, after in replay(self.chain, c.params, c.pos, until=until):
            c.previous_base, c.pos = verified.value.base, after
            c.feedback = self._feedback_after(c, verified.value)
            c.reference = None

    def _previous_base(self, pos: Position, launch: str) -> str | None:
        """The base of window ``pos.window − 1`` (window 0: the launch; None when unreadable)."""
        if pos.window == 0:
            return launch
        try:
            before = self.chain.aggregate(pos.window - 1)
        except ProtocolError:
            return None
        return before.value.base if before is not None else None

    # ------------------------------------------------------------------ one window
    def _window(self, c: _Carried) -> WindowAudit | None:
        t = c.pos.window
        try:
            data = self.store.get(layout.aggregate_key(self.chain.run, t), max_bytes=self.max_published)
            verified, signers = self._published(data, t)
        except ObjectNotFound:
            return None
        except ProtocolError as exc:  # over its cap, junk, under-signed, another run's
            return WindowAudit(t, MISMATCH, detail=f"the aggregate does not verify ({exc.reason}): {exc}")
        agg = verified.value
        row = WindowAudit(t, OK, verified.sender, signers, len(agg.manifest), digest=verified.digest)
        if agg.base != c.pos.base:
            return _with(row, MISMATCH, f"builds on {agg.base[:16]}, the previous aggregate is {c.pos.base[:16]}")
        verdict, detail, feedback = self._several(c, verified) if self.several else self._single(c, agg)
        before = c.pos.base
        try:
            c.pos = apply_aggregate(c.params, c.pos, verified)
        except DigestMismatch as exc:
            return _with(row, MISMATCH, _join(detail if verdict == MISMATCH else "", str(exc)))
        c.previous_base, c.feedback = before, feedback
        return _with(row, verdict, detail)

    def _published(self, data: bytes, t: int) -> tuple[Verified[Aggregate], tuple[str, ...]]:
        run_hash, keys = self.chain.run_hash, self.spec.validator.public_keys
        if not self.several:
            v = decode_published(
                data,
                run_hash=run_hash,
                max_bytes=self.max_published,
                allowed_signers=keys,
                window=t,
                schema=self.schema,
            )
            return v, (v.sender,)
        cert = decode_certificate(
            data,
            run_hash=run_hash,
            max_bytes=self.max_published,
            allowed_signers=keys,
            quorum=self.quorum.m,
            window=t,
            schema=self.schema,
        )
        return cert.value.aggregate, cert.value.signers

    def _single(self, c: _Carried, agg: Aggregate) -> tuple[str, str, FeedbackState | None]:
        """One validator: the contributions by digest and their checks (the fingerprint follows)."""
        feedback = self._feedback_after(c, agg)
        reasons = list(self._aggregate_fields(agg))
        try:
            _, found = self.follower.contributions(agg, c.previous_base)
        except ProtocolError as exc:  # what the store returned for a contribution key, refused whole
            found = [Reason("contribution", "", f"{exc.reason}: {exc}")]
        reasons += found
        verdict, detail = _verdict(reasons, buffer_unknown=False)
        return verdict, detail or "Δ̄ not recomputed (no clip caps published)", feedback

    def _several(self, c: _Carried, verified: Verified[Aggregate]) -> tuple[str, str, FeedbackState | None]:
        """Several validators: the signer's proposal carries this aggregate; the follower's checks."""
        agg, t = verified.value, verified.value.window
        key = layout.proposal_key(self.chain.run, t, verified.sender)
        unknown = self._feedback_after(c, agg)
        try:
            data = self.store.get(key, max_bytes=self.max_proposal)
            proposal = decode_proposal(
                data,
                run_hash=self.chain.run_hash,
                max_bytes=self.max_proposal,
                allowed_signers=[verified.public_key],
                window=t,
                schema=self.schema,
            )
        except ObjectNotFound:
            return MISMATCH, f"no proposal by its signer at {key}", unknown
        except ProtocolError as exc:
            return MISMATCH, f"the proposal of its signer does not verify ({exc.reason}): {exc}", unknown
        if proposal.value.aggregate.digest != verified.digest:
            got = proposal.value.aggregate.digest[:16]
            return MISMATCH, f"the signer's proposal carries aggregate {got}, not {verified.digest[:16]}", unknown
        try:
            judgement = self.follower.judge(
                proposal,
                base=c.pos.base,
                previous_base=c.previous_base,
                params=c.params,
                feedback=c.feedback or FeedbackState(),
                reference=c.reference,  # the one the run's aggregates named; None: the bounds are skipped
            )
        except ProtocolError as exc:  # e.g. caps for a tensor the model does not have
            return MISMATCH, f"the proposal cannot be recomputed ({exc.reason}): {exc}", unknown
        buffer_unknown = c.feedback is None and broadcast.recompresses(self.spec.outer, len(agg.manifest))
        verdict, detail = _verdict(list(judgement.reasons), buffer_unknown=buffer_unknown)
        after = judgement.feedback if verdict == OK and judgement.feedback is not None else unknown
        c.reference = judgement.reference if verdict == OK else None
        return verdict, detail, after

    def _feedback_after(self, c: _Carried, agg: Aggregate) -> FeedbackState | None:
        """The buffer after ``agg`` without recomputing Δ̄: unchanged unless Δ̄ was re-compressed
        with a buffer to keep (then unknown)."""
        if not broadcast.recompresses(self.spec.outer, len(agg.manifest)):
            return c.feedback
        if not broadcast.keeps_feedback(self.spec.outer):
            return FeedbackState()
        return None

    def _aggregate_fields(self, agg: Aggregate) -> Iterator[Reason]:
        """What a single validator's aggregate must hold whatever its Δ̄: the run's α, at most
        ``validator.max_contributors`` contributions, every weight in (0, 1]."""
        if agg.alpha != self.spec.outer.alpha:
            yield Reason("aggregate", "", f"alpha {agg.alpha}, the run's is {self.spec.outer.alpha}")
        if len(agg.manifest) > self.spec.validator.max_contributors:
            yield Reason(
                "aggregate", "", f"{len(agg.manifest)} contributions, at most {self.spec.validator.max_contributors}"
            )
        for m in agg.manifest:
            if not 0.0 < m.weight <= 1.0:
                yield Reason("aggregate", m.peer_id, f"weight {m.weight} outside (0, 1]")


def _gone(r: Reason) -> bool:
    return r.check == "contribution" and r.detail == "not in the store"


def _verdict(reasons: list[Reason], *, buffer_unknown: bool) -> tuple[str, str]:
    """A window's verdict from what its checks found: contributions missing and, without the buffer,
    a re-compressed Δ̄ that differs leave it unchecked; anything else is a mismatch."""
    recomputed = {"delta", "fingerprint"}
    real = [r for r in reasons if not _gone(r) and not (buffer_unknown and r.check in recomputed)]
    if real:
        return MISMATCH, "; ".join(_reason_text(r) for r in real)
    gone = [r.peer for r in reasons if _gone(r)]
    if gone:
        return UNCHECKED, f"{GONE}: {len(gone)} of the manifest's ({', '.join(p[:8] for p in gone)})"
    if buffer_unknown:
        return UNCHECKED, BUFFER_UNKNOWN
    return OK, ""


def _reason_text(r: Reason) -> str:
    return f"{r.check} {r.peer[:8]}: {r.detail}" if r.peer else f"{r.check}: {r.detail}"


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _with(row: WindowAudit, verdict: str, detail: str) -> WindowAudit:
    return WindowAudit(row.window, verdict, row.leader, row.signers, row.contributions, detail, row.digest)
