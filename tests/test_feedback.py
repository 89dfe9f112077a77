"""Error feedback: the invariant e_new + decode(Δ̂) == β·e_old + Δ, purity and giving Δ̂ back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import decode, pack
from protocol.config import CodecConfig
from protocol.errors import ConfigError, NonFiniteValues
from protocol.feedback import FeedbackBuffers, FeedbackState, compress_step

CFG = CodecConfig()


def deltas(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(128, 192, generator=g) * 1e-3).to(dtype),
        "norm": (torch.randn(300, generator=g) * 1e-4).to(dtype),
        "conv": (torch.randn(4, 8, 24, generator=g) * 1e-2).to(dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", [0.95, 1.0, 0.0])
def test_invariant_over_several_windows(dtype: torch.dtype, beta: float) -> None:
    state = FeedbackState()
    for window in range(4):
        delta = deltas(window, dtype)
        before = {n: b.clone() for n, b in state.buffers.items()}
        sent, state = compress_step(state, delta, beta, CFG)
        for name, d in delta.items():
            e_old = before.get(name, torch.zeros(d.shape))
            lhs = state.buffers[name] + decode(sent[name])
            rhs = beta * e_old + d.float()
            assert state.buffers[name].dtype == torch.float32
            assert torch.allclose(lhs, rhs, rtol=0, atol=1e-6 * float(rhs.abs().max()) + 1e-12)


def test_what_is_sent_is_removed_from_the_buffer() -> None:
    sent, state = compress_step(FeedbackState(), deltas(0), 0.95, CFG)
    for name, e in sent.items():
        flat, vals = e.indices, decode(e).reshape(-1)
        kept = vals != 0
        # Residual on kept entries is only the quantization error: much smaller than what was sent.
        residual = state.buffers[name].reshape(-1)[kept]
        assert residual.norm() < 0.5 * vals[kept].norm()
        assert flat.numel() == e.nnz


def test_unsent_mass_accumulates_until_it_is_sent() -> None:
    """A constant small Δ in one coordinate is eventually sent thanks to the buffer (β = 1)."""
    state = FeedbackState()
    delta = {"w": torch.zeros(64, 64)}
    delta["w"][0, :64] = 1.0  # 64 large entries fill the chunk's k = 64 every window
    delta["w"][5, 7] = 0.3
    sent_small = 0.0
    for _ in range(6):
        out, state = compress_step(state, delta, 1.0, CFG)
        sent_small += float(decode(out["w"])[5, 7])
    assert sent_small > 0.3


def test_non_finite_delta_leaves_state_untouched() -> None:
    _, state = compress_step(FeedbackState(), deltas(0), 0.95, CFG)
    snapshot = {n: b.clone() for n, b in state.buffers.items()}
    bad = deltas(1)
    bad["norm"][3] = float("nan")
    with pytest.raises(NonFiniteValues):
        compress_step(state, bad, 0.95, CFG)
    assert all(torch.equal(snapshot[n], state.buffers[n]) for n in snapshot)


def test_shape_change_is_a_config_error() -> None:
    _, state = compress_step(FeedbackState(), {"w": torch.randn(8, 8)}, 0.95, CFG)
    with pytest.raises(ConfigError, match="shape"):
        compress_step(state, {"w": torch.randn(8, 9)}, 0.95, CFG)


def test_state_dict_round_trip_continues_bit_identically() -> None:
    _, a = compress_step(FeedbackState(), deltas(0), 0.95, CFG)
    b = FeedbackState.from_state_dict(a.state_dict())
    assert set(b.buffers) == set(a.buffers)
    out_a, a = compress_step(a, deltas(1), 0.95, CFG)
    out_b, b = compress_step(b, deltas(1), 0.95, CFG)
    for name in out_a:
        assert torch.equal(decode(out_a[name]), decode(out_b[name]))
        assert torch.equal(a.buffers[name], b.buffers[name])
    with pytest.raises(ConfigError, match="floating point"):
        FeedbackState.from_state_dict({"w": torch.zeros(3, dtype=torch.int64)})


def test_compress_step_is_pure() -> None:
    """The given state, its mapping and its tensors are never changed; the result is a new state."""
    _, state = compress_step(FeedbackState(), deltas(0), 0.95, CFG)
    tensors = dict(state.buffers)
    copies = {n: b.clone() for n, b in tensors.items()}
    _, after = compress_step(state, deltas(1), 0.95, CFG)
    assert after is not state and dict(state.buffers) == tensors  # same tensor objects, same names
    assert all(torch.equal(tensors[n], copies[n]) for n in tensors)
    assert all(after.buffers[n] is not tensors[n] for n in tensors)
    with pytest.raises(TypeError):
        state.buffers["w"] = torch.zeros(1)  # type: ignore[index]


def test_names_outside_delta_are_kept() -> None:
    """A pipeline stage compresses only its slice; buffers of other names pass through unchanged."""
    _, state = compress_step(FeedbackState(), deltas(0), 0.95, CFG)
    _, after = compress_step(state, {"w": deltas(1)["w"]}, 0.95, CFG)
    assert after.buffers["norm"] is state.buffers["norm"] and not torch.equal(after.buffers["w"], state.buffers["w"])


def test_returned_gives_back_everything_that_was_not_sent() -> None:
    """e′ + decode(Δ̂) == β·e + Δ: a contribution that never left keeps all of the window's mass."""
    _, state = compress_step(FeedbackState(), deltas(0), 0.95, CFG)
    sent, after = compress_step(state, deltas(1), 0.95, CFG)
    back = after.returned(sent)
    for name, d in deltas(1).items():
        expected = 0.95 * state.buffers[name] + d
        assert torch.allclose(back.buffers[name], expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
    assert back.norm() > after.norm()
    with pytest.raises(ConfigError, match="missing"):
        FeedbackState().returned(sent)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    windows=st.integers(1, 4),
    beta=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    k=st.sampled_from([1, 8, 64]),
    shapes=st.lists(st.sampled_from([(7,), (4096,), (5000,), (64, 64), (65, 130), (3, 5)]), min_size=1, max_size=3),
)
def test_in_place_buffers_and_the_pure_step_are_bit_identical(
    seed: int, windows: int, beta: float, k: int, shapes: list[tuple[int, ...]]
) -> None:
    """The peer's in-place fold (FeedbackBuffers.compress) and compress_step send the same bytes and
    keep the same e, window after window, on random Δ (some windows skip a tensor)."""
    cfg = CodecConfig(k=k)
    gen = torch.Generator().manual_seed(seed)
    pure, in_place = FeedbackState(), FeedbackBuffers()
    for w in range(windows):
        delta = {
            f"t{i}": torch.randn(shape, generator=gen) * 10 ** float(torch.randint(-4, 2, (1,), generator=gen))
            for i, shape in enumerate(shapes)
            if w == 0 or torch.rand(1, generator=gen).item() > 0.2
        }
        sent, pure = compress_step(pure, delta, beta, cfg)
        folded = in_place.compress(((n, d.clone()) for n, d in delta.items()), beta, cfg)
        assert sent.keys() == folded.keys()
        for name in sent:
            assert pack(sent[name]) == pack(folded[name])
        assert pure.buffers.keys() == in_place.buffers.keys()
        for name, buf in pure.buffers.items():
            assert torch.equal(buf, in_place.buffers[name])
