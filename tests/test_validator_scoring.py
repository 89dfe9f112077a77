"""Loss scoring: deterministic budgeted sample, honest vs harmful updates, model restored exactly."""

from __future__ import annotations

import pytest
import torch

from protocol.aggregate import sparse_of
from protocol.data.assignment import assigned_batches, random_batches
from protocol.identity import Identity
from protocol.model import build_model, eval_loss, parameters_of, sequence_losses
from protocol.wire import PipelineRole
from tests.validator_fixtures import Swarm, tiny_spec
from validator.scoring import (
    LossScore,
    plan_sample,
    probation_order,
    score_update,
    scoring_batches,
    scoring_units,
    take_sequences,
)
from validator.significance import borderline, in_se, paired, verdict


def _plan(est: list[str], new: list[str], budget: int, slots: int, seed: bytes = b"s") -> list[str]:
    return plan_sample(established=est, probation=new, budget=budget, probation_slots=slots, seed=seed)


def test_plan_sample_is_deterministic_bounded_and_varies_by_seed() -> None:
    peers = [f"p{i}" for i in range(20)]
    a = _plan(peers, [], 5, 2)
    assert len(a) == 5 and set(a) <= set(peers) and a == sorted(a)
    assert a == _plan(list(peers), [], 5, 2) and set(peers[:3]) <= set(a)  # half (rounded up) in order
    assert any(_plan(peers, [], 5, 2, seed=bytes([w])) != a for w in range(6))
    assert _plan(peers, [], 0, 2) == [] and _plan(peers[:2], [], 5, 2) == peers[:2]


def test_plan_sample_reserves_slots_so_new_identities_cannot_starve_known_ones() -> None:
    known = [f"k{i}" for i in range(6)]
    flood = [f"s{i}" for i in range(1000)]
    plan = _plan(known, flood, 8, 3)
    assert sum(p.startswith("k") for p in plan) == 5 and sum(p.startswith("s") for p in plan) == 3
    assert sum(p.startswith("s") for p in _plan(known[:2], flood, 8, 3)) == 6  # unused known slots go to them
    assert sum(p.startswith("k") for p in _plan(known, flood[:1], 8, 3)) == 6  # and the other way round
    assert _plan([], ["s2", "s1", "s3"], 2, 1) == ["s1", "s2"]  # probation in the order given
    # half the established slots go to the first in the order given (the least agreeing)
    assert "k5" in _plan(["k5", *known[:5]], [], 2, 0) and "k5" in _plan(["k5", *known[:5]], [], 1, 0)
    order = probation_order(["a", "b", "c"], {"a": 0.5, "b": 0.9, "c": 0.1}, b"s")
    assert order == ["b", "a", "c"]  # most agreement with established uploads first
    # but passes so far come first: a flood arriving later cannot keep earlier identities on probation
    assert probation_order(["a", "b", "c"], {"a": 0.5, "b": 0.9, "c": 0.1}, b"s", {"c": 2, "a": 1}) == ["c", "a", "b"]
    flood = [f"s{i}" for i in range(1000)]
    order = probation_order(["early", *flood], dict.fromkeys(flood, 1.0), b"s", {"early": 1})
    assert order[0] == "early" and "early" in _plan([], order, 2, 2)  # scored despite agreeing least


def test_scoring_batches_come_from_the_held_out_split_and_follow_the_seed(swarm: Swarm) -> None:
    d = swarm.spec.data
    a = scoring_batches(swarm.dataset, b"seed-a", 6, d.batch_size, d.seq_len)
    assert sum(len(b) for b in a) == 6 and all(b.shape[1] == d.seq_len + 1 for b in a)
    again = scoring_batches(swarm.dataset, b"seed-a", 6, d.batch_size, d.seq_len)
    other = scoring_batches(swarm.dataset, b"seed-b", 6, d.batch_size, d.seq_len)
    assert all(torch.equal(x, y) for x, y in zip(a, again)) and not torch.equal(a[0], other[0])
    val = torch.from_numpy(swarm.dataset.val.read(0, len(swarm.dataset.val)).astype("int64"))
    first = a[0][0]
    windows = val.unfold(0, len(first), 1)
    assert bool((windows == first).all(dim=1).any())  # a held-out sequence


def test_data_key_follows_announced_pipeline_roles() -> None:
    from validator.scoring import data_key

    assert data_key("p", None) == "p"
    assert data_key("p", PipelineRole("g1", 1, 2)) == "pipeline:g1"


def test_validator_and_pipeline_replicas_share_one_data_key() -> None:
    from client.pipeline.replica import pipeline_peer_key
    from protocol.data.assignment import pipeline_data_key
    from validator.scoring import data_key

    assert data_key("p", PipelineRole("g1", 0, 2)) == pipeline_data_key("g1") == pipeline_peer_key("g1")


def test_take_sequences_crosses_batches() -> None:
    batches = [torch.zeros(4, 9, dtype=torch.long), torch.ones(4, 9, dtype=torch.long)]
    got = take_sequences(batches, 6)
    assert [b.shape[0] for b in got] == [4, 2] and int(got[1].sum()) == 18
    with pytest.raises(ValueError):
        take_sequences(batches, 0)


def test_loss_score_sign_and_harm() -> None:
    s = LossScore(loss_own_before=5.0, loss_own_after=4.0, loss_random_before=5.0, loss_random_after=4.6)
    assert s.score == pytest.approx(0.6) and not s.harmful
    assert LossScore(5.0, 5.0, 5.0, 4.9).harmful


@pytest.fixture(scope="module")
def swarm() -> Swarm:
    sw = Swarm(tiny_spec(Identity.generate()), 1)
    yield sw
    sw.close()


def test_honest_update_helps_its_own_data_and_negated_is_harmful(swarm: Swarm) -> None:
    spec, peer = swarm.spec, swarm.peers[0]
    model = build_model(spec.model)
    before = {n: p.detach().clone() for n, p in parameters_of(model).items()}
    d = spec.data
    own = take_sequences(
        assigned_batches(
            swarm.dataset, spec.seed, peer.peer_id, 0, spec.inner.steps, d.batch_size, d.seq_len, pages=d.pages
        ),
        8,
    )
    rand = take_sequences(random_batches(swarm.dataset, 7, 2, d.batch_size, d.seq_len), 8)
    rand_before = sequence_losses(model, rand)
    assert rand_before.shape == (8,) and float(rand_before.mean()) == pytest.approx(eval_loss(model, rand), rel=1e-6)
    delta = swarm.delta(peer, before, 0)

    honest = score_update(
        model, sparse_of(swarm.encode(delta, 0)), own=own, random=rand, random_before=rand_before, scale=1.0
    )
    assert not honest.harmful and honest.loss_own_after < honest.loss_own_before
    assert honest.loss_random_before == pytest.approx(float(rand_before.mean()))
    assert honest.own_se > 0 and honest.random_se > 0  # measured per sequence: every gain has an error bar
    assert verdict(honest, tolerance=0.002, min_gain=None, z=3.0).reason is None
    assert all(torch.equal(p, before[n]) for n, p in parameters_of(model).items())  # restored bit-exactly

    neg = {n: -t for n, t in delta.items()}
    harmful = score_update(
        model, sparse_of(swarm.encode(neg, 0)), own=own, random=rand, random_before=rand_before, scale=1.0
    )
    assert harmful.harmful and harmful.score < honest.score
    negated = verdict(harmful, tolerance=0.002, min_gain=None, z=3.0)
    assert negated.reason == "harmful" and negated.margin > 0  # clears its own noise: rejected
    assert all(torch.equal(p, before[n]) for n, p in parameters_of(model).items())

    zero = score_update(model, {}, own=own, random=rand, random_before=rand_before, scale=1.0)
    assert zero.harmful and zero.score == 0.0  # doing nothing does not count as helping
    assert zero.own_se == 0.0 and verdict(zero, tolerance=0.002, min_gain=None, z=3.0).reason == "harmful"


def test_paired_differences_cancel_what_the_sequences_contribute() -> None:
    before = torch.tensor([3.0, 5.0, 7.0, 9.0])  # sequences of very different difficulty
    after = before - torch.tensor([0.10, 0.12, 0.08, 0.10])  # the same small gain on each
    gain, se = paired(before, after)
    assert gain == pytest.approx(0.10)
    assert se == pytest.approx(float((before - after).std()) / 2.0) and se < 0.02  # unpaired: ~1.3
    assert paired(torch.tensor([4.0]), torch.tensor([3.5])) == (pytest.approx(0.5), 0.0)  # one sequence: no spread
    assert in_se(0.3, 0.1) == pytest.approx(3.0) and in_se(0.3, 0.0) == float("inf") and in_se(0.0, 0.0) == 0.0


def test_an_honest_but_noisy_update_is_not_rejected_and_a_clearly_harmful_one_is() -> None:
    # Own loss up by 0.01 and held-out loss up by 0.02 (past 0.002 × 5.0), both within noise.
    noisy = LossScore(5.0, 5.01, 5.0, 5.02, own_se=0.02, random_se=0.01)
    assert verdict(noisy, tolerance=0.002, min_gain=None, z=0.0).reason == "harmful"  # without error bars
    v = verdict(noisy, tolerance=0.002, min_gain=None, z=3.0)
    # nearest bar: the held-out one, 0.02 − 0.01 − 3 × 0.01 = −0.02 → 2.0 se short of it
    assert v.reason is None and v.margin == pytest.approx(-2.0) and "2.0 se short" in v.detail
    general = LossScore(5.0, 4.9, 5.0, 5.02, random_se=0.01)
    assert verdict(general, tolerance=0.002, min_gain=None, z=0.0).reason == "harmful_general"
    assert verdict(general, tolerance=0.002, min_gain=None, z=3.0).reason is None

    harmful = LossScore(5.0, 5.5, 5.0, 5.0, own_se=0.02)
    v = verdict(harmful, tolerance=0.002, min_gain=None, z=3.0)
    assert v.reason == "harmful" and v.margin == pytest.approx(22.0)  # 0.5 / 0.02 − 3
    assert "gain -0.5000 ± 0.0200" in v.detail and "+22.0 se past" in v.detail
    raises = LossScore(5.0, 4.5, 5.0, 5.5, own_se=0.02, random_se=0.01)
    v = verdict(raises, tolerance=0.002, min_gain=None, z=3.0)
    assert v.reason == "harmful_general" and v.margin == pytest.approx(46.0)  # (0.5 − 0.01) / 0.01 − 3
    # even the upper bound of the gain, 0.01 + 3 × 0.001, falls short of what others achieve
    weak = LossScore(5.0, 4.99, 5.0, 4.99, own_se=0.001)
    v = verdict(weak, tolerance=0.002, min_gain=0.05, z=3.0)
    assert v.reason == "ineffective" and v.margin == pytest.approx(37.0)
    assert verdict(LossScore(5.0, 4.99, 5.0, 4.99, own_se=0.02), tolerance=0.002, min_gain=0.05, z=3.0).reason is None
    assert borderline(noisy, tolerance=0.002, min_gain=None, z=3.0)  # worth measuring again
    assert not borderline(harmful, tolerance=0.002, min_gain=None, z=3.0)
    assert not borderline(noisy, tolerance=0.002, min_gain=None, z=0.0)  # without error bars: nothing to settle
    nan = LossScore(5.0, float("nan"), 5.0, float("nan"), own_se=float("nan"))
    assert verdict(nan, tolerance=0.002, min_gain=None, z=3.0).reason == "harmful"


def test_pipeline_stages_are_scored_as_one_unit() -> None:
    roles = {
        "full-b": None,
        "s1": PipelineRole("g", 1, 2),
        "full-a": None,
        "s0": PipelineRole("g", 0, 2),
        "h0": PipelineRole("h", 0, 2),
        "x0": PipelineRole("g", 0, 2),  # claims a stage that is taken: scored alone, on its own lane
    }
    assert scoring_units(roles, roles, pipelines=True) == {
        "full-a": ["full-a"],
        "full-b": ["full-b"],
        "pipeline:g": ["s0", "s1"],
        "pipeline:h": ["h0"],
        "x0": ["x0"],
    }
    # a run without pipelines scores everyone alone, whatever they announced
    assert scoring_units(roles, roles, pipelines=False) == {p: [p] for p in sorted(roles)}
