"""Loss scoring of contributions on an explicit budget, with randomness peers cannot predict.

For each sampled peer the validator measures the loss of θ_t on ``eval_sequences`` sequences of the
batches that peer was assigned in this window ("own") and on the same number of random *held-out*
sequences ("random", shared by every peer of the window), then applies that peer's update alone
— in the clipped form the aggregate would use — ``θ' = θ_t − eval_scale · α · Δ̂_p``, and
measures both again. With ``own_gain = own_before − own_after`` and ``random_gain = random_before
− random_after``::

    score = own_gain − |random_gain|

A peer that trained on the data it was assigned improves its own sequences more than random ones
(score > 0). Any change on random data counts against the score, so an update that lowers its
own loss by raising the loss elsewhere is never rewarded. It is *harmful*, and rejected, when it
does not lower the loss on its own data (``harmful``: noise, sign-flipped, scaled) or raises the
loss on held-out data by more than ``eval_harm_tolerance`` × ``random_before``
(``harmful_general``); and *ineffective* when it lowers the loss on its own data by less than
``eval_min_gain_ratio`` × the median of what established peers' scored updates achieve in the
same window (``ineffective``: noise at a plausible norm helps a little, by chance). It is
*targeted* when, on the random sequences, the binary log-loss of "the next token is v" rises by
more than ``eval_target_tolerance`` × its level for one of the tokens v whose rows the update
crowds most (:func:`validator.concentration.moved_tokens`; every crowded one past
``row_excess_ratio``, :func:`validator.decide.measured_tokens`) and that its own assigned data gives no
reason to promote (:func:`validator.decide.unexplained`; :func:`token_losses` measures every
token's in the same forward pass as the loss): a row edit promoting one token everywhere lowers
the mean loss a little and multiplies that token's probability. Every loss
is measured per sequence, so each gain comes with the standard error of its paired differences,
and each verdict rejects only past its bar by ``eval_confidence_z`` of them
(:mod:`validator.significance`).

**What peers cannot know.** The sample and the random sequences are drawn from the window's seed
(:mod:`validator.randomness`), fixed only once uploads are closed: a peer cannot tell whether it
will be scored, nor tune an update to the sequences it is scored on. The random sequences come
from the held-out split, which nobody trains on (:func:`scoring_batches`).

**Budget.** At most ``eval_peers_per_window`` updates are scored (:func:`plan_sample`), whatever
the number of peers: up to ``eval_probation_peers`` identities on probation (their updates count
only when scored; those with most passes so far first, then those agreeing most with the
window's established uploads, :func:`probation_order`) and established peers in the remaining slots (half to those agreeing
least with the others, :func:`suspicion_order`, half drawn at random); slots one group cannot
use go to the other, so a flood of new identities never takes the slots of known peers. Established
units with an update concentrated on a row (:mod:`validator.concentration`) are scored beyond
the sample, up to ``eval_peers_per_window`` more, the most concentrated first.

**Units.** A pipeline replica's stages trained one model jointly on one data key, so they are
scored as one update (:func:`scoring_units`) — but only in a run with ``pipeline.enabled`` and
only by the roles the peers *signed in their announcements*; a contribution's own metadata
cannot put it into somebody else's unit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from protocol.aggregate import SparseDict, apply_outer
from protocol.data.assignment import TokenDataset, pipeline_data_key, random_batches
from protocol.model import autocast_for, parameters_of, sequence_losses
from protocol.wire import PipelineRole
from validator.significance import paired

# A token's binary loss is judged from at least this share of the uniform probability (1 / vocab):
# tokens the model has all but ruled out move by large factors at no cost to anyone.
TOKEN_FLOOR = 0.2

__all__ = [
    "TOKEN_FLOOR",
    "LossScore",
    "data_key",
    "plan_sample",
    "probation_order",
    "suspicion_order",
    "scoring_batches",
    "scoring_units",
    "score_update",
    "take_sequences",
    "token_losses",
    "with_parameters",
]


@dataclass(frozen=True)
class LossScore:
    """Mean losses before/after one update on its own and on the random sequences, and the
    standard errors of the two gains (paired per-sequence differences, :func:`validator.significance.paired`;
    0: not measured, the point estimates alone)."""

    loss_own_before: float
    loss_own_after: float
    loss_random_before: float
    loss_random_after: float
    own_se: float = 0.0
    random_se: float = 0.0
    # The tokens whose rows the update is most concentrated on (validator.concentration) and, for
    # each, on the random sequences, the binary log-loss of "the next token is it" before and after
    # the update, with the standard error of the paired difference (empty: not measured).
    tokens: tuple[int, ...] = ()
    token_before: tuple[float, ...] = ()
    token_after: tuple[float, ...] = ()
    token_se: tuple[float, ...] = ()
    token_floor: float = 0.0  # the least level a token's binary loss is judged from (TOKEN_FLOOR / vocab)

    @property
    def own_gain(self) -> float:
        return self.loss_own_before - self.loss_own_after

    @property
    def random_gain(self) -> float:
        return self.loss_random_before - self.loss_random_after

    @property
    def score(self) -> float:
        """Improvement on the peer's own data beyond any change on random data (NaN: harmful)."""
        return self.own_gain - abs(self.random_gain)

    @property
    def harmful(self) -> bool:
        """Does not lower the loss on the peer's own data (NaN included); the point estimate, without
        the error bar the score check applies (:func:`validator.significance.verdict`)."""
        return not self.loss_own_after < self.loss_own_before

    def harms_general(self, tolerance: float) -> bool:
        """Raises the loss on held-out random data by more than ``tolerance`` × its level (NaN included)."""
        return not self.loss_random_after <= self.loss_random_before * (1.0 + tolerance)


def _draw(seed: bytes, label: str, item: str) -> bytes:
    return hashlib.sha256(seed + f"|{label}|{item}".encode()).digest()


def plan_sample(
    *,
    established: Sequence[str],
    probation: Sequence[str],
    budget: int,
    probation_slots: int,
    seed: bytes,
) -> list[str]:
    """The units to score (sorted): up to ``probation_slots`` of ``probation`` (taken in the order
    given: the caller's preference) and the rest from ``established``, slots one group cannot use
    going to the other. Half the established slots (rounded up) go to the first of
    ``established`` in the order given (the validator puts those agreeing least with the others
    first), the rest to a draw by a keyed hash of the window's ``seed``: every peer may be scored
    in any window, unpredictably before the window closed, reproducibly after the reveal."""
    if budget <= 0:
        return []
    new = [u for u in probation if u not in set(established)]
    n_new = min(len(new), max(min(probation_slots, budget), budget - len(established)))
    n_est = min(len(established), budget - n_new)
    first = list(established[: (n_est + 1) // 2])
    rest = sorted((u for u in established if u not in set(first)), key=lambda u: _draw(seed, "score", u))
    return sorted(new[:n_new] + first + rest[: n_est - len(first)])


def probation_order(
    units: Collection[str], agreement: Mapping[str, float], seed: bytes, progress: Mapping[str, int] | None = None
) -> list[str]:
    """Units on probation in the order they are scored: most ``progress`` first (passes so far
    without a scored failure since: who started probation earlier finishes it first, so a flood of
    identities arriving later cannot keep earlier ones from being established), then highest
    agreement with the window's established uploads (:mod:`validator.consensus`), then by the
    window's seed."""
    done = progress or {}
    return sorted(units, key=lambda u: (-done.get(u, 0), -agreement.get(u, 0.5), _draw(seed, "probation", u)))


def suspicion_order(units: Collection[str], agreement: Mapping[str, float], seed: bytes) -> list[str]:
    """Established units in the order half their scoring slots go: least agreement with the
    other established uploads first, then by the window's seed."""
    return sorted(units, key=lambda u: (agreement.get(u, 0.5), _draw(seed, "suspicion", u)))


def data_key(peer: str, role: PipelineRole | None) -> str:
    """Under which name the peer's batches were assigned: its peer id, or for a stage of a pipeline
    replica the replica's shared key :func:`protocol.data.assignment.pipeline_data_key` (every stage trains
    on the same batches)."""
    return pipeline_data_key(role.group) if role is not None and role.group else peer


def scoring_units(
    peers: Collection[str], roles: Mapping[str, PipelineRole | None], *, pipelines: bool
) -> dict[str, list[str]]:
    """Who is scored together: data key -> peers (sorted). A full peer is a unit of its own; with
    ``pipelines`` the stages of one replica (by their announced roles) are one unit, each stage
    at most once: a second peer claiming a taken stage is scored alone."""
    units: dict[str, list[str]] = {}
    taken: dict[str, set[int]] = {}
    for peer in sorted(peers):
        role = roles.get(peer) if pipelines else None
        if role is not None and role.stage in taken.setdefault(role.group, set()):
            role = None
        if role is not None:
            taken[role.group].add(role.stage)
        units.setdefault(data_key(peer, role), []).append(peer)
    return units


def scoring_batches(
    dataset: TokenDataset, seed: bytes, n_sequences: int, batch_size: int, seq_len: int
) -> list[Tensor]:
    """``n_sequences`` random held-out sequences [≤ batch_size, seq_len + 1] drawn with ``seed``
    (the window's): the "random" data of the window's scores, from a few pages of the validation
    split (so a few shards are read)."""
    draw = int.from_bytes(hashlib.sha256(b"scoring|" + seed).digest()[:8], "little")
    n_batches = -(-n_sequences // batch_size)
    return take_sequences(random_batches(dataset, draw, n_batches, batch_size, seq_len, split="val"), n_sequences)


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
    random_before: Tensor,
    scale: float,
    device: torch.device | str = "cpu",
    tokens: Sequence[int] = (),
    tokens_before: Tensor | None = None,
) -> LossScore:
    """Loss before/after applying ``scale · update`` alone, per sequence (``random_before``: θ_t's
    per-sequence losses on ``random``, :func:`protocol.model.sequence_losses`, measured once per
    window), summarised as means and the standard errors of the paired gains. With ``tokens`` and
    ``tokens_before`` (θ_t's per-sequence, per-token binary log-losses on ``random``,
    :func:`token_losses`), also the binary log-loss of those tokens before and after, from the
    same forward pass. The update is applied to copies of the tensors it touches
    (:func:`with_parameters`): ``model``'s parameters are never written."""
    params = parameters_of(model)
    moved = {name: params[name].detach().clone() for name in update}
    apply_outer(moved, update, scale)
    own_before = sequence_losses(model, own, device)
    after = with_parameters(model, moved)
    own_after = sequence_losses(after, own, device)
    if tokens_before is not None:  # the same measurement as random_before's
        random_after, per_token, _ = token_losses(after, random, device)
    else:
        random_after = sequence_losses(after, random, device)
    measure_tokens = bool(tokens) and tokens_before is not None
    _, own_se = paired(own_before, own_after)
    _, random_se = paired(random_before, random_after)
    ids: tuple[int, ...] = ()
    t_before: tuple[float, ...] = ()
    t_after: tuple[float, ...] = ()
    t_se: tuple[float, ...] = ()
    if measure_tokens:
        assert tokens_before is not None
        ids = tuple(int(t) for t in tokens)
        t_before = tuple(float(tokens_before[:, t].mean()) for t in ids)
        t_after = tuple(float(per_token[:, t].mean()) for t in ids)
        t_se = tuple(paired(tokens_before[:, t], per_token[:, t])[1] for t in ids)
    return LossScore(
        float(own_before.mean()),
        float(own_after.mean()),
        float(random_before.mean()),
        float(random_after.mean()),
        own_se=own_se,
        random_se=random_se,
        tokens=ids,
        token_before=t_before,
        token_after=t_after,
        token_se=t_se,
        token_floor=TOKEN_FLOOR / tokens_before.shape[1] if tokens_before is not None else 0.0,
    )


@torch.no_grad()
def token_losses(
    model: nn.Module, batches: Sequence[Tensor], device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence of ``batches``: its mean next-token loss (as :func:`protocol.model.sequence_losses`)
    and, for every token v, the mean binary log-loss of "the next token is v",
    ``−[y log p_v + (1 − y) log(1 − p_v)]``, and the mean probability p_v over its positions
    ([sequences, vocab] each, float64 on the CPU). A token the model promotes everywhere raises its binary loss wherever it is not next,
    however little that moves the mean loss."""
    was_training = model.training
    model.eval()
    losses, per_token, probs = [], [], []
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            with autocast_for(torch.device(device)):
                logits = model(batch[:, :-1])
            target = batch[:, 1:]
            for row, y in zip(logits.float(), target, strict=True):  # one sequence at a time: [T, V]
                logp = F.log_softmax(row, dim=-1)
                hit = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # log p of the next token
                p = logp.exp()
                miss = torch.log1p(-p.clamp(max=1.0 - 1e-7))  # log(1 − p_v) everywhere
                total = miss.double().sum(dim=0)
                total.index_add_(0, y, (hit - miss.gather(-1, y.unsqueeze(-1)).squeeze(-1)).double())
                losses.append(-hit.double().mean().reshape(1).cpu())
                per_token.append((-total / len(y)).reshape(1, -1).cpu())
                probs.append(p.double().mean(dim=0).reshape(1, -1).cpu())
    finally:
        model.train(was_training)
    if not losses:
        raise ValueError("token_losses needs at least one batch")
    return torch.cat(losses), torch.cat(per_token), torch.cat(probs)


def with_parameters(model: nn.Module, params: Mapping[str, Tensor]) -> nn.Module:
    """``model`` called with ``params`` in place of the parameters of the same names (the others
    its own): θ measured without writing it into ``model`` (``torch.func.functional_call``)."""
    return _Substituted(model, params)


class _Substituted(nn.Module):
    def __init__(self, model: nn.Module, params: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.inner = model
        self.params = dict(params)
        self.train(model.training)

    def forward(self, tokens: Tensor) -> Tensor:
        out: Tensor = functional_call(self.inner, self.params, (tokens,))
        return out
