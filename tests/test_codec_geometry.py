"""Chunk geometry: tile sizes, k scaling and the mapping back to flat indices."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from protocol.codec.chunking import chunk_k, geometry, largest_divisor_at_most
from protocol.config import CodecConfig

CFG = CodecConfig()


@pytest.mark.parametrize(
    "shape,tile,n_chunks,k",
    [
        ((512, 512), (64, 64), 64, 64),
        ((1376, 512), (43, 64), 32 * 8, 43),  # 1376 = 32 * 43: largest divisor <= 64 is 43
        ((512, 1376), (64, 43), 8 * 32, 43),
        ((96, 100), (48, 50), 4, 38),  # 2400 values: round(64 * 2400 / 4096) = 37.5 -> 38
        ((256, 7), (64, 7), 4, 7),
    ],
)
def test_2d_tiles(shape: tuple[int, int], tile: tuple[int, int], n_chunks: int, k: int) -> None:
    g = geometry(shape, CFG)
    assert (g.tile_r, g.tile_c, g.n_chunks, g.k_full, g.k_last) == (*tile, n_chunks, k, k)


def test_1d_chunks_are_contiguous_with_a_short_last_chunk() -> None:
    g = geometry((10000,), CFG)
    assert (g.n_chunks, g.chunk_len, g.last_size) == (3, 4096, 10000 - 8192)
    assert (g.k_full, g.k_last) == (64, chunk_k(10000 - 8192, 64))
    assert geometry((512,), CFG).k_full == 8
    assert geometry((1,), CFG).k_full == 1  # at least one per chunk


def test_higher_ranks_are_viewed_as_rows_by_last_dim() -> None:
    assert geometry((2, 64, 128), CFG) == replace(geometry((128, 128), CFG), shape=(2, 64, 128))


def test_prime_row_count_uses_contiguous_chunks() -> None:
    g = geometry((1009, 64), CFG)
    assert g.tile_r == 1 and g.chunk_len == 4096 and g.n_chunks == 16


def test_k_scaling_rounds_half_up_and_clamps() -> None:
    assert chunk_k(4096, 64) == 64 and chunk_k(2048, 64) == 32 and chunk_k(32, 64) == 1
    assert chunk_k(96, 64) == 2 and chunk_k(10, 4096) == 10
    assert largest_divisor_at_most(1376, 64) == 43 and largest_divisor_at_most(7, 64) == 7


@pytest.mark.parametrize("shape", [(128, 192), (96, 100), (10000,), (3, 5, 7), (1009, 64), (5,)])
def test_flat_index_inverts_to_chunks(shape: tuple[int, ...]) -> None:
    g = geometry(shape, CFG)
    x = torch.arange(g.numel, dtype=torch.float32).reshape(shape)
    chunks = g.to_chunks(x)
    sizes = g.chunk_sizes()
    chunk = torch.repeat_interleave(torch.arange(g.n_chunks), sizes)
    local = torch.cat([torch.arange(int(s)) for s in sizes])
    flat = g.flat_index(chunk, local)
    assert torch.equal(x.reshape(-1)[flat], chunks[chunk, local])
    assert torch.equal(flat.sort().values, torch.arange(g.numel))


def test_tile_contents_are_row_major_blocks() -> None:
    x = torch.arange(128 * 192, dtype=torch.float32).reshape(128, 192)
    chunks = geometry(x.shape, CFG).to_chunks(x)
    assert torch.equal(chunks[1], x[0:64, 64:128].reshape(-1))
    assert torch.equal(chunks[3], x[64:128, 0:64].reshape(-1))
