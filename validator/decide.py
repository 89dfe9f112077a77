"""A window's decision: from what was gathered to the aggregate to sign, as one value.

    decision = Decider(spec, model, dataset, aggregator).decide(
        window, uploads, reference=st.reference, params=st.params, feedback=feedback)

:meth:`Decider.decide` reads only its inputs — the window (:class:`validator.window.Window`: its
secret, the standings before it, who is established), the screened uploads
(:class:`validator.intake.Uploads`), the norm reference, θ_t and the re-compression buffer — and
returns a :class:`WindowDecision`. It touches no store and no log, and writes neither θ_t nor the
model's parameters: scored updates and trial aggregates are applied to scratch copies and measured
with them in place of the model's parameters (:func:`validator.scoring.with_parameters`,
:mod:`validator.trial`). Committing the decision is :mod:`validator.commit`'s.

In order (docs/ARCHITECTURE.md, "Validator"): the norm check against the reference and the copy
check (:mod:`validator.window_checks`); the window's seed, from its secret and the digests of the
contributions still standing (:mod:`validator.randomness`); the clip caps (:mod:`validator.limits`);
loss scores of a budgeted sample, in the clipped form (:mod:`validator.scoring`); harm and effect by
score, probation (with ``probation_partial``, identities with a record so far count unscored at a
share of the newcomer caps), the first window's reference, capacity; the aggregate of the accepted ones, with
the culprits of a non-finite result left out; one contribution-log row per upload, with the
reputation after it.

A check on the whole window is one pure function of :mod:`validator.window_checks` (screened
verdicts in, the same with one more check row on every contribution still standing out; its name
appended to :data:`validator.log.CHECK_BITS`), called in :meth:`Decider.decide` at its place in that
order; ``tests/test_validator_decide.py`` decides windows from in-memory uploads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from protocol.config import RunSpec
from protocol.data.assignment import assigned_batches
from protocol.data.tokens import TokenDataset
from protocol.errors import ConfigError, DataUnavailable
from protocol.feedback import FeedbackState
from protocol.model import fingerprint, param_schema, sequence_losses
from protocol.outcomes import PeerOutcome
from protocol.wire import AggregateTensor
from validator import concentration, randomness, reference, window_checks
from validator.checks import Screened
from validator.consensus import agreement
from validator.copies import CopyRule
from validator.gather import Received
from validator.held import Held, clipped_entries
from validator.intake import Uploads
from validator.limits import advanced, bootstrap, newcomer_limits, partial_limits, window_limits
from validator.log import ContributionRecord
from validator.reference import NormReference
from validator.reputation import Standing, is_provisional, update
from validator.rows import failed_check
from validator.scoring import (
    LossScore,
    plan_sample,
    probation_order,
    score_update,
    scoring_batches,
    scoring_units,
    suspicion_order,
    take_sequences,
    token_losses,
)
from validator.significance import borderline
from validator.sketch import Sketcher, offsets
from validator.trial import Aggregator, Limits, Trial
from validator.window import PhaseClock, Window

__all__ = ["Decider", "WindowDecision"]


log = logging.getLogger(__name__)

TARGET_ROWS = 4  # tokens the targeted verdict measures per scored unit, beyond those of its crowded rows
EXPLAINED = 2.0  # a token next in a unit's own data more than this × θ_t's expectation is not measured


@dataclass(frozen=True)
class WindowDecision:
    """What window ``window`` decided: the final verdict on every upload (``screened``, sorted by
    peer) and its contribution-log row (``rows``: reason, scores, reputation after the window,
    weight), the loss scores, each live contribution's clip caps, the aggregate of the accepted
    ones (``trial``: Δ̄ in published form, the error-feedback buffer after it, θ_{t+1}, its
    validation loss, the contributions the bisection left out), θ_{t+1}'s fingerprint, the norm
    reference after the window, and the aggregate's randomness metadata (the revealed secret,
    the commitment to the next one, the root of the window's digests)."""

    window: int
    screened: tuple[Screened, ...]
    rows: tuple[ContributionRecord, ...]
    scores: Mapping[str, LossScore]
    caps: Mapping[str, Limits]
    trial: Trial
    fingerprint: str
    reference: NormReference
    seed: bytes
    metadata: Mapping[str, int | float | str | bool]

    @property
    def accepted(self) -> tuple[str, ...]:
        """The peers whose contributions are in the aggregate, in peer-id order."""
        return tuple(r.peer for r in self.rows if r.accepted)

    @property
    def weights(self) -> dict[str, float]:
        """Each accepted peer's weight in the aggregate's manifest."""
        return {r.peer: r.weight for r in self.rows if r.accepted}

    @property
    def rejections(self) -> dict[str, str]:
        """peer → the reason its upload was rejected."""
        return {r.peer: r.reason or "" for r in self.rows if not r.accepted}

    @property
    def tensors(self) -> dict[str, AggregateTensor]:
        """Δ̄ in its published form (:mod:`protocol.broadcast`)."""
        return self.trial.tensors


class Decider:
    """Decides windows for one run: the checks on the whole window, scoring, capacity and the
    aggregate. ``model`` (holding θ_t) is only measured, never written."""

    def __init__(
        self, spec: RunSpec, model: nn.Module, dataset: TokenDataset, aggregator: Aggregator, *, device: torch.device
    ) -> None:
        self.spec, self.model, self.dataset, self.aggregator, self.device = spec, model, dataset, aggregator, device
        self.schema = param_schema(spec.model)
        self.offsets = offsets(self.schema)  # one global index space for sampled entries

    def decide(
        self,
        w: Window,
        uploads: Uploads,
        *,
        reference: NormReference,
        params: Mapping[str, torch.Tensor],
        feedback: FeedbackState,
        clock: PhaseClock | None = None,
    ) -> WindowDecision:
        """Window ``w``'s decision on ``uploads``, on θ_t = ``params`` (not written)."""
        cfg, clock = self.spec.validator, clock or PhaseClock()
        screened = window_checks.norms(
            uploads.screened, reference, max_ratio=cfg.norm_max_ratio, min_ratio=cfg.norm_min_ratio
        )
        screened = window_checks.copies(screened, uploads.read_at, CopyRule.of(cfg), uploads.listed_at)
        clock.lap("checks")
        live = {s.peer: s.held for s in screened if s.reason is None and s.held is not None}
        root = randomness.contributions_root({p: h.digest for p, h in live.items()})
        seed = randomness.window_seed(w.secret, root)
        caps, scores, partial = self.measure(w, live, uploads, reference, seed)
        gain = min_gain(self.spec, w, scores)
        screened = window_checks.scores(
            screened, scores, cfg.eval_harm_tolerance, gain, cfg.eval_confidence_z, _target_tolerance(self.spec)
        )
        screened = window_checks.probation(screened, w.established | set(partial), scores)
        nxt_ref: NormReference | None = None
        if reference.empty:  # no history yet: start one
            first, first_caps = bootstrap(self.spec, screened, scores, live, self.schema)
            if self.spec.outer.clip == "median":
                caps = {p: first_caps for p in live}
            nxt_ref = first if not first.empty else None
        screened = window_checks.capacity(screened, rank(w, scores, seed), cfg.max_contributors)
        screened = window_checks.shared(screened)  # same-poll pairs share a unit only while both stand
        clock.lap("scoring")
        accepted = sorted(s.peer for s in screened if s.reason is None)  # order-free Δ̄
        weights = {s.peer: s.weight for s in screened if s.reason is None}  # < 1: near an earlier upload
        trial = self.aggregator.aggregate(
            params, feedback, {p: live[p] for p in accepted}, caps, window=w.t, weights=weights
        )
        screened = window_checks.stable(screened, trial.dropped)
        clock.lap("aggregate")
        return WindowDecision(
            window=w.t,
            screened=tuple(screened),
            rows=tuple(self.rows(w, screened, uploads.received, scores)),
            scores=scores,
            caps=caps,
            trial=trial,
            fingerprint=fingerprint(trial.params),
            reference=(
                advanced(self.spec, reference, screened, w.established, w.senior) if nxt_ref is None else nxt_ref
            ),
            seed=seed,
            metadata={
                randomness.SECRET: w.secret.hex(),
                randomness.COMMITMENT: w.commitment,
                randomness.ROOT: root,
            },
        )

    def measure(
        self, w: Window, live: Mapping[str, Held], uploads: Uploads, reference: NormReference, seed: bytes
    ) -> tuple[dict[str, Limits], dict[str, LossScore], dict[str, float]]:
        """The live contributions' clip caps, the loss scores of a budgeted sample, and the unscored
        identities on probation that count anyway with their share (:meth:`partial`). An update
        concentrated on few rows (:mod:`validator.concentration`) is scored first, and when it is
        not scored its crowded rows are held back."""
        cfg = self.spec.validator
        limits = window_limits(self.spec, reference, [h for p, h in live.items() if p in w.established], self.schema)
        probation_limits = newcomer_limits(self.spec, limits, reference)
        caps: dict[str, Limits] = {p: limits if p in w.established else probation_limits for p in live}
        typical = concentration.typical_counts([h.norms for p, h in live.items() if p in w.established])
        excess = {p: concentration.row_excess(h.norms, typical) for p, h in live.items()}
        concentrated = {p for p, e in excess.items() if cfg.row_excess_ratio and e.ratio > cfg.row_excess_ratio}
        scores = self.score(w, live, caps, uploads, seed, typical=typical, excess=excess, concentrated=concentrated)
        caps.update({p: self.unscored_caps(caps[p], live[p], typical) for p in sorted(concentrated - set(scores))})
        partial: dict[str, float] = {}
        if probation_limits is not None:  # on probation, a record so far, unscored: counts for less
            partial = self.partial(w, live, scores)
            for p, share in partial.items():
                caps[p] = partial_limits(probation_limits, share)
        return caps, scores, partial

    def partial(self, w: Window, live: Mapping[str, Held], scores: Mapping[str, LossScore]) -> dict[str, float]:
        """The unscored identities on probation that count anyway, each with its share of the
        newcomer caps (``probation_partial``): those with a scored, accepted update and no scored
        failure since (:func:`is_provisional`)."""
        cfg = self.spec.validator
        if cfg.probation_partial <= 0.0:
            return {}
        out = {}
        for p in live:
            st = w.standing.get(p)
            if p not in w.established and p not in scores and st is not None and is_provisional(st, cfg):
                out[p] = cfg.probation_partial
        return out

    def unscored_caps(self, caps: Limits, held: Held, typical: concentration.Typical) -> Limits:
        """The caps of a concentrated contribution that was not scored: its concentrated rows at their
        typical change, without ``clip_headroom`` (:mod:`validator.concentration`)."""
        cfg = self.spec.validator
        rows = concentration.concentrated_rows(held.norms, typical, cfg.row_excess_ratio)
        return concentration.held_back(caps, rows, {n: reference.row_length(self.schema[n]) for n in rows})

    def score(
        self,
        w: Window,
        live: Mapping[str, Held],
        caps: Mapping[str, Limits],
        uploads: Uploads,
        seed: bytes,
        *,
        typical: concentration.Typical | None = None,
        excess: Mapping[str, concentration.Excess] | None = None,
        concentrated: Collection[str] = (),
    ) -> dict[str, LossScore]:
        """Score a budgeted sample of units, ordered by agreement (on the clipped sampled entries);
        only the sampled contributions are decoded again, in the clipped form; ``limits`` (the window's
        caps of established peers) say which token rows each moves most. Established units with a ``concentrated``
        contribution (:mod:`validator.concentration`) are scored too, up to
        ``eval_peers_per_window`` more, largest ``excess`` first. Units whose verdict is borderline
        (:func:`validator.significance.borderline`) are measured again on more sequences."""
        cfg = self.spec.validator
        units = scoring_units(live, uploads.roles, pipelines=self.spec.pipeline.enabled)
        known = [u for u, ps in units.items() if all(p in w.established for p in ps)]
        sk = uploads.sketch or Sketcher(self.offsets)
        entries = {p: clipped_entries(h, caps[p], sk, self.schema) for p, h in live.items()}
        agree = agreement(entries, w.established, np.array(sorted(self.offsets.values()), dtype=np.int64))
        unit_agree = {u: min(agree.get(p, 0.5) for p in ps) for u, ps in units.items()}
        sample = plan_sample(
            established=suspicion_order(known, unit_agree, seed),
            probation=probation_order([u for u in units if u not in known], unit_agree, seed, progress(w, units)),
            budget=cfg.eval_peers_per_window,
            probation_slots=cfg.eval_probation_peers,
            seed=seed,
        )
        sample = sorted({*sample, *forced_units(known, units, excess or {}, concentrated, cfg.eval_peers_per_window)})
        scores = self._measure(w.t, sample, units, live, caps, seed, cfg.eval_sequences, typical)
        if cfg.eval_borderline_sequences > cfg.eval_sequences:
            gain = min_gain(self.spec, w, _per_peer(scores, units))
            z, tolerance, target = cfg.eval_confidence_z, cfg.eval_harm_tolerance, _target_tolerance(self.spec)
            again = [
                k
                for k, sc in scores.items()
                if borderline(sc, tolerance=tolerance, min_gain=gain, z=z, target_tolerance=target)
            ]
            try:
                scores.update(
                    self._measure(w.t, again, units, live, caps, seed, cfg.eval_borderline_sequences, typical)
                )
            except ConfigError as exc:  # a validation split too small for them: the first measurement stands
                log.warning("window %d: borderline scores are not measured again (%s)", w.t, exc)
        return _per_peer(scores, units)

    def _measure(
        self,
        window: int,
        keys: Sequence[str],
        units: Mapping[str, Sequence[str]],
        live: Mapping[str, Held],
        caps: Mapping[str, Limits],
        seed: bytes,
        n: int,
        typical: concentration.Typical | None = None,
    ) -> dict[str, LossScore]:
        """Loss scores of the units ``keys`` on ``n`` own and ``n`` random sequences of the window
        (with the binary log-loss of the tokens each moves most against ``limits``' typical rows)."""
        cfg, data = self.spec.validator, self.spec.data
        if not keys:
            return {}
        try:
            rand = scoring_batches(self.dataset, seed, n, data.batch_size, data.seq_len)
        except DataUnavailable as exc:  # a damaged dataset never stalls the run, nor is held against a peer
            log.warning("window %d is not scored: its random sequences are unavailable (%s)", window, exc)
            return {}
        tokens_before: torch.Tensor | None = None
        expected: torch.Tensor | None = None
        if _target_tolerance(self.spec) is not None:
            rand_before, tokens_before, probs = token_losses(self.model, rand, self.device)
            expected = probs.mean(dim=0)  # θ_t's mean probability of each token, on held-out data
        else:
            rand_before = sequence_losses(self.model, rand, self.device)
        scale = cfg.eval_scale * self.spec.outer.alpha
        out: dict[str, LossScore] = {}
        for key in keys:  # a peer, or the stages of one pipeline replica (disjoint slices)
            batches = self._own_batches(window, key)
            if batches is None:
                continue  # unscored, as if not sampled
            own = take_sequences(batches, n)  # the first n (all when it has fewer)
            items = [(p, live[p]) for p in units[key]]
            update = {name: v for _, sp in self.aggregator.clipped(items, caps) for name, v in sp.items()}
            tokens: tuple[int, ...] = ()
            if expected is not None:
                held = [live[p] for p in units[key]]
                moved = unexplained(_moved_tokens(held, typical or {}, self.spec), batches, expected)
                tokens = measured_tokens(moved, _crowded_tokens(held, typical or {}, self.spec))
            out[key] = score_update(
                self.model,
                update,
                own=own,
                random=rand,
                random_before=rand_before,
                scale=scale,
                device=self.device,
                tokens=tokens,
                tokens_before=tokens_before,
            )
        return out

    def _own_batches(self, window: int, key: str) -> list[torch.Tensor] | None:
        """``key``'s own assigned batches in ``window``; None (and a warning) when a block of it
        cannot be had intact: the unit goes unscored, never blamed."""
        data = self.spec.data
        try:
            batches = assigned_batches(
                self.dataset,
                self.spec.seed,
                key,
                window,
                self.spec.inner.steps,
                data.batch_size,
                data.seq_len,
                pages=data.pages,
            )
        except DataUnavailable as exc:
            log.warning("window %d: %s is not scored: its assigned data is unavailable (%s)", window, key, exc)
            return None
        return list(batches)

    def rows(
        self, w: Window, screened: Sequence[Screened], received: Mapping[str, Received], scores: Mapping[str, LossScore]
    ) -> list[ContributionRecord]:
        """One contribution-log row per upload, with the peer's reputation after this window."""
        rows = []
        for s in sorted(screened, key=lambda s: s.peer):
            r, sc, h = received[s.peer], scores.get(s.peer), s.held
            accepted = s.reason is None
            st = update(
                w.standing.get(s.peer, Standing()),
                PeerOutcome(
                    s.peer, accepted, s.reason, sc.score if sc else None, window=w.t, check=failed_check(s.checks)
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
                    weight=s.weight if accepted else 0.0,
                    checks=s.checks,
                )
            )
        return rows


def progress(w: Window, units: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Per unit on probation, its passes so far without a scored failure since (the least of its
    peers'): the order in which probation slots go (:func:`validator.scoring.probation_order`)."""
    out = {}
    for key, peers in units.items():
        sts = [w.standing.get(p) for p in peers]
        out[key] = min((st.passes if st is not None and st.failures == 0 else 0) for st in sts)
    return out


def forced_units(
    known: Sequence[str],
    units: Mapping[str, Sequence[str]],
    excess: Mapping[str, concentration.Excess],
    concentrated: Collection[str],
    extra: int,
) -> list[str]:
    """The established units with a concentrated contribution, largest row excess first, at most
    ``extra`` of them: scored beyond the sample, so that an update concentrated on few rows is
    measured whenever the budget allows."""
    hit = [u for u in known if any(p in concentrated for p in units[u])]
    worst = {u: max(excess[p].ratio for p in units[u] if p in excess) for u in hit}
    return sorted(hit, key=lambda u: (-worst[u], u))[: max(0, extra)]


def _moved_tokens(held: Sequence[Held], typical: concentration.Typical, spec: RunSpec) -> tuple[int, ...]:
    """The tokens whose rows the unit's contributions are concentrated on, most first
    (:func:`concentration.moved_tokens`)."""
    out: list[int] = []
    vocab = spec.model.vocab_size
    for h in held:
        for t in concentration.moved_tokens(h.norms, typical, vocab, vocab):
            if t not in out:
                out.append(t)
    return tuple(out)


def _crowded_tokens(held: Sequence[Held], typical: concentration.Typical, spec: RunSpec) -> frozenset[int]:
    """The tokens of the rows a unit's contributions are concentrated on past ``row_excess_ratio``:
    the rows held back when it is not scored (:func:`concentration.crowded_tokens`)."""
    vocab, ratio = spec.model.vocab_size, spec.validator.row_excess_ratio
    return frozenset(t for h in held for t in concentration.crowded_tokens(h.norms, typical, vocab, ratio))


def measured_tokens(moved: Sequence[int], crowded: Collection[int]) -> tuple[int, ...]:
    """The tokens the ``targeted`` verdict measures, of ``moved`` (most concentrated first): the
    first ``TARGET_ROWS`` and every ``crowded`` one. A scored unit is measured on every row an
    unscored one would have held back, however many rows its honest part crowds more: counts
    saturate at a row's length, so an edited row's rank among them says little."""
    return tuple(t for i, t in enumerate(moved) if i < TARGET_ROWS or t in crowded)


def unexplained(tokens: Sequence[int], batches: Sequence[torch.Tensor], expected: torch.Tensor) -> tuple[int, ...]:
    """Of ``tokens``, those the unit's own assigned data gives no reason to promote: next in it at
    most ``EXPLAINED`` × as often as θ_t expects (``expected``: its mean probability on held-out
    data). A peer whose data holds a token more often than the model predicts raises that token's
    probability by training honestly; one that raises it without such data does not."""
    counts = torch.zeros(len(expected), dtype=torch.float64)
    total = 0
    for b in batches:
        nxt = b[:, 1:].reshape(-1).to(torch.int64)
        counts.index_add_(0, nxt.clamp(0, len(expected) - 1), torch.ones(len(nxt), dtype=torch.float64))
        total += len(nxt)
    freq = counts / max(total, 1)
    return tuple(t for t in tokens if float(freq[t]) <= EXPLAINED * float(expected[t]))


def _target_tolerance(spec: RunSpec) -> float | None:
    """The ``targeted`` bar's tolerance (None: the verdict is off)."""
    tolerance = spec.validator.eval_target_tolerance
    return tolerance if tolerance > 0 else None


def _per_peer(scores: Mapping[str, LossScore], units: Mapping[str, Sequence[str]]) -> dict[str, LossScore]:
    """Unit scores as every peer's of the unit."""
    return {peer: sc for key, sc in scores.items() for peer in units[key]}


def min_gain(spec: RunSpec, w: Window, scores: Mapping[str, LossScore]) -> float | None:
    """What a scored update must at least lower its own loss by: ``eval_min_gain_ratio`` × the
    lower median of the established peers' helpful updates in this window (None: none scored)."""
    gains = [sc.own_gain for p, sc in scores.items() if p in w.established and sc.own_gain > 0]
    if not gains:
        return None
    return spec.validator.eval_min_gain_ratio * reference.lower_median(gains)


def rank(w: Window, scores: Mapping[str, LossScore], seed: bytes) -> Callable[[str], Any]:
    """Who is kept when too many pass: established peers first, then reputation so far plus
    this window's score if measured, then a draw from the window's seed (ids cannot be ground)."""

    def key(peer: str) -> tuple[int, float, bytes]:
        st = w.standing.get(peer)
        value = (st.reputation if st is not None else 0.0) + (scores[peer].score if peer in scores else 0.0)
        value = value if math.isfinite(value) else -math.inf
        return (0 if peer in w.established else 1, -value, randomness.keyed_key(seed, "capacity", peer))

    return key
