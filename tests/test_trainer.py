"""client/trainer: inner AdamW loop, schedule continuity, accumulation, save/restore bit-identity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client.schedule import lr_at
from client.state import LocalState, Snapshot
from client.trainer import InnerTrainer, load_params, pseudo_gradient, snapshot
from protocol.config import InnerConfig, model_config
from protocol.errors import ConfigError
from protocol.model import build_model, fingerprint

MCFG = model_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
ICFG = InnerConfig(steps=3, lr=3e-3, warmup_steps=2, total_steps=20)


def batches(seed: int, n: int = 3, b: int = 4, t: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (b, t + 1), generator=g) for _ in range(n)]


def test_window_trains_and_reports() -> None:
    model = build_model(MCFG)
    trainer = InnerTrainer(model, ICFG)
    base = snapshot(model)
    same = batches(0, n=1) * 6  # one batch repeated: the loss must fall
    stats = trainer.train_window(same)
    assert stats.steps == 6 and trainer.step == 6 and stats.start_step == 0
    assert stats.tokens == 6 * 4 * 16 and stats.skipped_steps == 0
    assert stats.last_loss < stats.first_loss - 0.05
    assert stats.last_lr == pytest.approx(lr_at(5, ICFG))
    delta = pseudo_gradient(base, model)
    assert set(delta) == set(base) and all(d.dtype == torch.float32 for d in delta.values())
    assert sum(float(d.abs().sum()) for d in delta.values()) > 0
    load_params(model, base)
    assert fingerprint(model) == fingerprint(base)
    with pytest.raises(ValueError):
        trainer.train_window([])


def test_save_restore_continues_bit_identically(tmp_path: Path) -> None:
    model = build_model(MCFG)
    trainer = InnerTrainer(model, ICFG)
    trainer.train_window(batches(1))
    theta, state = snapshot(model), LocalState(tmp_path)
    state.save(Snapshot("a" * 64, 1, "b" * 64, "c" * 64, optimizer=trainer.state_dict()))  # the peer's commit
    trainer.train_window(batches(2))  # the uninterrupted run

    fresh = build_model(MCFG)  # a restarted peer: θ from its checkpoint, optimizer from its state dir
    load_params(fresh, theta)
    restored = InnerTrainer(fresh, ICFG)
    snap = state.load("a" * 64)
    assert snap is not None
    restored.load_state_dict(snap.optimizer)
    assert restored.step == 3
    restored.train_window(batches(2))
    assert fingerprint(fresh) == fingerprint(model)
    # without the optimizer state the continuation differs (the production failure mode)
    naive = build_model(MCFG)
    load_params(naive, theta)
    InnerTrainer(naive, ICFG).train_window(batches(2))
    assert fingerprint(naive) != fingerprint(model)


def test_state_dict_round_trip_and_misfit() -> None:
    model = build_model(MCFG)
    trainer = InnerTrainer(model, ICFG)
    trainer.train_window(batches(3, n=1))
    other = InnerTrainer(build_model(MCFG), ICFG)
    other.load_state_dict(trainer.state_dict())
    assert other.step == 1
    bigger = InnerTrainer(build_model(model_config("tiny", dim=32, n_layers=3, n_heads=2, ffn_dim=64)), ICFG)
    with pytest.raises(ConfigError, match="does not fit"):
        bigger.load_state_dict(trainer.state_dict())
    assert bigger.step == 0


def test_gradient_accumulation_matches_full_batch() -> None:
    full, accum = build_model(MCFG), build_model(MCFG)
    data = batches(4, n=2, b=8)
    InnerTrainer(full, ICFG).train_window(data)
    InnerTrainer(accum, ICFG, micro_batch_size=2).train_window(data)
    for (name, a), b in zip(full.named_parameters(), accum.parameters()):
        assert torch.allclose(a, b, atol=2e-5), name


def test_non_finite_gradient_skips_the_step() -> None:
    model = build_model(MCFG)
    trainer = InnerTrainer(model, ICFG)
    with torch.no_grad():
        model.embed.weight[5, 0] = float("nan")
    before = snapshot(model)
    data = [torch.full((2, 9), 5, dtype=torch.long)]
    stats = trainer.train_window(data)
    assert stats.skipped_steps == 1
    assert fingerprint(model) == fingerprint(before)
