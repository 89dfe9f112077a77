"""client/simulator: same bytes as the real peer path, loss goes down, runs are reproducible."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from client.simulator import SimConfig, Simulator, compress_and_pack, unpack_sparse
from client.trainer import InnerTrainer, pseudo_gradient, snapshot
from protocol.aggregate import sparse_of
from protocol.codec import pack
from protocol.config import CodecConfig, InnerConfig, OuterConfig, model_config
from protocol.data.assignment import TokenDataset, assigned_batches, write_shards
from protocol.data.tokenizer import ByteTokenizer
from protocol.feedback import FeedbackState, compress_step
from protocol.identity import Identity
from protocol.model import build_model
from protocol.wire import Contribution, decode_contribution, encode_contribution

MCFG = model_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
CODEC = CodecConfig(k=64)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    """A small, learnable corpus: repetitive English-like text."""
    rng = np.random.default_rng(0)
    words = ["the", "model", "peer", "sends", "a", "sparse", "update", "and", "validator", "checks", "it"]
    docs = [(f"d{i}", (" ".join(rng.choice(words, 400)) + ".\n").encode()) for i in range(60)]
    return write_shards(tmp_path_factory.mktemp("sim") / "shards", docs, ByteTokenizer(), val_fraction=0.1)


def sim(method: str, **kw: object) -> SimConfig:
    outer = OuterConfig(alpha=0.7) if method == "diloco" else OuterConfig(**kw)  # type: ignore[arg-type]
    inner = InnerConfig(steps=4, lr=4e-3, warmup_steps=2, total_steps=12)
    return SimConfig(
        method=method,
        replicas=3,
        rounds=3,
        inner=inner,
        outer=outer,
        codec=CODEC,
        batch_size=4,
        seq_len=32,
        eval_sequences=16,
    )


def test_sparse_path_bytes_equal_the_real_peer_path(dataset: TokenDataset) -> None:
    """compress_and_pack (simulator) == compress_step + wire.encode_contribution (peer)."""
    model = build_model(MCFG)
    base = snapshot(model)
    trainer = InnerTrainer(model, InnerConfig(steps=2, lr=1e-2, warmup_steps=1))
    trainer.train_window(assigned_batches(dataset, 0, "peer", 0, 2, 4, 32, pages=4))
    delta = pseudo_gradient(base, model)
    warm = {n: torch.randn_like(d) * 1e-3 for n, d in delta.items()}  # a non-trivial error buffer
    state = FeedbackState(warm)

    payloads, sim_state = compress_and_pack(state, delta, 0.95, CODEC)
    encoded, peer_state = compress_step(state, delta, beta=0.95, cfg=CODEC)  # what client/replica.py calls
    ident = Identity.generate()
    blob = encode_contribution(Contribution("ab" * 32, 0, "genesis", CODEC, encoded, {}), ident)

    assert payloads == {n: pack(e) for n, e in encoded.items()}
    assert b"".join(payloads[n] for n in sorted(payloads)) in blob  # the wire carries these exact bytes
    for n in delta:
        assert torch.equal(sim_state.buffers[n], peer_state.buffers[n])
    shapes = {n: tuple(d.shape) for n, d in delta.items()}
    ours = unpack_sparse(payloads, shapes, CODEC)
    received = decode_contribution(blob, run_hash="ab" * 32, max_bytes=1 << 24)
    theirs = sparse_of(received.value.tensors)  # what the validator aggregates
    for n in shapes:
        assert torch.equal(ours[n][0], theirs[n][0]) and torch.equal(ours[n][1], theirs[n][1])


def test_three_replicas_three_rounds_lower_the_loss(dataset: TokenDataset) -> None:
    res = Simulator(MCFG, dataset, sim("sparseloco")).run()
    assert len(res.rounds) == 3
    assert res.final_val_loss < res.initial_val_loss - 0.3
    numel = sum(p.numel() for p in build_model(MCFG).parameters())
    assert 0 < res.bytes_per_replica_per_round < 4 * numel / 20  # far below dense fp32


def test_baselines_and_all_r_variant_run_and_learn(dataset: TokenDataset) -> None:
    results = {m: Simulator(MCFG, dataset, sim(m)).run() for m in ("ddp", "diloco")}
    results["all"] = Simulator(MCFG, dataset, sim("sparseloco", aggregation="all")).run()
    for name in ("ddp", "diloco"):
        assert results[name].final_val_loss < results[name].initial_val_loss - 0.3, name
    # mean over all R shrinks every coordinate by its contributors/R: slower, but it must learn
    assert results["all"].final_val_loss < results["all"].initial_val_loss - 0.05
    numel = sum(p.numel() for p in build_model(MCFG).parameters())
    assert results["diloco"].bytes_per_replica_per_round == 4 * numel
    assert results["ddp"].bytes_per_replica_per_round == 4 * numel * 4  # H all-reduces


def test_simulation_is_reproducible(dataset: TokenDataset) -> None:
    cfg = replace(sim("sparseloco"), replicas=2, rounds=2)
    a = Simulator(MCFG, dataset, cfg).run()
    b = Simulator(MCFG, dataset, cfg).run()
    assert a.fingerprint == b.fingerprint
    assert [r.val_loss for r in a.rounds] == [r.val_loss for r in b.rounds]


def test_recompressed_aggregates_download_less_and_still_learn(dataset: TokenDataset) -> None:
    # k = 64 in every round (warmup_k = 0): the validator's k = 16 is a quarter of what peers send.
    plain = Simulator(MCFG, dataset, sim("sparseloco", warmup_k=0)).run()
    smaller = Simulator(
        MCFG, dataset, sim("sparseloco", warmup_k=0, recompress=True, recompress_from=1, recompress_k=16)
    ).run()
    assert smaller.final_val_loss < smaller.initial_val_loss - 0.05  # a quarter of the values per round
    assert 0 < smaller.download_per_replica_per_round < plain.download_per_replica_per_round / 2
    assert plain.download_per_replica_per_round < 3 * 3 * plain.bytes_per_replica_per_round  # ≈ R uploads


def test_a_top_k_warm_up_sends_more_in_the_first_windows_only(dataset: TokenDataset) -> None:
    plain = Simulator(MCFG, dataset, sim("sparseloco", warmup_k=0)).run()
    warm = Simulator(MCFG, dataset, sim("sparseloco", warmup_k=256, warmup_windows=2)).run()  # k: 256, 160, 64
    sent = [r.bytes_per_replica for r in warm.rounds]
    assert sent[0] > sent[1] > sent[2] and sent[0] > 2 * plain.rounds[0].bytes_per_replica
    assert abs(sent[2] - plain.rounds[2].bytes_per_replica) < 0.1 * plain.rounds[2].bytes_per_replica
    assert warm.final_val_loss < warm.initial_val_loss - 0.3


def test_an_eager_round_that_waits_for_the_forecast_is_the_synchronous_one(dataset: TokenDataset) -> None:
    """Every contribution is visible after a quarter of the round: a replica that waits that long
    (outer.forecast_wait) trains exactly the synchronous rounds; one that starts at once trains its
    first step from its own contribution alone and ends elsewhere."""
    sync = Simulator(MCFG, dataset, sim("sparseloco", delay=0)).run()
    timing = dict(arrival=0.5, forecast_at=0.25)
    waits = Simulator(MCFG, dataset, replace(sim("sparseloco", forecast_wait=0.25), **timing)).run()
    starts = Simulator(MCFG, dataset, replace(sim("sparseloco", forecast_wait=0.0), **timing)).run()
    assert waits.fingerprint == sync.fingerprint != starts.fingerprint
    assert [r.waited for r in waits.rounds] == [0.0, 0.25, 0.25] and starts.waited == 0.0
