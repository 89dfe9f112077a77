"""Loss scoring of contributions on an explicit budget.

For each sampled peer the validator measures the loss of θ_t on ``eval_sequences`` sequences of the
batches that peer was assigned in this window ("own") and on the same number of random training
sequences ("random", shared by every peer of the window), then applies that peer's update alone,
``θ' = θ_t − eval_scale · α · Δ̂_p``, and measures both again::

    score = (own_before − own_after) − (random_before − random_after)

A peer that trained on the data it was assigned improves its own sequences more than random ones
(score > 0). An update that does not even lower the loss on the peer's own data
(``own_after ≥ own_before``) is *harmful* and is rejected: noise, sign-flipped or scaled updates
fail here. The budget (``eval_peers_per_window`` peers × ``eval_sequences`` sequences) bounds the
cost of a window whatever the number of peers; the sample is drawn deterministically from
(run seed, window) so a restarted validator scores the same peers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from protocol.aggregate import SparseDict, apply_outer
from protocol.data import pipeline_data_key
from protocol.model import eval_loss, parameters_of

__all__ = ["LossScore", "data_key", "pick_sample", "score_update", "take_sequences"]


@dataclass(frozen=True)
class LossScore:
    loss_own_before: float
    loss_own_after: float
    loss_random_before: float
    loss_random_after: float

    @property
    def score(self) -> float:
        return (self.loss_own_before - self.loss_own_after) - (self.loss_random_before - self.loss_random_after)

    @property
    def harmful(self) -> bool:
        return not self.loss_own_after < self.loss_own_before


def pick_sample(peers: Sequence[str], budget: int, seed: int, window: int) -> list[str]:
    """Up to ``budget`` peers, chosen by a keyed hash of (seed, window, peer): deterministic,
    unpredictable to peers before the window, and fair over time."""
    if budget <= 0:
        return []

    def key(p: str) -> bytes:
        return hashlib.sha256(f"score|{seed}|{window}|{p}".encode()).digest()

    return sorted(sorted(peers, key=key)[:budget])


def data_key(peer: str, metadata: Mapping[str, object]) -> str:
    """Under which name the peer's batches were assigned: its peer id, or for a stage of a pipeline
    replica the replica's shared key :func:`protocol.data.pipeline_data_key` (every stage trains
    on the same batches)."""
    group = metadata.get("pipeline_group")
    return pipeline_data_key(group) if isinstance(group, str) and group else peer


def scoring_units(metadata: Mapping[str, Mapping[str, object]]) -> dict[str, list[str]]:
    """Who is scored together: data key -> peers (sorted). A full peer is a unit of its own; the
    stages of one pipeline replica trained one model jointly on one data key, and a single stage's
    slice applied alone is not an update anybody trained, so its stages are scored as one update."""
    units: dict[str, list[str]] = {}
    for peer in sorted(metadata):
        units.setdefault(data_key(peer, metadata[peer]), []).append(peer)
    return units


def take_sequences(batches: Sequence[Tensor], n: int) -> list[Tensor]:
    """The first ``n`` sequences of ``batches`` (a list of [B, T+1] tensors), as one batch list."""
    if n <= 0:
        raise ValueError("need at least one evaluation sequence")
    out, left = [], n
    for b in batches:
        if left <= 0:
            break
        out.append(b[:left])
        left -= len(out[-1])
    return out


@torch.no_grad()
def score_update(
    model: nn.Module,
    update: SparseDict,
    *,
    own: Sequence[Tensor],
    random: Sequence[Tensor],
    random_before: float,
    scale: float,
    device: torch.device | str = "cpu",
) -> LossScore:
    """Loss before/after applying ``scale · update`` alone; ``model`` is restored bit-exactly."""
    params = parameters_of(model)
    touched = {name: params[name].detach().clone() for name in update}
    own_before = eval_loss(model, own, device)
    try:
        apply_outer(params, update, scale)
        own_after = eval_loss(model, own, device)
        random_after = eval_loss(model, random, device)
    finally:
        for name, saved in touched.items():
            params[name].copy_(saved)
    return LossScore(own_before, own_after, random_before, random_after)
