"""What the validator publishes as Δ̄, and what every participant applies from it.

The aggregation rule (:mod:`protocol.aggregate`) gives Δ̄ in float32. The validator signs its
*published form*, which every peer decodes to the same bits, and applies that form too — never the
float32 Δ̄ it came from — so peers and validator hold bit-identical θ:

* plain (``outer.recompress = false``): Δ̄'s values rounded to bfloat16 (:func:`plain`); the
  aggregate carries the union of the contributors' positions;
* re-compressed (``outer.recompress = true`` and Δ̄ of at least ``outer.recompress_from``
  contributions, :func:`recompresses`): chunk-wise Top-k (``outer.recompress_k`` per 4096, times
  the window's k over ``codec.k`` in a Top-k warm-up, :func:`recompress_codec`)
  and 2-bit codes of the validator's own error-feedback buffer ``e ← β_r·e + Δ̄``
  (:func:`recompress`: the peers' :func:`protocol.feedback.compress_step` with
  ``outer.recompress_beta``), so every peer downloads a contribution-sized object; what is not sent
  in one window stays in ``e`` for the next ones, as on the peers' side.

::

    tensors, feedback = publishable(delta, schema, spec.outer, spec.codec, feedback, contributors=n, window=t)
    apply_outer(params, applied(tensors), spec.outer.alpha)     # the validator, and every peer
    encode_aggregate(Aggregate(..., tensors, ...), identity)    # exactly these tensors

The validator's buffer is state it must keep across restarts like θ (``validator/state.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from protocol.aggregate import SparseDict
from protocol.codec import Encoded, to_sparse
from protocol.config import CodecConfig, OuterConfig
from protocol.feedback import FeedbackState, compress_step
from protocol.wire.aggregate import AggregateTensor, SparseDelta
from protocol.wire.delta import round_values

__all__ = ["applied", "keeps_feedback", "plain", "publishable", "recompress", "recompress_codec", "recompresses"]

Shapes = Mapping[str, tuple[int, ...]]


def keeps_feedback(outer: OuterConfig) -> bool:
    """Whether the validator carries an error-feedback buffer from one window to the next (with
    ``recompress_beta = 0`` what Top-k leaves out is dropped, and there is nothing to keep)."""
    return outer.recompress and outer.recompress_beta > 0.0


def recompresses(outer: OuterConfig, contributors: int) -> bool:
    """Whether Δ̄ of ``contributors`` contributions is published re-compressed. Below
    ``outer.recompress_from`` the union of the Top-k sets is small and carries what a Top-k of it
    would drop; above, a Top-k of the mean is both the smaller object and the better step
    (BENCHMARKS.md)."""
    return outer.recompress and contributors >= outer.recompress_from


def recompress_codec(outer: OuterConfig, codec: CodecConfig, window: int | None = None) -> CodecConfig:
    """The codec of a re-compressed Δ̄ of ``window``: the run's chunking and index coding and
    ``outer.recompress_k`` values per 4096, scaled in a Top-k warm-up (``outer.warmup_k``) by the
    window's k over ``codec.k``, so that what the peers send in those windows is not cut back to
    the steady-state k (``window`` None: the widest of any window, what read caps allow)."""
    k = outer.max_k(codec.k) if window is None else outer.k_at(window, codec.k)
    return dataclasses.replace(codec, k=min(4096, outer.recompress_k * k // codec.k))


def plain(delta: SparseDict, shapes: Shapes) -> dict[str, SparseDelta]:
    """Δ̄ with its values rounded to bfloat16: the tensors of a plain aggregate."""
    return {
        name: SparseDelta(tuple(shapes[name]), idx.to("cpu", torch.int64), round_values(vals))
        for name, (idx, vals) in sorted(delta.items())
    }


def recompress(
    delta: SparseDict, shapes: Shapes, state: FeedbackState, beta: float, cfg: CodecConfig
) -> tuple[dict[str, Encoded], FeedbackState]:
    """``e ← β·e + Δ̄; Δ̂ = Q(TopK(e)); e ← e − decode(Δ̂)`` over every tensor that Δ̄ or ``e`` holds
    (a tensor nobody sent this window still sends what its buffer kept). Pure, like
    :func:`~protocol.feedback.compress_step`: returns the tensors and the next state."""
    dense: dict[str, torch.Tensor] = {}
    for name in sorted(set(delta) | set(state.buffers)):
        flat = torch.zeros(shapes[name], dtype=torch.float32).view(-1)
        if name in delta:
            idx, vals = delta[name]
            flat[idx.to("cpu", torch.int64)] = vals.to("cpu", torch.float32)
        dense[name] = flat.view(shapes[name])
    return compress_step(state, dense, beta, cfg)


def publishable(
    delta: SparseDict,
    shapes: Shapes,
    outer: OuterConfig,
    codec: CodecConfig,
    state: FeedbackState,
    *,
    contributors: int,
    window: int,
) -> tuple[dict[str, AggregateTensor], FeedbackState]:
    """The tensors the aggregate of Δ̄ of ``window`` (of ``contributors`` contributions) carries
    under the RunSpec's ``outer`` and ``codec``, and the validator's next error-feedback state
    (``state`` itself when not re-compressing)."""
    if not recompresses(outer, contributors):
        return dict(plain(delta, shapes)), state
    cfg = recompress_codec(outer, codec, window)
    encoded, after = recompress(delta, shapes, state, outer.recompress_beta, cfg)
    return dict(encoded), after if keeps_feedback(outer) else FeedbackState()


def applied(tensors: Mapping[str, AggregateTensor]) -> SparseDict:
    """The Δ̄ that ``apply_outer`` takes from an aggregate's tensors: flat int64 indices and float32
    values on the CPU, decoded the same way on every participant."""
    out: SparseDict = {}
    for name, t in tensors.items():
        idx, vals = to_sparse(t) if isinstance(t, Encoded) else (t.indices, t.values)
        out[name] = (idx.to("cpu", torch.int64), vals.to("cpu", torch.float32))
    return out
