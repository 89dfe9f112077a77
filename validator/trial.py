"""Trial aggregates: Δ̄ of a set of held contributions and what publishing it would do, on scratch.

A window's accepted contributions are decoded again, clipped to their caps and summed on the worker
pool (:func:`validator.held.decoded`: a few in memory at a time); Δ̄ is turned into its published
form (:mod:`protocol.broadcast`), θ_{t+1} = θ_t minus exactly that form is built in a fresh copy of
θ_t, and its validation loss is measured with that copy substituted for the model's parameters
(:func:`validator.scoring.with_parameters`). The live model and θ_t are never written, so a failed or
abandoned trial (a store error while the window is decided) leaves nothing to restore.

If θ_{t+1} or its loss would not be finite, :meth:`Aggregator.aggregate` finds the contributions
responsible by bisection (:func:`culprits`) and leaves them out: nothing non-finite is ever signed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace

import torch
from torch import nn

from protocol import broadcast
from protocol.aggregate import NormLimit, SparseDict, SparseSum, apply_outer, clip_to_limits
from protocol.config import RunSpec
from protocol.data.assignment import validation_batches
from protocol.data.tokens import TokenDataset
from protocol.errors import DataUnavailable
from protocol.feedback import FeedbackState
from protocol.model import eval_loss, param_schema
from protocol.wire import AggregateTensor
from validator.held import Held, decode, decoded
from validator.scoring import with_parameters

__all__ = ["Aggregator", "Limits", "Trial", "culprits"]

Limits = Mapping[str, NormLimit] | None  # one contribution's clip caps (None: not clipped)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trial:
    """An aggregate that keeps θ finite: Δ̄'s published form, the validator's error-feedback buffer
    after it, θ_{t+1} (θ_t minus exactly the published form), its validation loss (None: not
    finite) and the contributions left out to get there."""

    tensors: dict[str, AggregateTensor]
    feedback: FeedbackState
    params: dict[str, torch.Tensor]
    val_loss: float | None
    dropped: frozenset[str] = frozenset()


class Aggregator:
    """Decodes, clips and sums contributions on ``pool``; measures θ on the run's validation
    sequences with ``model``'s architecture, never with its parameters (``dataset`` None: an
    aggregator that only forms aggregates, :meth:`published`, and measures no loss)."""

    def __init__(
        self,
        spec: RunSpec,
        model: nn.Module,
        dataset: TokenDataset | None,
        pool: Executor,
        *,
        workers: int,
        device: torch.device,
    ) -> None:
        self.spec, self.model, self.dataset, self.pool = spec, model, dataset, pool
        self.schema = param_schema(spec.model)
        self.workers, self.device = workers, device
        self._val: list[torch.Tensor] | None = None  # the validation sequences, read once

    def clipped(
        self, items: Sequence[tuple[str, Held]], caps: Mapping[str, Limits]
    ) -> Iterator[tuple[str, SparseDict]]:
        """Every item decoded again and clipped to its caps, in order, on the worker pool."""

        def work(peer: str, h: Held) -> SparseDict:
            sparse = decode(h, self.schema, self.spec.codec_at)
            limits = caps[peer]
            return sparse if limits is None else _without_held_back(clip_to_limits([sparse], limits)[0], limits)

        return decoded(items, work, self.pool, 2 * self.workers)

    def aggregate(
        self,
        params: Mapping[str, torch.Tensor],
        feedback: FeedbackState,
        held: Mapping[str, Held],
        caps: Mapping[str, Limits],
        *,
        window: int,
        weights: Mapping[str, float] | None = None,
    ) -> Trial:
        """Δ̄ of ``window``'s ``held`` contributions on θ_t = ``params``, each clipped to its ``caps``
        and weighted by its ``weights`` entry (default 1: the weighted mean of
        :class:`~protocol.aggregate.SparseSum`), with the re-compression buffer ``feedback``; the
        culprits of a non-finite θ_{t+1} or loss are found by bisection and left out (all of them
        when only together they break it)."""
        weight = weights or {}

        def attempt(peers: Sequence[str], require_loss: bool = True) -> Trial | None:
            return self._try(params, feedback, held, caps, peers, require_loss, window, weight)

        full = attempt(sorted(held))
        if full is not None:
            return full
        dropped = frozenset(culprits(sorted(held), lambda ps: attempt(ps) is not None))
        result = attempt(sorted(set(held) - dropped))
        if result is None:  # only together do they break it: publish nothing rather than guess
            dropped, result = frozenset(held), attempt([], require_loss=False)
        assert result is not None  # an empty Δ̄ leaves θ_t, which is finite
        return replace(result, dropped=dropped)

    def loss(self, params: Mapping[str, torch.Tensor]) -> float:
        """The validation loss of θ = ``params``, measured without writing the model's parameters."""
        if self.dataset is None:
            raise DataUnavailable("this aggregator has no dataset to measure a loss on")
        if self._val is None:
            d = self.spec.data
            self._val = validation_batches(self.dataset, self.spec.validator.eval_sequences, d.batch_size, d.seq_len)
        on_device = {n: p.to(self.device) for n, p in params.items()}
        return eval_loss(with_parameters(self.model, on_device), self._val, self.device)

    def _try(
        self,
        params: Mapping[str, torch.Tensor],
        feedback: FeedbackState,
        held: Mapping[str, Held],
        caps: Mapping[str, Limits],
        peers: Sequence[str],
        require_loss: bool,
        window: int,
        weight: Mapping[str, float],
    ) -> Trial | None:
        formed = self.published(params, feedback, held, caps, peers, window, weight)
        if formed is None:
            return None
        tensors, after, nxt = formed
        try:
            loss = self.loss(nxt)
        except DataUnavailable as exc:  # θ_{t+1} is finite; its loss cannot be measured now
            log.warning("the aggregate's validation loss is not measured: validation data unavailable (%s)", exc)
            return Trial(tensors, after, nxt, None)
        if not math.isfinite(loss):
            return None if require_loss else Trial(tensors, after, nxt, None)
        return Trial(tensors, after, nxt, loss)

    def published(
        self,
        params: Mapping[str, torch.Tensor],
        feedback: FeedbackState,
        held: Mapping[str, Held],
        caps: Mapping[str, Limits],
        peers: Sequence[str],
        window: int,
        weight: Mapping[str, float],
    ) -> tuple[dict[str, AggregateTensor], FeedbackState, dict[str, torch.Tensor]] | None:
        """Δ̄ of ``peers``' contributions, clipped and weighted, in its published form, the
        error-feedback buffer after it and θ_{t+1} on a scratch copy; None when any is not finite.
        Deterministic: another validator given the same contributions, caps and weights gets the
        same bytes (:mod:`validator.follow`)."""
        o = self.spec.outer
        total = SparseSum(self.schema)
        batch: list[SparseDict] = []
        ws: list[float] = []
        for peer, sparse in self.clipped([(p, held[p]) for p in peers], caps):  # decoded a few at a time
            batch.append(sparse)
            ws.append(weight.get(peer, 1.0))
            if len(batch) >= self.workers:
                total.add(batch, self.pool, ws)
                batch, ws = [], []
        total.add(batch, self.pool, ws)
        delta = total.mean(o.aggregation)
        if not all(bool(torch.isfinite(v).all()) for _, v in delta.values()):
            return None
        tensors, after = broadcast.publishable(
            delta, self.schema, o, self.spec.codec, feedback, contributors=len(peers), window=window
        )
        published = broadcast.applied(tensors)  # what is signed, not Δ̄ itself
        if not all(bool(torch.isfinite(v).all()) for _, v in published.values()):
            return None
        nxt = {n: p.detach().clone() for n, p in params.items()}  # the scratch copy of θ
        apply_outer(nxt, published, o.alpha)
        if not all(bool(torch.isfinite(p).all()) for p in nxt.values()):
            return None
        return tensors, after, nxt


def _without_held_back(sparse: SparseDict, limits: Mapping[str, NormLimit]) -> SparseDict:
    """``sparse`` without its values in rows capped at 0 (held back,
    :func:`validator.concentration.held_back`): a value that does not count is not a contributor
    to its coordinate's mean either."""
    out = dict(sparse)
    for name, (idx, vals) in sparse.items():
        lim = limits.get(name)
        if lim is None or lim.rows is None or lim.row_len <= 0 or not bool((lim.rows == 0).any()):
            continue
        keep = lim.rows[torch.div(idx, lim.row_len, rounding_mode="floor")] != 0
        out[name] = (idx[keep], vals[keep])
    return out


def culprits(peers: Sequence[str], fine: Callable[[Sequence[str]], bool]) -> list[str]:
    """The members of ``peers`` that break ``fine`` on their own, by bisection (each half is
    tested alone; a single member that fails is a culprit)."""
    if not peers or fine(peers):
        return []
    if len(peers) == 1:
        return list(peers)
    mid = len(peers) // 2
    return culprits(peers[:mid], fine) + culprits(peers[mid:], fine)
