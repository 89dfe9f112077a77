"""Properties of encode/decode/pack/unpack/to_sparse (hypothesis) and their edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import Encoded, decode, encode, pack, to_sparse, unpack
from protocol.codec.chunking import geometry
from protocol.codec.quantizer import level_table
from protocol.config import CodecConfig
from protocol.errors import NonFiniteValues

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

configs = st.builds(
    CodecConfig,
    block=st.sampled_from([4, 8, 64]),
    chunk_1d=st.sampled_from([16, 64, 4096]),
    k=st.sampled_from([1, 64, 300, 4096]),
    index_coding=st.sampled_from(["rice", "packed12"]),
)
shapes = st.one_of(
    st.tuples(st.integers(0, 300)),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.integers(1, 5), st.integers(1, 9), st.integers(1, 17)),
    st.just(()),
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Heavy-tailed, tied (small integers), constant, zero or tiny values in several dtypes."""
    shape = draw(shapes)
    kind = draw(st.sampled_from(["t", "ties", "const", "zeros", "tiny", "huge"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    n = int(np.prod(shape)) if shape else 1
    if kind == "t":
        x = torch.randn(n, generator=gen) / torch.rand(n, generator=gen).clamp_min(0.05)
    elif kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif kind == "const":
        x = torch.full((n,), draw(st.sampled_from([1.0, -2.5, 1e-3])))
    elif kind == "zeros":
        x = torch.zeros(n)
    elif kind == "tiny":
        x = torch.randn(n, generator=gen) * 1e-30
    else:
        x = torch.randn(n, generator=gen) * 1e30
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    if dtype != torch.float32 and kind == "huge":
        dtype = torch.float32  # 1e30 does not fit fp16 / changes little for bf16
    return x.reshape(shape).to(dtype)


def kept_reference(x: torch.Tensor, cfg: CodecConfig) -> list[np.ndarray]:
    """Per chunk: positions of the k largest magnitudes, lower position first among equals."""
    g = geometry(x.shape, cfg)
    chunks = g.to_chunks(x.float()).numpy()
    sizes, ks = g.chunk_sizes().numpy(), g.chunk_ks().numpy()
    out = []
    for row, size, k in zip(chunks, sizes, ks):
        mag = np.abs(row[:size])
        order = np.lexsort((np.arange(size), -mag))  # by -|x|, then position
        out.append(np.sort(order[:k]))
    return out


def split_chunks(e: Encoded) -> list[np.ndarray]:
    ks = e.geometry.chunk_ks().numpy()
    return np.split(e.indices.numpy(), np.cumsum(ks)[:-1]) if ks.size else []


@SETTINGS
@given(x=tensors(), cfg=configs)
def test_topk_keeps_largest_with_lower_position_ties(x: torch.Tensor, cfg: CodecConfig) -> None:
    e = encode(x, cfg)
    g = geometry(x.shape, cfg)
    assert e.nnz == g.nnz
    for got, want in zip(split_chunks(e), kept_reference(x, cfg)):
        assert np.array_equal(got, want)


@SETTINGS
@given(x=tensors(), cfg=configs)
def test_decode_has_at_most_k_nonzeros_per_chunk_and_is_finite(x: torch.Tensor, cfg: CodecConfig) -> None:
    e = encode(x, cfg)
    dense = decode(e)
    assert dense.shape == x.shape and dense.dtype == torch.float32
    assert torch.isfinite(dense).all()
    g = geometry(x.shape, cfg)
    nonzero_per_chunk = (g.to_chunks(dense) != 0).sum(1)
    assert (nonzero_per_chunk <= g.chunk_ks()).all()


@SETTINGS
@given(x=tensors(), cfg=configs)
def test_pack_unpack_roundtrip_is_bit_exact(x: torch.Tensor, cfg: CodecConfig) -> None:
    e = encode(x, cfg)
    blob = pack(e)
    back = unpack(blob, tuple(x.shape), cfg)
    assert pack(back) == blob
    assert torch.equal(back.indices, e.indices.cpu())
    assert torch.equal(decode(back), decode(e))
    flat, vals = to_sparse(back)
    assert torch.equal(decode(back).reshape(-1)[flat], vals)


@SETTINGS
@given(x=tensors(), cfg=configs)
def test_to_sparse_is_sorted_and_matches_the_original_positions(x: torch.Tensor, cfg: CodecConfig) -> None:
    e = encode(x, cfg)
    flat, vals = to_sparse(e)
    assert flat.dtype == torch.int64 and vals.dtype == torch.float32
    assert (flat.diff() > 0).all()
    original = x.float().reshape(-1)[flat]
    # The sign survives quantization wherever the kept value is clearly non-zero.
    clear = original.abs() > original.abs().max() * 1e-3 if original.numel() else original.bool()
    assert (torch.sign(vals[clear]) == torch.sign(original[clear])).all()


def test_decoded_values_follow_the_value_code() -> None:
    x = torch.randn(128, 192, generator=torch.Generator().manual_seed(1))
    e = encode(x, CodecConfig())
    vals = e.values()
    levels = level_table(e.base)[e.scale_codes.long()][e.chunk_ids()]
    # (nnz, 2): every magnitude is exactly one of its chunk's two levels
    assert ((vals.abs() == levels[:, 0]) | (vals.abs() == levels[:, 1])).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_input_is_rejected(bad: float, dtype: torch.dtype) -> None:
    x = torch.randn(64, 64).to(dtype)
    x[3, 5] = bad
    with pytest.raises(NonFiniteValues, match="NaN or Inf"):
        encode(x, CodecConfig())


def test_integer_input_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        encode(torch.ones(4, 4, dtype=torch.int64), CodecConfig())


@pytest.mark.parametrize("shape", [(0,), (0, 7), (3, 0, 2)])
def test_empty_tensors_roundtrip(shape: tuple[int, ...]) -> None:
    cfg = CodecConfig()
    e = encode(torch.zeros(shape), cfg)
    assert e.nnz == 0
    assert decode(unpack(pack(e), shape, cfg)).shape == shape


def test_all_zero_chunk_decodes_to_zero_and_stays_finite() -> None:
    e = encode(torch.zeros(256, 64), CodecConfig())
    assert decode(e).abs().sum() == 0
    assert e.base == 0.0


def test_constant_tensor_keeps_first_positions_and_decodes_exactly() -> None:
    e = encode(torch.full((64, 64), -0.75), CodecConfig())
    assert torch.equal(e.indices, torch.arange(64))
    assert (e.values() == -0.75).all()


def test_kept_set_is_the_same_on_repeated_calls() -> None:
    x = torch.randint(-2, 3, (512, 384)).float()
    a, b = encode(x, CodecConfig()), encode(x.clone(), CodecConfig())
    assert pack(a) == pack(b)


def test_2bit_error_is_small_on_gaussian_tiles() -> None:
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    flat, vals = to_sparse(encode(x, CodecConfig()))
    kept = x.reshape(-1)[flat]
    assert float((vals - kept).norm() / kept.norm()) < 0.12
