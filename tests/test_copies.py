"""Influence that falls smoothly with similarity to earlier uploads (validator.copies), and the
weighted mean it enters (protocol.aggregate.SparseSum)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from protocol.aggregate import SparseSum, aggregate
from validator import checks, window_checks
from validator.copies import CopyRule, Similarity, assess, influence, settle
from validator.held import hold
from validator.log import CheckRow
from validator.sketch import Sketcher

RULE = CopyRule(overlap=0.6, rare=0.3, signs=0.8, overlap_lower=0.5, rare_lower=0.2)


def _entry(idx: np.ndarray, sign: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    return np.unique(idx).astype(np.int64), np.full(len(np.unique(idx)), sign, dtype=np.float32)


def test_influence_is_one_below_the_lower_bound_zero_at_the_threshold_and_linear_between() -> None:
    by_overlap = [influence(Similarity(x, 0.0, 1.0), RULE) for x in np.linspace(0.0, 1.0, 101)]
    assert all(a >= b for a, b in zip(by_overlap, by_overlap[1:]))  # monotone
    assert influence(Similarity(0.5, 0.0, 1.0), RULE) == 1.0 == influence(Similarity(0.3, 0.1, 0.99), RULE)
    assert influence(Similarity(0.55, 0.0, 1.0), RULE) == pytest.approx(0.5)
    assert influence(Similarity(0.6, 0.0, 1.0), RULE) == 0.0 == influence(Similarity(0.9, 0.0, 0.0), RULE)
    # the rare route, with agreeing signs: the same ramp from rare_lower to the rare threshold
    by_rare = [influence(Similarity(0.1, r, 0.9), RULE) for r in np.linspace(0.0, 1.0, 101)]
    assert all(a >= b for a, b in zip(by_rare, by_rare[1:]))
    assert influence(Similarity(0.1, 0.25, 0.9), RULE) == pytest.approx(0.5)
    assert influence(Similarity(0.1, 0.3, 0.8), RULE) == 0.0
    # signs at chance do not count; between chance and copy_sign_agreement in proportion
    assert influence(Similarity(0.1, 0.9, 0.5), RULE) == 1.0
    assert influence(Similarity(0.1, 0.5, 0.65), RULE) == pytest.approx(1.0 - 0.05 / 0.1)
    # without a background of uploads rare positions mean nothing
    assert influence(Similarity(0.1, 0.9, 1.0), RULE, background=False) == 1.0
    # lower bounds at the thresholds: today's hard rule, full weight up to them
    hard = CopyRule(overlap_lower=0.6, rare_lower=0.3)
    assert influence(Similarity(0.59, 0.29, 1.0), hard) == 1.0 and influence(Similarity(0.6, 0.0, 1.0), hard) == 0.0


def _window(copy_share: float, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Six honest-like uploads sharing popular positions (overlap ~0.25 between them) and one
    that takes ``copy_share`` of h0's positions plus fresh ones of its own."""
    rng = np.random.default_rng(seed)
    popular = np.arange(0, 2000)
    entries = {}
    for i in range(6):
        own = rng.choice(np.arange(10_000, 1_000_000), size=300, replace=False)
        entries[f"h{i}"] = _entry(np.concatenate([rng.choice(popular, 100, replace=False), own]))
    orig = entries["h0"][0]
    copied = rng.choice(orig, size=int(copy_share * len(orig)), replace=False)
    fresh = rng.choice(np.arange(2_000_000, 3_000_000), size=len(orig) - len(copied), replace=False)
    entries["c"] = _entry(np.concatenate([copied, fresh]))
    return entries


def test_honest_like_uploads_keep_full_weight_and_a_near_copy_loses_in_proportion() -> None:
    times = {f"h{i}": float(i) for i in range(6)} | {"c": 10.0}
    rule = CopyRule(overlap=0.6, rare=0.6, signs=0.8, overlap_lower=0.3, rare_lower=0.3)
    found = assess(_window(0.0), times, rule)
    assert found.weights == {} and found.verdicts == {}  # honest overlaps are below the bounds
    weights = []
    for share in (0.2, 0.35, 0.45, 0.55, 0.7):
        found = assess(_window(share), times, rule)
        assert all(p == "c" for p in found.weights)  # only the later upload loses
        weights.append(found.weights.get("c", 1.0))
    assert weights[0] == 1.0 and 0.0 < weights[2] < 1.0 and weights[-1] == 0.0
    assert all(a >= b for a, b in zip(weights, weights[1:]))
    assert "c" in assess(_window(0.7), times, rule).verdicts  # at the threshold: copied, as before


def test_weights_are_order_free_and_same_poll_pairs_share_one_unit() -> None:
    entries = _window(0.45)
    rule = CopyRule(overlap=0.6, rare=0.6, signs=0.8, overlap_lower=0.3, rare_lower=0.3)
    same_poll = {p: 1.0 for p in entries}
    found = assess(entries, same_poll, rule)
    w = settle(found.weights, found.ties, entries)
    assert found.weights == {} and set(found.ties) == {"h0", "c"}
    assert w["h0"] == w["c"] and 0.5 < w["c"] < 1.0 and all(w[f"h{i}"] == 1.0 for i in range(1, 6))  # (1 + share) / 2
    shuffled = dict(reversed(list(entries.items())))
    again = assess(shuffled, dict(reversed(list(same_poll.items()))), rule)
    assert settle(again.weights, again.ties, list(reversed(list(entries)))) == w
    # the partner rejected later (a copier on probation, say): the other keeps its whole weight
    assert settle(found.weights, found.ties, [p for p in entries if p != "c"])["h0"] == 1.0
    # an exact copy in the same poll: half each, so that the pair counts as the original alone
    a = np.arange(50)
    found = assess({"x": _entry(a), "y": _entry(a)}, {"x": 1.01, "y": 1.02}, rule, {"x": 1.0, "y": 1.0})
    assert settle(found.weights, found.ties, "xy") == {"x": 0.5, "y": 0.5}
    assert all(v.tie for v in found.verdicts.values())
    # once the order is proven the later one is the copier and the original keeps all its weight
    found = assess({"x": _entry(a), "y": _entry(a)}, {"x": 1.01, "y": 2.02}, rule, {"x": 1.0, "y": 2.0})
    assert found.weights == {"y": 0.0} and found.ties == {} and not found.verdicts["y"].tie


def test_a_copy_of_a_tied_upload_is_still_a_copy() -> None:
    a = np.arange(50)
    entries = {"x": _entry(a), "y": _entry(np.r_[0:40, 100:110]), "z": _entry(a)}
    entries |= {f"h{i}": _entry(np.arange(1000 * (i + 1), 1000 * (i + 1) + 50)) for i in range(3)}
    listed = {p: 1.0 for p in entries} | {"z": 2.0}
    found = assess(entries, listed | {"z": 3.0}, RULE, listed)
    assert not found.verdicts["z"].tie and found.weights["z"] == 0.0
    assert settle(found.weights, found.ties, "xy") == {"x": 0.5, "y": 0.5}


def _contribs(seed: int, n: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randperm(40, generator=g)[:15].sort().values
        out.append({"w": (idx, torch.randn(15, generator=g)), "b": (torch.tensor([1]), torch.randn(1, generator=g))})
    return out


@pytest.mark.parametrize("mode", ["contributors", "all"])
def test_a_weighted_mean_at_weight_one_is_the_unweighted_mean_bit_for_bit(mode: str) -> None:
    cs = _contribs(0, 5)
    plain, weighted = SparseSum({"w": (40,), "b": (4,)}), SparseSum({"w": (40,), "b": (4,)})
    plain.add(cs)
    weighted.add(cs, weights=[1.0] * 5)
    ref = aggregate(cs, mode=mode, clip="none")
    for name, (idx, vals) in weighted.mean(mode).items():
        assert torch.equal(idx, ref[name][0]) and torch.equal(vals, ref[name][1])
        assert torch.equal(vals, plain.mean(mode)[name][1])


@pytest.mark.parametrize("mode", ["contributors", "all"])
def test_a_weighted_mean_weighs_each_contribution_and_a_halved_pair_counts_once(mode: str) -> None:
    cs = _contribs(1, 3)
    total = SparseSum({"w": (40,), "b": (4,)})
    total.add(cs[:2], weights=[1.0, 0.25])
    total.add(cs[2:], weights=[1.0])
    dense = torch.zeros(3, 40, dtype=torch.float64)
    present = torch.zeros(3, 40, dtype=torch.float64)
    for k, c in enumerate(cs):
        dense[k, c["w"][0]] = c["w"][1].double()
        present[k, c["w"][0]] = 1.0
    w = torch.tensor([1.0, 0.25, 1.0], dtype=torch.float64)[:, None]
    idx, vals = total.mean(mode)["w"]
    div = (w * present).sum(0)[idx] if mode == "contributors" else w.sum()
    assert torch.allclose(vals.double(), (w * dense).sum(0)[idx] / div, atol=1e-6)
    # one contribution twice at ½ each is the contribution once among the others
    pair = SparseSum({"w": (40,), "b": (4,)})
    pair.add([cs[0], cs[1], cs[0]], weights=[0.5, 1.0, 0.5])
    once = aggregate(cs[:2], mode=mode, clip="none")
    for name, (i, v) in pair.mean(mode).items():
        assert torch.equal(i, once[name][0]) and torch.allclose(v, once[name][1], atol=1e-7)
    with pytest.raises(ValueError):
        pair.add([cs[0]], weights=[0.0])


def _screened(peer: str, idx: np.ndarray) -> checks.Screened:
    sparse = {"w": (torch.from_numpy(idx.astype(np.int64)), torch.ones(len(idx), dtype=torch.float32))}
    held = hold(b"", peer, sparse, {"w": (8192, 1024)}, Sketcher({"w": 0}))
    return checks.Screened(peer=peer, checks=(CheckRow("size", True),), reason=None, held=held)


def test_the_copy_check_gives_a_later_near_copy_a_weight_and_same_poll_pairs_a_shared_one() -> None:
    rng = np.random.default_rng(1)
    orig = np.sort(rng.choice(1 << 22, 400, replace=False))
    near = np.sort(np.concatenate([orig[:220], rng.choice(np.arange(1 << 22, 1 << 23), 180, replace=False)]))
    ups = [_screened("a", orig), _screened("b", np.sort(rng.choice(1 << 22, 400, replace=False))), _screened("c", near)]
    rule = CopyRule(overlap=0.6, rare=0.9, signs=0.8, overlap_lower=0.5, rare_lower=0.9)
    out = window_checks.shared(window_checks.copies(ups, {"a": 1.0, "b": 1.5, "c": 2.0}, rule))
    assert [s.reason for s in out] == [None, None, None]
    assert out[0].weight == out[1].weight == 1.0 and out[2].weight == pytest.approx((0.6 - 0.55) / 0.1)
    assert "weight 0.500" in (out[2].detail or "")
    # the same pair listed in the same poll: they share, (1 + ½) / 2 each, while both stand
    same = window_checks.copies(ups, {"a": 1.0, "b": 1.0, "c": 1.0}, rule)
    assert [s.weight for s in window_checks.shared(same)] == pytest.approx([0.75, 1.0, 0.75])
    gone = [same[0], same[1], replace(same[2], reason="probation")]
    assert [s.weight for s in window_checks.shared(gone)[:2]] == [1.0, 1.0]  # the original keeps it all
