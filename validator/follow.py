"""A follower's check of a leader's proposal: endorse it, or object with reasons and numbers.

In a run with several validators (:mod:`protocol.quorum`) every validator that did not propose a
window's aggregate re-checks what the leader proposed (:class:`protocol.wire.quorum.Proposal`)
before it signs. Everything a validator decides from public bytes alone is checked exactly; what
rests on its own private state (its norm reference, which follows the decisions it saw) is checked
within a stated tolerance, so that honest validators whose references drifted apart never object
to each other:

* **the proposal** — signed by the leader of the view it claims, on the chain's head (``base``),
  with the run's ``outer.alpha``, at most ``validator.max_contributors`` contributions, every weight
  in (0, 1], clip caps for exactly the contributions it names (``proposal``);
* **every contribution, by digest** — at ``contrib/<t>/<peer>`` with exactly the digest the manifest
  names, and passing the per-contribution checks: signature, window, codec, shapes, finite values,
  base (``contribution``: :func:`validator.checks.screen`);
* **norms and caps against this validator's reference** — no tensor above
  ``TOLERANCE × norm_max_ratio`` × the reference, no clip cap above
  ``TOLERANCE × clip_headroom`` × it (``norm``, ``caps``; skipped while the reference is empty);
* **Δ̄ and θ_{t+1}, bit for bit** — the contributions decoded, clipped to the proposal's caps,
  weighted by its manifest, summed and put in published form (:meth:`validator.trial.Aggregator.published`)
  must give exactly the proposal's tensors, and θ_t minus them exactly its fingerprint (``delta``,
  ``fingerprint``).

Copies and loss scores are not re-decided: whether an upload came first, and a loss measured on
other hardware, are not the same bits on every validator; a follower's own scoring is its own
business and does not veto a proposal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protocol import layout
from protocol.caps import object_caps
from protocol.codec import Encoded, pack
from protocol.config import RunSpec
from protocol.errors import ObjectNotFound
from protocol.feedback import FeedbackState
from protocol.model import fingerprint, param_schema
from protocol.quorum import Quorum
from protocol.store.base import ObjectStore
from protocol.wire import Aggregate, AggregateTensor, ManifestEntry, SparseDelta, Verified
from protocol.wire.quorum import Proposal, Reason, limits_of
from validator import checks
from validator.commit import REFERENCE_DIGEST
from validator.held import Held
from validator.reference import NormReference, check_norms, window_value
from validator.trial import Aggregator

__all__ = ["TOLERANCE", "Follower", "Judgement", "reference_problems", "stated_reference"]

TOLERANCE = 2.0  # how far a proposal's norms and caps may exceed this validator's own bounds


@dataclass(frozen=True)
class Judgement:
    """A follower's verdict on a proposal: ``reasons`` empty to endorse it; with it, the buffer
    after the aggregate and θ_{t+1} the follower computed itself (None when it objects)."""

    reasons: tuple[Reason, ...]
    feedback: FeedbackState | None = None
    params: dict[str, torch.Tensor] | None = None
    reference: NormReference | None = None  # the norm reference after the window, as stated

    @property
    def endorsed(self) -> bool:
        return not self.reasons


class Follower:
    """Judges proposals of one run (module doc) with the validator's aggregator and store."""

    def __init__(self, spec: RunSpec, store: ObjectStore, aggregator: Aggregator) -> None:
        self.spec, self.store, self.aggregator = spec, store, aggregator
        self.quorum = Quorum.of(spec)
        self.run_hash = spec.hash()
        self.run = layout.run_id(self.run_hash)
        self.schema = param_schema(spec.model)
        self.max_bytes = object_caps(spec).contribution

    def judge(
        self,
        proposal: Verified[Proposal],
        *,
        base: str,
        previous_base: str | None,
        params: Mapping[str, torch.Tensor],
        feedback: FeedbackState,
        reference: NormReference | None,
        read: Mapping[str, bytes] | None = None,
    ) -> Judgement:
        """The verdict on ``proposal`` for the window open at ``base`` with θ_t = ``params`` and the
        norm reference ``reference`` (None: unknown, the bounds that rest on it are skipped).
        ``read``: contributions this validator already read in the window (peer → bytes); one
        with the digest the manifest names is not fetched again."""
        p, agg = proposal.value, proposal.value.aggregate.value
        reasons = self._proposal(proposal, base)
        if reasons:
            return Judgement(reasons)
        held, found = self.contributions(agg, previous_base, read)
        if found:  # without the contributions the numbers below say nothing
            return Judgement(tuple(found))
        if reference is None:  # the reference before the window is unknown (an audit from a checkpoint)
            if stated_reference(p) is None:
                found.append(Reason("reference", "", "the proposal's reference is not the one its aggregate names"))
        else:
            found += self._bounds(held, p, reference)
            found += [Reason("reference", "", why) for why in reference_problems(self.spec, p, held, reference)]
        if found:
            return Judgement(tuple(found))
        return self._recompute(p, held, params, feedback)

    # ------------------------------------------------------------------ the checks
    def _proposal(self, proposal: Verified[Proposal], base: str) -> tuple[Reason, ...]:
        p, agg = proposal.value, proposal.value.aggregate.value
        cfg, out = self.spec.validator, []
        leader = self.quorum.leader(agg.window, p.view)
        if proposal.sender != leader:
            out.append(Reason("proposal", "", f"signed by {proposal.sender}, the leader of view {p.view} is {leader}"))
        if agg.base != base:
            out.append(Reason("proposal", "", f"builds on {agg.base[:16]}, the chain's head is {base[:16]}"))
        if agg.alpha != self.spec.outer.alpha:
            out.append(Reason("proposal", "", f"alpha {agg.alpha}, the run's is {self.spec.outer.alpha}"))
        if len(agg.manifest) > cfg.max_contributors:
            out.append(Reason("proposal", "", f"{len(agg.manifest)} contributions, at most {cfg.max_contributors}"))
        for m in agg.manifest:
            if not 0.0 < m.weight <= 1.0:
                out.append(Reason("proposal", m.peer_id, f"weight {m.weight} outside (0, 1]"))
        named = {m.peer_id for m in agg.manifest}
        if set(p.caps) != named:
            extra, missing = sorted(set(p.caps) - named), sorted(named - set(p.caps))
            out.append(
                Reason(
                    "proposal", "", f"caps for {extra or 'none'} not in the manifest, missing for {missing or 'none'}"
                )
            )
        return tuple(out)

    def contributions(
        self, agg: Aggregate, previous_base: str | None, read: Mapping[str, bytes] | None = None
    ) -> tuple[dict[str, Held], list[Reason]]:
        """Every contribution the manifest names, matched by digest (fetched by key unless
        already ``read``: peer → bytes) and screened, on the aggregator's worker pool."""
        read = read or {}
        ctx = checks.Context(
            run_hash=self.run_hash,
            window=agg.window,
            expected_base=agg.base,
            previous_base=previous_base if self.spec.outer.delay else None,
            codec=self.spec.codec_at(agg.window),
            schema=self.schema,
            max_bytes=self.max_bytes,
        )
        ctx = checks.Context(**{**ctx.__dict__, "registered": frozenset(m.peer_id for m in agg.manifest)})

        def one(m: ManifestEntry) -> Held | Reason:
            return self._screened(m, agg.window, read.get(m.peer_id, b""), ctx)

        held: dict[str, Held] = {}
        reasons: list[Reason] = []
        for m, got in zip(agg.manifest, self.aggregator.pool.map(one, agg.manifest), strict=True):  # in order
            if isinstance(got, Reason):
                reasons.append(got)
            else:
                held[m.peer_id] = got
        return held, reasons

    def _screened(self, m: ManifestEntry, window: int, data: bytes, ctx: checks.Context) -> Held | Reason:
        """One named contribution matched by digest (fetched unless ``data`` is it) and screened."""
        if hashlib.sha256(data).hexdigest() != m.digest:
            try:
                data = self.store.get(layout.contrib_key(self.run, window, m.peer_id), max_bytes=self.max_bytes)
            except ObjectNotFound:
                return Reason("contribution", m.peer_id, "not in the store")
        digest = hashlib.sha256(data).hexdigest()
        if digest != m.digest:
            return Reason(
                "contribution", m.peer_id, f"the store holds {digest[:16]}, the manifest names {m.digest[:16]}"
            )
        s = checks.screen(m.peer_id, data, ctx)
        if s.reason is not None or s.held is None:
            return Reason("contribution", m.peer_id, f"{s.reason}: {s.detail or ''}".strip())
        return s.held

    def _bounds(self, held: Mapping[str, Held], p: Proposal, ref: NormReference) -> list[Reason]:
        """Norms and clip caps within :data:`TOLERANCE` of this validator's own bounds."""
        if ref.empty:
            return []
        cfg, out = self.spec.validator, []
        for peer, h in sorted(held.items()):
            row, detail = check_norms(
                h.norms.tensors, ref, max_ratio=TOLERANCE * cfg.norm_max_ratio, min_ratio=cfg.norm_min_ratio / TOLERANCE
            )
            if not row.passed:
                out.append(Reason("norm", peer, f"{row.reason}: {detail}"))
        for peer, per_tensor in sorted(p.caps.items()):
            for name, c in sorted((per_tensor or {}).items()):
                r = ref.tensors.get(name)
                if r is not None and c.norm > TOLERANCE * cfg.clip_headroom * r.norm:
                    out.append(Reason("caps", peer, f"{name}: clip cap {c.norm:.4g}, reference {r.norm:.4g}"))
        return out

    def _recompute(
        self, p: Proposal, held: Mapping[str, Held], params: Mapping[str, torch.Tensor], feedback: FeedbackState
    ) -> Judgement:
        agg = p.aggregate.value
        caps = limits_of(p.caps, self.schema)
        weights = {m.peer_id: m.weight for m in agg.manifest}
        formed = self.aggregator.published(params, feedback, held, caps, sorted(held), agg.window, weights)
        if formed is None:
            return Judgement((Reason("delta", "", "the named contributions do not give a finite θ_{t+1}"),))
        tensors, after, nxt = formed
        differs = _differences(tensors, agg.tensors)
        if differs:
            return Judgement((Reason("delta", "", differs),))
        got = fingerprint(nxt)
        if got != agg.fingerprint:
            return Judgement(
                (Reason("fingerprint", "", f"θ_(t+1) is {got[:16]}, the proposal claims {agg.fingerprint[:16]}"),)
            )
        return Judgement((), after, nxt, stated_reference(p))


def stated_reference(p: Proposal) -> NormReference | None:
    """The norm reference after the window that ``p`` states, if its aggregate's signed metadata
    names exactly these bytes (None otherwise: a proposal of another version, or a forgery)."""
    want = p.aggregate.value.metadata.get(REFERENCE_DIGEST)
    if not isinstance(want, str) or hashlib.sha256(p.reference).hexdigest() != want:
        return None
    try:
        return NormReference.from_json(p.reference.decode())
    except (ValueError, UnicodeDecodeError):
        return None


def reference_problems(spec: RunSpec, p: Proposal, held: Mapping[str, Held], ref: NormReference) -> list[str]:
    """Why the reference ``p`` states cannot follow ``ref`` (this validator's, which is the one the
    previous certified aggregate stated): it may move each tensor (and its baseline) by at most
    ``validator.reference_step`` per window, never drop a tensor, and a tensor it starts lies within
    :data:`TOLERANCE` of the lower median of the window's contributions' norms."""
    nxt = stated_reference(p)
    if nxt is None:
        return ["the proposal's reference is unreadable or not the one its aggregate names"]
    step = spec.validator.reference_step * (1 + 1e-9)
    median = window_value([h.norms.tensors for h in held.values()])
    out = [f"{name}: dropped from the reference" for name in sorted(set(ref.tensors) - set(nxt.tensors))]
    for name, t in sorted(nxt.tensors.items()):
        old = ref.tensors.get(name)
        pairs = (
            [(t.norm, old.norm, step), (nxt.base(name).norm, ref.base(name).norm, step)]
            if old is not None
            else [(t.norm, median[name].norm if name in median else 0.0, TOLERANCE)]
        )
        for new, before, bound in pairs:
            if before > 0 and not before / bound <= new <= before * bound:
                out.append(f"{name}: reference {new:.4g} after {before:.4g}, at most ×{bound:.3g} apart")
            elif before <= 0 and old is None:
                out.append(f"{name}: a reference of {new:.4g} for a tensor no contribution sent")
    return out[:8]


def _differences(mine: Mapping[str, AggregateTensor], theirs: Mapping[str, AggregateTensor]) -> str:
    """ "" when the two published forms are the same bits; otherwise where and by how much they differ."""
    if set(mine) != set(theirs):
        return f"tensors {sorted(set(mine) ^ set(theirs))[:4]} are in one Δ̄ and not the other"
    for name in sorted(mine):
        a, b = mine[name], theirs[name]
        if isinstance(a, SparseDelta) and isinstance(b, SparseDelta):
            if not torch.equal(a.indices, b.indices):
                return f"{name}: {a.nnz} positions recomputed, {b.nnz} proposed, not the same set"
            if not torch.equal(a.values, b.values):
                diff = (a.values - b.values).abs()
                n = int((diff > 0).sum())
                return f"{name}: {n} of {a.nnz} values differ, by up to {float(diff.max()):.4g}"
        elif isinstance(a, Encoded) and isinstance(b, Encoded):
            if a.cfg != b.cfg or tuple(a.shape) != tuple(b.shape) or pack(a) != pack(b):
                return f"{name}: the re-compressed payload differs"
        else:
            return f"{name}: a plain and a re-compressed tensor"
    return ""
