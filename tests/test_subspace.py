"""Subspace compression: the basis, exact reconstruction, weight projection, drift handling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.pipeline.boundary import Boundary, BoundaryTransformer
from client.pipeline.subspace import (
    EMBEDDING,
    Subspace,
    basis_seed,
    constrained_names,
    localize,
    orthonormal_basis,
    out_of_span_ratio,
    project_parameters_,
    subspace_rank,
)
from client.trainer import load_params
from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.model import build_model, param_schema

MODEL = dict(dim=64, n_layers=4, n_heads=4, ffn_dim=96, max_seq_len=32)


def _spec(ratio: int = 8) -> RunSpec:
    return RunSpec.default().replace(model=MODEL, pipeline={"enabled": True, "compression_ratio": ratio})


def _tokens(b: int = 3, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_basis_is_orthonormal_and_deterministic() -> None:
    u = orthonormal_basis(64, 8, seed=5)
    assert u.dtype == torch.float32 and u.shape == (64, 8)
    assert torch.allclose(u.T @ u, torch.eye(8), atol=1e-6)
    torch.manual_seed(123)  # the caller's RNG state must not matter
    assert torch.equal(u, orthonormal_basis(64, 8, seed=5))
    assert not torch.equal(u, orthonormal_basis(64, 8, seed=6))
    a = Subspace.for_run("a" * 64, 64, 8)
    assert a.digest() == Subspace.for_run("a" * 64, 64, 8).digest() != Subspace.for_run("b" * 64, 64, 8).digest()
    assert basis_seed("a" * 64) != basis_seed("b" * 64)


def test_rank_and_config_validation() -> None:
    assert subspace_rank(256, 8) == 32 and subspace_rank(256, 1) == 256 and subspace_rank(64, 128) == 1
    with pytest.raises(ConfigError):
        subspace_rank(64, 0)
    with pytest.raises(ConfigError):
        orthonormal_basis(8, 9, seed=0)
    assert RunSpec.default().pipeline.enabled is False and RunSpec.default().pipeline.selective is True
    with pytest.raises(ConfigError):
        RunSpec.default().replace(pipeline={"compression_ratio": 0})
    with pytest.raises(ConfigError):
        RunSpec.from_dict({"pipeline": {"ratio": 4}})  # unknown key
    assert RunSpec.loads(_spec().to_toml()) == _spec()


@settings(max_examples=25, deadline=None)
@given(dim=st.integers(4, 96), ratio=st.integers(1, 16), seed=st.integers(0, 2**31))
def test_in_subspace_activations_reconstruct_exactly(dim: int, ratio: int, seed: int) -> None:
    sub = Subspace(orthonormal_basis(dim, subspace_rank(dim, ratio), seed))
    gen = torch.Generator().manual_seed(seed)
    fixed = torch.randn(5, 7, dim, generator=gen)
    coeffs = torch.randn(5, 7, sub.rank, generator=gen)
    h = coeffs @ sub.basis.T + fixed  # in span(U) + the locally rebuilt part
    rebuilt = sub.decompress(sub.compress(h, fixed), fixed)
    # Exact up to fp32 rounding of two matmuls; the same in float64 is at 1e-15.
    assert (rebuilt - h).norm() <= 1e-5 * h.norm()
    sub64 = Subspace(sub.basis.double())
    h64 = h.double()
    assert (sub64.decompress(sub64.compress(h64, fixed.double()), fixed.double()) - h64).norm() <= 1e-6 * h64.norm()


def test_out_of_subspace_error_is_measured() -> None:
    sub = Subspace(orthonormal_basis(256, 32, seed=1))
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    rebuilt = sub.decompress(sub.compress(x, torch.zeros_like(x)), torch.zeros_like(x))
    err = float((rebuilt - x).norm() / x.norm())
    # A random vector keeps k/d of its energy: relative error √(1 − k/d) = 0.935.
    assert abs(err - math.sqrt(1 - 32 / 256)) < 0.02
    assert abs(out_of_span_ratio(x, sub) - err) < 1e-4
    assert out_of_span_ratio(sub.project(x), sub) < 1e-5


def test_constrained_names_are_the_residual_writers_before_the_last_boundary() -> None:
    cfg = _spec().model
    schema = param_schema(cfg)
    names = constrained_names(cfg.n_layers, last_boundary=2)
    assert set(names) <= set(schema)
    assert names == [
        EMBEDDING,
        "blocks.0.attn.wo.weight",
        "blocks.0.mlp.w_down.weight",
        "blocks.1.attn.wo.weight",
        "blocks.1.mlp.w_down.weight",
    ]
    assert constrained_names(cfg.n_layers, 0) == []
    with pytest.raises(ConfigError):
        constrained_names(cfg.n_layers, 5)


def test_weight_projection_keeps_residual_writes_in_span() -> None:
    cfg = _spec().model
    model = build_model(cfg)
    sub = Subspace.for_run("x" * 64, cfg.dim, 8)
    params = dict(model.named_parameters())
    cos, sin = model.rope(16)
    x = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(3))
    block = model.blocks[0]
    with torch.no_grad():
        before = out_of_span_ratio(block(x, cos, sin) - x, sub)
        project_parameters_(params, sub, constrained_names(cfg.n_layers, 2))
        attn_write = block.attn(block.attn_norm(x), cos, sin)
        mlp_write = block.mlp(block.mlp_norm(x + attn_write))
        emb = model.embed(_tokens())
    assert before > 0.9  # unconstrained writes are mostly outside a 1/8 subspace
    assert out_of_span_ratio(attn_write, sub) < 1e-5
    assert out_of_span_ratio(mlp_write, sub) < 1e-5
    assert out_of_span_ratio(emb, sub) < 1e-5
    # Blocks after the last boundary are left free.
    assert out_of_span_ratio(params["blocks.3.attn.wo.weight"].T, sub) > 0.9


def _drifted_theta(cfg, seed: int = 4) -> dict[str, torch.Tensor]:
    """θ as full replicas leave it: constrained weights with large out-of-span parts."""
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def test_embedding_move_leaves_the_model_function_unchanged() -> None:
    cfg = _spec().model
    theta = _drifted_theta(cfg)
    sub = Subspace.for_run("y" * 64, cfg.dim, 8)
    reference = build_model(cfg)
    load_params(reference, theta)
    local, fixed = localize(theta, sub, [EMBEDDING])  # move only the embedding's drift
    assert fixed is not None and out_of_span_ratio(local[EMBEDDING], sub) < 1e-5
    moved = BoundaryTransformer.wrap(reference, [], Boundary(None), fixed)
    load_params(moved, local)
    tokens = _tokens()
    with torch.no_grad():
        diff = float((moved(tokens) - reference(tokens)).abs().max())
    assert diff < 1e-5, diff
    assert torch.equal(local["blocks.0.attn.wo.weight"], theta["blocks.0.attn.wo.weight"])


def test_after_localize_compression_is_lossless() -> None:
    """Re-projected blocks + moved embedding: the compressed pipeline computes what the unsplit
    model with the same block weights computes (nothing is lost at the boundaries)."""
    spec = _spec(8)
    cfg = spec.model
    theta = _drifted_theta(cfg)
    sub = Subspace.for_run(spec.hash(), cfg.dim, 8)
    names = constrained_names(cfg.n_layers, 2)
    local, fixed = localize(theta, sub, names)
    uncompressed = build_model(cfg)
    load_params(uncompressed, {**local, EMBEDDING: theta[EMBEDDING]})  # global embedding, projected blocks
    compressed = BoundaryTransformer.wrap(uncompressed, [1, 2], Boundary(sub), fixed)
    load_params(compressed, local)
    naive = BoundaryTransformer.wrap(uncompressed, [1, 2], Boundary(sub), None)
    load_params(naive, theta)  # no drift handling at all
    tokens = _tokens()
    with torch.no_grad():
        ref = uncompressed(tokens)
        lossless = float((compressed(tokens) - ref).abs().max())
        lossy = float((naive(tokens) - ref).abs().max())
    assert lossless < 1e-4, lossless
    assert lossy > 100 * lossless  # without the drift handling the boundaries do lose information
