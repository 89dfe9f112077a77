"""protocol/model: deterministic θ₀, fingerprint, schema, causal LM behaviour, layer slicing."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.config import model_config
from protocol.model import build_model, eval_loss, fingerprint, lm_loss, param_schema, parameters_of

CFG = model_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)


def test_fingerprint_equal_across_independent_builds() -> None:
    torch.manual_seed(123)  # the caller's RNG state must not matter
    a = build_model(CFG)
    torch.manual_seed(999)
    torch.rand(1000)
    b = build_model(CFG)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) == fingerprint(a.state_dict()) == fingerprint(parameters_of(b))
    assert len(fingerprint(a)) == 64


def test_fingerprint_changes_with_seed_and_with_one_value() -> None:
    a = build_model(CFG)
    assert fingerprint(build_model(model_config("tiny", **{**_fields(CFG), "init_seed": 1}))) != fingerprint(a)
    before = fingerprint(a)
    with torch.no_grad():
        a.blocks[1].mlp.w_down.weight.view(-1)[7] += 1e-7
    assert fingerprint(a) != before


def _fields(cfg: object) -> dict[str, object]:
    return {k: v for k, v in vars(cfg).items() if k != "preset"}


def test_param_schema_matches_built_model() -> None:
    model = build_model(CFG)
    assert param_schema(CFG) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert "head.output.weight" in param_schema(CFG)


def test_initial_loss_is_near_uniform_and_causal() -> None:
    model = build_model(CFG)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    assert abs(lm_loss(model, tokens).item() - math.log(256)) < 0.3
    logits = model(tokens[:, :16])
    changed = tokens[:, :16].clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)  # no peeking ahead
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_slices_compose_to_the_full_forward() -> None:
    model = build_model(CFG)
    tokens = torch.randint(0, 256, (2, 16))
    h = model.forward_slice(model.embed(tokens), 0, 1)
    h = model.forward_slice(h, 1, 2)
    assert torch.equal(model.logits(h), model(tokens))


def test_tied_embeddings_share_one_matrix() -> None:
    tied = model_config("tiny", **{**_fields(CFG), "tie_embeddings": True})
    model = build_model(tied)
    assert model.head.output is None and "head.output.weight" not in param_schema(tied)
    assert set(model.state_dict()) == set(param_schema(tied))
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)


def test_too_long_sequence_and_eval_without_batches_raise() -> None:
    model = build_model(CFG)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError):
        eval_loss(model, [])
