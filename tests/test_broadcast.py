"""The published form of Δ̄: what the validator signs is what it and every peer apply.

Plain: bfloat16-rounded values. Re-compressed: Top-k + 2-bit codes of the validator's
error-feedback buffer, which keeps exactly what was not sent.
"""

from __future__ import annotations

import torch

from protocol.aggregate import SparseDict, aggregate, apply_outer
from protocol.broadcast import applied, keeps_feedback, plain, publishable, recompress, recompress_codec, recompresses
from protocol.chain import delta_of
from protocol.codec import Encoded, decode, encode, to_sparse
from protocol.config import CodecConfig, OuterConfig
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.wire import GENESIS, Aggregate, SparseDelta, decode_aggregate, encode_aggregate

SHAPES = {"a.weight": (64, 128), "b.weight": (300,), "c.weight": (32, 32)}
KEY = Identity.from_seed(b"k" * 32)
CODEC = CodecConfig()
STEADY = OuterConfig().warmup_windows  # the first window at codec.k, after the Top-k warm-up


def contributions(n: int, seed: int = 0) -> list[SparseDict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        enc = {
            name: encode(torch.randn(shape, generator=g), CODEC) for name, shape in SHAPES.items() if name != "c.weight"
        }
        out.append({name: to_sparse(e) for name, e in enc.items()})
    return out


def dense(delta: SparseDict, name: str) -> torch.Tensor:
    out = torch.zeros(SHAPES[name]).view(-1)
    if name in delta:
        out[delta[name][0]] = delta[name][1]
    return out.view(SHAPES[name])


def through_the_wire(tensors: dict) -> SparseDict:  # type: ignore[type-arg]
    """What a peer applies: the signed aggregate's bytes, decoded."""
    blob = encode_aggregate(Aggregate("0" * 64, 0, GENESIS, 1.0, "", (), tensors, 1.0), KEY)
    return delta_of(decode_aggregate(blob, run_hash=None, max_bytes=len(blob), allowed_signers=None).value)


def test_plain_rounds_values_and_peers_apply_exactly_that() -> None:
    delta = aggregate(contributions(3))
    tensors = plain(delta, SHAPES)
    assert all(isinstance(t, SparseDelta) for t in tensors.values())
    for name, t in tensors.items():
        assert torch.equal(t.indices, delta[name][0])
        assert torch.equal(t.values, delta[name][1].to(torch.bfloat16).float())
    assert through_the_wire(dict(tensors)).keys() == applied(dict(tensors)).keys()
    for name, (idx, vals) in through_the_wire(dict(tensors)).items():
        assert torch.equal(idx, applied(dict(tensors))[name][0]) and torch.equal(vals, applied(dict(tensors))[name][1])


def test_validator_and_peer_hold_the_same_theta_in_both_modes() -> None:
    delta = aggregate(contributions(4))
    for outer in (OuterConfig(), OuterConfig(recompress_from=1, recompress_k=16)):
        tensors, _ = publishable(delta, SHAPES, outer, CODEC, FeedbackState(), contributors=4, window=STEADY)
        validator = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in SHAPES.items()}
        peer = {n: p.clone() for n, p in validator.items()}
        apply_outer(validator, applied(tensors), 0.7)
        apply_outer(peer, through_the_wire(tensors), 0.7)
        assert fingerprint(validator) == fingerprint(peer)


def test_recompression_keeps_what_it_did_not_send() -> None:
    """e_new + decode(Δ̂) = β·e_old + Δ̄ on every tensor, also one Δ̄ did not touch this window."""
    beta, cfg = 0.9, CodecConfig(k=16)
    first = aggregate(contributions(3, seed=1))
    sent0, e1 = recompress(first, SHAPES, FeedbackState(), beta, cfg)
    second = {n: v for n, v in aggregate(contributions(3, seed=2)).items() if n != "b.weight"}
    sent1, e2 = recompress(second, SHAPES, e1, beta, cfg)
    assert set(sent1) == {"a.weight", "b.weight"}  # b's buffer still sends; c never had anything
    for name in sent1:
        want = beta * e1.buffers[name] + dense(second, name)
        torch.testing.assert_close(e2.buffers[name] + decode(sent1[name]), want, rtol=0, atol=1e-6)
        assert sent1[name].cfg == cfg
    assert int(sum(t.nnz for t in sent0.values())) < sum(len(i) for i, _ in first.values()) / 2


def test_publishable_leaves_the_buffer_alone_without_recompression() -> None:
    state = FeedbackState({"a.weight": torch.ones(SHAPES["a.weight"])})
    _, after = publishable(
        aggregate(contributions(2)), SHAPES, OuterConfig(recompress=False), CODEC, state, contributors=2, window=STEADY
    )
    assert after is state
    outer = OuterConfig(recompress=True, recompress_from=1, recompress_k=8)
    assert recompress_codec(outer, CODEC, STEADY) == CodecConfig(k=8)
    tensors, after = publishable(
        aggregate(contributions(2)), SHAPES, outer, CODEC, state, contributors=2, window=STEADY
    )
    assert after is not state and all(t.cfg == CodecConfig(k=8) for t in tensors.values())  # type: ignore[union-attr]


def test_without_decay_nothing_is_kept() -> None:
    outer = OuterConfig(recompress=True, recompress_from=1, recompress_k=8, recompress_beta=0.0)
    tensors, after = publishable(
        aggregate(contributions(2)), SHAPES, outer, CODEC, FeedbackState(), contributors=2, window=STEADY
    )
    assert tensors and not after.buffers and not keeps_feedback(outer)
    assert keeps_feedback(OuterConfig(recompress=True, recompress_beta=0.5)) and not keeps_feedback(OuterConfig())


def test_the_default_recompresses_from_recompress_from_contributions_on() -> None:
    """Below ``outer.recompress_from`` contributions Δ̄ is published plain (its union of Top-k sets
    is small), from there on re-compressed (a contribution-sized object, whatever the swarm)."""
    outer, state = OuterConfig(), FeedbackState()
    assert outer.recompress and outer.recompress_from == 8
    assert [recompresses(outer, n) for n in (1, 7, 8, 256)] == [False, False, True, True]
    assert not recompresses(OuterConfig(recompress=False), 256)
    delta = aggregate(contributions(8))
    few, _ = publishable(delta, SHAPES, outer, CODEC, state, contributors=7, window=STEADY)
    many, _ = publishable(delta, SHAPES, outer, CODEC, state, contributors=8, window=STEADY)
    assert all(isinstance(t, SparseDelta) for t in few.values())
    assert all(isinstance(t, Encoded) and t.cfg == recompress_codec(outer, CODEC, STEADY) for t in many.values())


def test_a_top_k_warm_up_widens_the_recompression_by_the_windows_k() -> None:
    """In a Top-k warm-up the validator keeps recompress_k times the window's k over codec.k, so
    the extra values the peers send are not cut back to the steady state; read caps allow the widest."""
    outer = OuterConfig(recompress_k=128, warmup_k=512, warmup_windows=4)
    codec = CodecConfig(k=64)
    assert [recompress_codec(outer, codec, w).k for w in range(6)] == [1024, 800, 576, 352, 128, 128]
    assert recompress_codec(outer, codec).k == 1024
    assert recompress_codec(OuterConfig(recompress_k=128, warmup_k=0), codec, 0).k == 128
    delta = aggregate(contributions(8))
    first, _ = publishable(delta, SHAPES, outer, codec, FeedbackState(), contributors=8, window=0)
    later, _ = publishable(delta, SHAPES, outer, codec, FeedbackState(), contributors=8, window=4)
    nnz = [sum(t.nnz for t in ts.values()) for ts in (first, later)]  # type: ignore[union-attr]
    assert nnz[0] > nnz[1]
