"""The automatic micro-batch: the activation estimate and the choice it feeds (client/memory.py)."""

from __future__ import annotations

import pytest
import torch

from client.memory import activation_bytes_per_sequence, auto_micro_batch, micro_batch_for
from protocol.config import DataConfig, ModelConfig
from protocol.model import build_model, lm_loss

SHAPES = [
    ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=2, ffn_dim=128, max_seq_len=64),
    ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=2, ffn_dim=344, max_seq_len=64),
    ModelConfig(vocab_size=2048, dim=64, n_layers=3, n_heads=2, ffn_dim=172, max_seq_len=64),
]


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward pass of one loss (parameters and
    their bf16 casts excluded: they do not grow with the batch), each storage counted once."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss(model, tokens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_the_estimate_is_the_documented_sum() -> None:
    cfg = SHAPES[0]
    per_token = 2 * (64 * 64 + 8 * 128) + 16 * 256 + 16 * 64
    assert activation_bytes_per_sequence(cfg, 32) == 32 * per_token


def test_the_estimate_is_linear_in_the_sequence_length() -> None:
    for cfg in SHAPES:
        assert activation_bytes_per_sequence(cfg, 64) == 2 * activation_bytes_per_sequence(cfg, 32)


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"d{c.dim}-v{c.vocab_size}")
def test_the_estimate_errs_high_but_not_by_much(cfg: ModelConfig) -> None:
    """What one more sequence makes autograd keep (bf16 autocast, measured as the difference
    between two batch sizes) is below the estimate, and at least a third of it."""
    torch.manual_seed(0)
    model = build_model(cfg)
    seq_len = 32
    small = saved_bytes(model, torch.randint(0, cfg.vocab_size, (4, seq_len + 1)))
    large = saved_bytes(model, torch.randint(0, cfg.vocab_size, (8, seq_len + 1)))
    measured = (large - small) / 4
    estimate = activation_bytes_per_sequence(cfg, seq_len)
    assert measured <= estimate <= 3 * measured


def test_micro_batch_for_fits_what_is_free_between_1_and_the_batch() -> None:
    assert micro_batch_for(10_000, per_sequence=1_000, reserved=2_000, batch_size=32) == 8
    assert micro_batch_for(10_000, per_sequence=1_000, reserved=0, batch_size=4) == 4
    assert micro_batch_for(1_000, per_sequence=1_000, reserved=5_000, batch_size=4) == 1  # never 0
    with pytest.raises(ValueError):
        micro_batch_for(1_000, per_sequence=0, reserved=0, batch_size=4)


def test_on_a_cpu_the_whole_batch_goes_at_once() -> None:
    assert auto_micro_batch(SHAPES[0], DataConfig(), torch.device("cpu")) == 0


def test_on_cuda_it_divides_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    cfg, data = SHAPES[1], DataConfig(seq_len=64, batch_size=64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 24 * gib))
    per_sequence = activation_bytes_per_sequence(cfg, 64)
    n = auto_micro_batch(cfg, data, torch.device("cuda"))
    assert 1 <= n <= 64 and n * per_sequence <= 2 * gib - 1 * gib  # the margin (≥ 1 GiB) stays free
