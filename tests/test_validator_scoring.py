"""Loss scoring: deterministic budgeted sample, honest vs harmful updates, model restored exactly."""

from __future__ import annotations

import pytest
import torch

from protocol.aggregate import sparse_of
from protocol.data import assigned_batches, random_batches
from protocol.identity import Identity
from protocol.model import build_model, eval_loss, parameters_of
from tests.validator_fixtures import Swarm, tiny_spec
from validator.scoring import LossScore, pick_sample, score_update, scoring_units, take_sequences


def test_pick_sample_is_deterministic_bounded_and_varies_by_window() -> None:
    peers = [f"p{i}" for i in range(20)]
    a = pick_sample(peers, 5, seed=0, window=3)
    assert len(a) == 5 and set(a) <= set(peers) and a == sorted(a)
    assert a == pick_sample(list(reversed(peers)), 5, seed=0, window=3)
    assert any(pick_sample(peers, 5, seed=0, window=w) != a for w in range(4, 10))
    assert pick_sample(peers, 0, 0, 0) == [] and pick_sample(peers[:2], 5, 0, 0) == peers[:2]


def test_data_key_follows_pipeline_groups() -> None:
    from validator.scoring import data_key

    assert data_key("p", {}) == "p" and data_key("p", {"loss": 1.0}) == "p"
    assert data_key("p", {"pipeline_group": "g1", "pipeline_stage": 1}) == "pipeline:g1"
    assert data_key("p", {"pipeline_group": 3}) == "p"  # malformed metadata: the peer's own lane


def test_validator_and_pipeline_replicas_share_one_data_key() -> None:
    from client.pipeline.replica import pipeline_peer_key
    from protocol.data import pipeline_data_key
    from validator.scoring import data_key

    assert data_key("p", {"pipeline_group": "g1"}) == pipeline_data_key("g1") == pipeline_peer_key("g1")


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
        assigned_batches(swarm.dataset, spec.seed, peer.peer_id, 0, spec.inner.steps, d.batch_size, d.seq_len), 8
    )
    rand = take_sequences(random_batches(swarm.dataset, 7, 2, d.batch_size, d.seq_len), 8)
    rand_before = eval_loss(model, rand)
    delta = swarm.delta(peer, before, 0)

    honest = score_update(
        model, sparse_of(swarm.encode(delta)), own=own, random=rand, random_before=rand_before, scale=1.0
    )
    assert not honest.harmful and honest.loss_own_after < honest.loss_own_before
    assert honest.loss_random_before == rand_before
    assert all(torch.equal(p, before[n]) for n, p in parameters_of(model).items())  # restored bit-exactly

    neg = {n: -t for n, t in delta.items()}
    harmful = score_update(
        model, sparse_of(swarm.encode(neg)), own=own, random=rand, random_before=rand_before, scale=1.0
    )
    assert harmful.harmful and harmful.score < honest.score
    assert all(torch.equal(p, before[n]) for n, p in parameters_of(model).items())

    zero = score_update(model, {}, own=own, random=rand, random_before=rand_before, scale=1.0)
    assert zero.harmful and zero.score == 0.0  # doing nothing does not count as helping


def test_pipeline_stages_are_scored_as_one_unit() -> None:
    meta = {
        "full-b": {},
        "s1": {"pipeline_group": "g", "pipeline_stage": 1},
        "full-a": {"pipeline_group": 7},  # malformed group: scored alone, on its own lane
        "s0": {"pipeline_group": "g", "pipeline_stage": 0},
        "h0": {"pipeline_group": "h", "pipeline_stage": 0},
    }
    assert scoring_units(meta) == {
        "full-a": ["full-a"],
        "full-b": ["full-b"],
        "pipeline:g": ["s0", "s1"],
        "pipeline:h": ["h0"],
    }
