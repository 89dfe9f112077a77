"""Row concentration and the targeted verdict: which rows a contribution crowds, which tokens are
measured, what an unscored concentrated contribution keeps, and when a token's rise is evidence."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.aggregate import NormLimit, clip_to_limits
from protocol.config import ModelConfig
from protocol.model import build_model, sequence_losses
from tests.validator_fixtures import TINY_MODEL
from validator import concentration
from validator.decide import TARGET_ROWS, measured_tokens
from validator.reference import measured
from validator.scoring import LossScore, token_losses
from validator.significance import borderline, verdict

SCHEMA = {"emb": (8, 4), "bias": (4,)}


def _contribution(rows: dict[int, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``emb`` with ``rows[r]`` values kept in row r (value 1.0 each), and a 1-D tensor."""
    idx = sorted(r * 4 + c for r, n in rows.items() for c in range(n))
    return {
        "emb": (torch.tensor(idx, dtype=torch.int64), torch.ones(len(idx))),
        "bias": (torch.tensor([0, 1]), torch.ones(2)),
    }


def test_typical_counts_are_a_lower_median_with_a_floor() -> None:
    a = measured(_contribution({0: 2, 1: 1}), SCHEMA)
    b = measured(_contribution({0: 2, 2: 1}), SCHEMA)
    c = measured(_contribution({0: 4, 1: 1, 2: 1}), SCHEMA)
    typical = concentration.typical_counts([a, b, c])
    assert set(typical) == {"emb"}  # only matrices have rows
    assert typical["emb"].tolist() == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # floor: at least one


def test_row_excess_names_the_crowded_row_and_the_tokens_it_moves_most() -> None:
    honest = [measured(_contribution({r: 1 for r in range(8)}), SCHEMA) for _ in range(3)]
    typical = concentration.typical_counts(honest)
    edit = measured(_contribution({5: 4, 1: 2}), SCHEMA)
    ex = concentration.row_excess(edit, typical)
    assert (ex.name, ex.row, ex.ratio) == ("emb", 5, 4.0) and "row 5 of emb" in ex.describe()
    assert concentration.row_excess(honest[0], typical).ratio == 1.0
    assert concentration.moved_tokens(edit, typical, vocab=8, count=2) == (5, 1)
    assert concentration.moved_tokens(edit, typical, vocab=8, count=5) == (5, 1)  # untouched rows: not named
    assert concentration.moved_tokens(edit, typical, vocab=7, count=2) == ()  # no tensor with a row per token
    assert concentration.row_excess(edit, {}) == concentration.Excess()


def test_every_crowded_token_is_measured_even_behind_rows_that_are_fuller() -> None:
    """Counts saturate at a row's length: rows the honest part fills (all 4 values) rank before an
    edited row with 3 of 4 kept. The first TARGET_ROWS are measured, and beyond them every token
    whose row passes the excess ratio (the rows an unscored contribution has held back)."""
    honest = [measured(_contribution({r: 1 for r in range(8)}), SCHEMA) for _ in range(3)]
    typical = concentration.typical_counts(honest)
    update = measured(_contribution({0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 6: 3, 7: 2}), SCHEMA)
    moved = concentration.moved_tokens(update, typical, vocab=8, count=8)
    assert moved == (0, 1, 2, 3, 4, 6, 7) and moved.index(6) >= TARGET_ROWS
    crowded = concentration.crowded_tokens(update, typical, vocab=8, ratio=2.0)
    rows = concentration.concentrated_rows(update, typical, 2.0)
    assert crowded == frozenset(rows["emb"].nonzero().flatten().tolist()) == {0, 1, 2, 3, 4, 6}
    assert measured_tokens(moved, crowded) == (0, 1, 2, 3, 4, 6)  # 7 (2 x typical) is not past the ratio
    assert measured_tokens(moved, frozenset()) == moved[:TARGET_ROWS]
    assert concentration.crowded_tokens(update, typical, vocab=8, ratio=0.0) == frozenset()  # the check off
    assert concentration.crowded_tokens(update, typical, vocab=7, ratio=2.0) == frozenset()  # no row per token


def test_an_unscored_concentrated_row_is_held_back_and_the_others_keep_their_caps() -> None:
    honest = [measured(_contribution({r: 1 for r in range(8)}), SCHEMA) for _ in range(3)]
    typical = concentration.typical_counts(honest)
    edit = _contribution({5: 4, 1: 1})
    rows = concentration.concentrated_rows(measured(edit, SCHEMA), typical, 2.0)
    assert rows["emb"].nonzero().flatten().tolist() == [5]
    limits = {"emb": NormLimit(norm=10.0, row=10.0, row_len=4, rows=torch.full((8,), 3.0)), "bias": NormLimit(1.0)}
    held = concentration.held_back(limits, rows, {"emb": 4})
    assert held is not None and held["bias"] == limits["bias"]
    assert held["emb"].rows is not None and held["emb"].rows.tolist() == [3.0] * 5 + [0.0] + [3.0] * 2
    (clipped,) = clip_to_limits([edit], held)
    idx, vals = clipped["emb"]
    assert bool((vals[idx // 4 == 5] == 0).all()) and bool((vals[idx // 4 == 1] == 1.0).all())
    # a run that does not clip: only the held-back rows are capped
    free = concentration.held_back(None, rows, {"emb": 4})
    assert free is not None and math.isinf(free["emb"].norm) and free["emb"].rows is not None
    assert free["emb"].rows[5] == 0.0 and math.isinf(float(free["emb"].rows[0]))
    assert concentration.held_back(None, {}, {}) is None


def _score(before: float, after: float, se: float) -> LossScore:
    return LossScore(
        5.0, 4.9, 5.0, 5.0, own_se=0.01, random_se=0.01, tokens=(7,), token_before=(before,), token_after=(after,),
        token_se=(se,),
    )  # fmt: skip


def test_the_targeted_verdict_rejects_a_token_rise_only_past_its_error_bar() -> None:
    kw = {"tolerance": 0.002, "min_gain": None, "z": 3.0, "target_tolerance": 0.5}
    clear = verdict(_score(0.002, 0.006, 0.0001), **kw)  # ×3, se 5 % of the level
    assert clear.reason == "targeted" and clear.margin == pytest.approx((0.006 - 0.003 - 0.0003) / 0.0001)
    assert "token 7" in clear.detail and "se past" in clear.detail
    assert verdict(_score(0.002, 0.0028, 0.0001), **kw).reason is None  # +40 %: within the tolerance
    noisy = _score(0.002, 0.0032, 0.0001)  # +60 %, but within 3 se of the bar
    assert verdict(noisy, **kw).reason is None and borderline(noisy, **kw)
    assert verdict(_score(0.002, math.nan, 0.0), **kw).reason == "targeted"
    assert verdict(_score(0.002, 0.006, 0.0001), tolerance=0.002, min_gain=None, z=3.0).reason is None  # off
    assert verdict(LossScore(5.0, 4.9, 5.0, 5.0, own_se=0.01, random_se=0.01), **kw).reason is None  # not measured


def test_token_losses_are_the_sequence_losses_and_a_binary_loss_per_token() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**TINY_MODEL, "vocab_size": 16}))  # type: ignore[arg-type]
    batches = [torch.randint(0, 16, (2, 9)), torch.randint(0, 16, (3, 9))]
    losses, per_token, probs = token_losses(model, batches)
    assert torch.allclose(losses, sequence_losses(model, batches), atol=1e-5)
    assert per_token.shape == probs.shape == (5, 16) and bool((per_token > 0).all())
    assert torch.allclose(probs.sum(dim=1), torch.ones(5, dtype=torch.float64))
    with torch.no_grad():
        batch = batches[0]
        p = model(batch[:, :-1]).softmax(-1)[0, :, 3].double()
        y = (batch[0, 1:] == 3).double()
        expected = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    assert float(per_token[0, 3]) == pytest.approx(float(expected), rel=1e-4)
