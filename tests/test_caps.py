"""Read caps follow the model size, the codec and the swarm size, and stay above honest objects."""

from __future__ import annotations

import math

import pytest
import torch

from client.peer.sync import Sync
from protocol.aggregate import aggregate, sparse_of
from protocol.broadcast import publishable
from protocol.caps import aggregate_bound, codec_payload_bound, contribution_bound, object_caps
from protocol.codec import Encoded, encode, pack
from protocol.codec.chunking import geometry
from protocol.config import CodecConfig, RunSpec
from protocol.errors import ConfigError
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import param_schema
from protocol.store import open_store
from protocol.wire import GENESIS, Aggregate, Contribution, ManifestEntry, encode_aggregate, encode_contribution

KEY = Identity.from_seed(b"c" * 32)
SMALL_MODEL = {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "vocab_size": 256}


def spec_of(**sections: dict[str, object]) -> RunSpec:
    return RunSpec.from_dict({"model": SMALL_MODEL, **sections})


def from_chunks(chunks: torch.Tensor, shape: tuple[int, ...], cfg: CodecConfig) -> torch.Tensor:
    """The tensor of ``shape`` whose chunks (``Geometry.to_chunks``) are ``chunks``."""
    g = geometry(shape, cfg)
    if g.tile_r > 1:
        tiles = chunks.view(g.rows // g.tile_r, g.cols // g.tile_c, g.tile_r, g.tile_c).permute(0, 2, 1, 3)
        return tiles.reshape(shape)
    return chunks.reshape(-1)[: g.numel].reshape(shape)


def clustered(shape: tuple[int, ...], cfg: CodecConfig) -> Encoded:
    """A Top-k that picks each chunk's first k − 1 positions and its last one: the longest index code."""
    g = geometry(shape, cfg)
    x = torch.zeros(g.n_chunks, g.chunk_len)
    x[:, : g.k_full - 1] = 1.0
    x[:, g.chunk_len - 1] = 1.0
    return encode(from_chunks(x, shape, cfg), cfg)


@pytest.mark.parametrize(
    "cfg", [CodecConfig(), CodecConfig(k=8), CodecConfig(k=512), CodecConfig(index_coding="packed12")]
)
@pytest.mark.parametrize("shape", [(256, 384), (1000,), (97, 64), (5,), (3, 5, 7)])
def test_codec_payload_bound_holds_for_random_and_clustered_selections(
    cfg: CodecConfig, shape: tuple[int, ...]
) -> None:
    bound = codec_payload_bound(shape, cfg)
    random_size = len(pack(encode(torch.randn(shape), cfg)))
    assert len(pack(clustered(shape, cfg))) <= bound and random_size <= bound
    if math.prod(shape) >= 4096 and cfg.index_coding == "rice":
        assert bound < 1.4 * random_size  # a bound, not a guess: within a few bits per value


def test_contribution_cap_is_two_to_four_times_an_honest_full_contribution() -> None:
    spec = spec_of()
    schema = param_schema(spec.model)
    widest = spec.codec_at(0)  # window 0: the largest k of the Top-k warm-up
    tensors = {n: encode(torch.randn(s), widest) for n, s in schema.items()}
    blob = encode_contribution(Contribution(spec.hash(), 0, GENESIS, widest, tensors, {"loss": 1.0}), KEY)
    cap = object_caps(spec).contribution
    assert cap == 2 * contribution_bound(schema, widest)
    assert 2 * len(blob) < cap


def one_b(**outer: object) -> RunSpec:
    """The 1b preset at k = 64 in every window (``warmup_k = 0``: the figures below are k = 64's;
    the caps of the warm-up's wider windows are tested apart)."""
    return RunSpec.from_dict({"model": {"preset": "1b"}, "outer": {"warmup_k": 0, **outer}})


def test_caps_follow_model_size_and_contributors() -> None:
    plain = one_b(recompress=False)  # always plain
    params = sum(math.prod(s) for s in param_schema(plain.model).values())
    caps = object_caps(plain)
    # An honest 1B contribution is ~0.153 bits/param (BENCHMARKS.md): 18 MB, capped at 2–4×.
    assert 2 * 0.153 * params / 8 < caps.contribution < 4 * 0.153 * params / 8
    # 64 contributors of 1/64 each can cover every element: bfloat16 + one index bit each.
    assert caps.aggregate > 2.125 * params > 512 * 2**20
    few = plain.replace(validator={"max_contributors": 4})
    assert object_caps(few).aggregate < caps.aggregate / 3
    # By default Δ̄ of outer.recompress_from = 8 or more contributions is re-compressed, so the
    # largest aggregate is the plain one of 7 (about 0.34 bytes per parameter at k = 64).
    default = one_b()
    assert object_caps(default).aggregate < caps.aggregate / 4
    recompressed = one_b(recompress=True, recompress_from=1, recompress_k=64)
    assert object_caps(recompressed).aggregate < caps.contribution * 1.1  # contribution-sized
    bigger = RunSpec.from_dict({"model": {"preset": "1b", "n_layers": 64}, "outer": {"warmup_k": 0}})
    assert object_caps(bigger).contribution > 3 * caps.contribution


def test_overrides_win_and_negative_caps_are_refused() -> None:
    spec = spec_of(validator={"max_contribution_bytes": 12345, "max_aggregate_bytes": 678})
    assert object_caps(spec).contribution == 12345 and object_caps(spec).aggregate == 678
    assert object_caps(spec_of()).contribution != 12345
    with pytest.raises(ConfigError, match="max_aggregate_bytes"):
        spec_of(validator={"max_aggregate_bytes": -1})


@pytest.mark.parametrize("recompress", [False, True])
def test_the_largest_honest_aggregate_fits_its_cap(recompress: bool) -> None:
    """max_contributors contributions that together select every element (the worst case)."""
    n = 4
    spec = spec_of(
        codec={"k": 1024},
        validator={"max_contributors": n},
        outer={"recompress": recompress, "recompress_from": 1, "recompress_k": 1024},
    )
    schema = param_schema(spec.model)
    contribs = []
    for j in range(n):  # contributor j selects the positions ≡ j (mod n) of every chunk
        x = {}
        for name, shape in schema.items():
            g = geometry(shape, spec.codec)
            chunks = (torch.arange(g.chunk_len) % n == j).float().expand(g.n_chunks, -1)
            x[name] = from_chunks(chunks.contiguous(), shape, spec.codec)
        contribs.append(sparse_of({name: encode(t, spec.codec) for name, t in x.items()}))
    delta = aggregate(contribs)
    params = sum(math.prod(s) for s in schema.values())
    covered = sum(len(i) for i, _ in delta.values()) / params
    tensors, _ = publishable(delta, schema, spec.outer, spec.codec, FeedbackState(), contributors=n, window=0)
    manifest = tuple(ManifestEntry(Identity.from_seed(bytes([j]) * 32).peer_id, "0" * 64, 1.0) for j in range(n))
    blob = encode_aggregate(Aggregate(spec.hash(), 0, GENESIS, 1.0, "0" * 64, manifest, tensors, 1.0), KEY)
    assert len(blob) <= object_caps(spec).aggregate
    if not recompress:
        assert covered == 1.0 and len(blob) > (2 + 1 / 8) * params  # the bound's per-parameter part is reached
        assert aggregate_bound(schema, spec, n) < len(blob) + (1 << 18)  # the rest is headers


def test_peers_and_the_validator_read_aggregates_with_the_same_cap() -> None:
    spec = spec_of()
    store = open_store("memory://caps-sync")
    try:
        assert Sync(spec, store).max_aggregate_bytes == object_caps(spec).aggregate
    finally:
        store.close()


def test_caps_allow_the_largest_k_of_a_top_k_warm_up() -> None:
    plain = spec_of(codec={"k": 64}, outer={"warmup_k": 0})
    warm = spec_of(codec={"k": 64}, outer={"warmup_k": 512, "warmup_windows": 4})
    assert warm == spec_of()  # the default warm-up
    schema = param_schema(warm.model)
    assert object_caps(warm).contribution == 2 * contribution_bound(schema, warm.codec_at(0))
    assert object_caps(warm).contribution > object_caps(plain).contribution
    assert aggregate_bound(schema, warm, 2) > aggregate_bound(schema, plain, 2)  # union of two Top-k sets
    # The plain aggregate of 7 window-0 contributions at k = 512 covers up to 7/8 of the elements.
    params = sum(math.prod(s) for s in param_schema(one_b().model).values())
    default_1b = object_caps(RunSpec.from_dict({"model": {"preset": "1b"}})).aggregate
    assert default_1b > (7 / 8 * 2 + 1 / 8) * params > 4 * object_caps(one_b()).aggregate
    # An honest window-0 contribution (every tensor, the window's k) fits the cap.
    gen = torch.Generator().manual_seed(0)
    enc = {n: encode(torch.randn(s, generator=gen), warm.codec_at(0)) for n, s in schema.items()}
    blob = encode_contribution(Contribution(warm.hash(), 0, GENESIS, warm.codec_at(0), enc, {}), KEY)
    assert len(blob) <= object_caps(warm).contribution
