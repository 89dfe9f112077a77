"""protocol/aggregate, client/outer, client/schedule on hand-made examples."""

from __future__ import annotations

import math

import pytest
import torch

from client.outer import NesterovOuter, dense_mean
from client.schedule import lr_at
from protocol.aggregate import (
    aggregate,
    apply_outer,
    clip_to_median_norm,
    mean_over_all,
    mean_over_contributors,
)
from protocol.config import InnerConfig
from protocol.errors import InvalidIndices, NonFiniteValues, SchemaMismatch


def sp(idx: list[int], vals: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(idx, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32)


A = {"w": sp([0, 2], [1.0, 3.0])}
B = {"w": sp([2, 5], [5.0, 7.0])}


def test_mean_over_contributors_vs_mean_over_all() -> None:
    idx, vals = mean_over_contributors([A, B])["w"]
    assert idx.tolist() == [0, 2, 5] and vals.tolist() == [1.0, 4.0, 7.0]
    idx, vals = mean_over_all([A, B])["w"]
    assert idx.tolist() == [0, 2, 5] and vals.tolist() == [0.5, 4.0, 3.5]
    assert mean_over_all([A, B], n=4)["w"][1].tolist() == [0.25, 2.0, 1.75]


def test_median_clip_scales_down_only_the_large_ones() -> None:
    small = {"w": sp([0], [1.0])}  # norm 1
    mid = {"w": sp([1, 2], [0.0, 2.0])}  # norm 2 (the median)
    big = {"w": sp([3, 4], [6.0, 8.0])}  # norm 10
    out = clip_to_median_norm([small, mid, big])
    assert out[0]["w"][1].tolist() == [1.0]  # never scaled up
    assert out[1]["w"][1].tolist() == [0.0, 2.0]
    assert torch.allclose(out[2]["w"][1], torch.tensor([1.2, 1.6]))
    assert math.isclose(float(out[2]["w"][1].norm()), 2.0, rel_tol=1e-6)
    assert big["w"][1].tolist() == [6.0, 8.0]  # inputs untouched
    # even count: the median is the mean of the two middle norms
    even = clip_to_median_norm([small, mid, big, {"w": sp([0], [4.0])}])
    assert math.isclose(float(even[2]["w"][1].norm()), 3.0, rel_tol=1e-6)


def test_aggregate_modes_and_determinism() -> None:
    big = {"w": sp([2, 9], [30.0, 40.0])}
    clipped = aggregate([A, B, big], mode="contributors", clip="median")
    raw = aggregate([A, B, big], mode="contributors", clip="none")
    assert raw["w"][1].tolist() == pytest.approx([1.0, 38 / 3, 7.0, 40.0])
    assert float(clipped["w"][1].abs().max()) < 10.0  # the outlier no longer dominates
    again = aggregate([A, B, big], mode="contributors", clip="median")
    assert torch.equal(clipped["w"][0], again["w"][0]) and torch.equal(clipped["w"][1], again["w"][1])
    assert aggregate([], "all", "none") == {}
    with pytest.raises(ValueError):
        aggregate([A], mode="sum")


def test_apply_outer_in_place_and_validated() -> None:
    params = {"w": torch.zeros(2, 3), "b": torch.ones(3)}
    apply_outer(params, {"w": sp([1, 5], [1.0, -2.0])}, alpha=0.5)
    assert params["w"].view(-1).tolist() == [0.0, -0.5, 0.0, 0.0, 0.0, 1.0]
    before = {n: p.clone() for n, p in params.items()}
    bad = [
        ({"w": sp([0, 6], [1.0, 1.0])}, InvalidIndices),  # out of range
        ({"w": sp([3, 3], [1.0, 1.0])}, InvalidIndices),  # duplicate
        ({"w": sp([4, 1], [1.0, 1.0])}, InvalidIndices),  # unsorted
        ({"w": sp([1], [float("nan")])}, NonFiniteValues),
        ({"nope": sp([0], [1.0])}, SchemaMismatch),
        # a valid tensor first, then a bad one: nothing may be written
        ({"b": sp([0], [1.0]), "w": sp([-1], [1.0])}, InvalidIndices),
    ]
    for delta, err in bad:
        with pytest.raises(err):
            apply_outer(params, delta, 1.0)
        assert all(torch.equal(params[n], before[n]) for n in params)


def test_nesterov_outer_matches_torch_sgd() -> None:
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(5))
    p2 = {"x": p1.detach().clone()}
    sgd = torch.optim.SGD([p1], lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    for _ in range(3):
        g = torch.randn(5)
        p1.grad = g.clone()
        sgd.step()
        outer.step(p2, {"x": g})
    assert torch.allclose(p1.detach(), p2["x"], atol=1e-6)
    restored = NesterovOuter(0.7, 0.9)
    restored.load_state_dict(outer.state_dict())
    assert torch.equal(restored.buffers["x"], outer.buffers["x"])
    assert dense_mean([{"x": torch.ones(2)}, {"x": torch.zeros(2)}])["x"].tolist() == [0.5, 0.5]


def test_schedule_warmup_then_cosine() -> None:
    cfg = InnerConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1) == lr_at(10_000, cfg)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    with pytest.raises(ValueError):
        lr_at(-1, cfg)
