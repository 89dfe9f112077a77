"""Error feedback: the invariant e_new + decode(Δ̂) == β·e_old + Δ, atomicity and checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol.codec import decode
from protocol.config import CodecConfig
from protocol.errors import ConfigError, NonFiniteValues
from protocol.feedback import FeedbackState, compress_step

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
        sent = compress_step(state, delta, beta, CFG)
        for name, d in delta.items():
            e_old = before.get(name, torch.zeros(d.shape))
            lhs = state.buffers[name] + decode(sent[name])
            rhs = beta * e_old + d.float()
            assert state.buffers[name].dtype == torch.float32
            assert torch.allclose(lhs, rhs, rtol=0, atol=1e-6 * float(rhs.abs().max()) + 1e-12)


def test_what_is_sent_is_removed_from_the_buffer() -> None:
    state = FeedbackState()
    sent = compress_step(state, deltas(0), 0.95, CFG)
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
        out = compress_step(state, delta, 1.0, CFG)
        sent_small += float(decode(out["w"])[5, 7])
    assert sent_small > 0.3


def test_non_finite_delta_leaves_state_untouched() -> None:
    state = FeedbackState()
    compress_step(state, deltas(0), 0.95, CFG)
    snapshot = {n: b.clone() for n, b in state.buffers.items()}
    bad = deltas(1)
    bad["norm"][3] = float("nan")
    with pytest.raises(NonFiniteValues):
        compress_step(state, bad, 0.95, CFG)
    assert all(torch.equal(snapshot[n], state.buffers[n]) for n in snapshot)


def test_shape_change_is_a_config_error() -> None:
    state = FeedbackState()
    compress_step(state, {"w": torch.randn(8, 8)}, 0.95, CFG)
    with pytest.raises(ConfigError, match="shape"):
        compress_step(state, {"w": torch.randn(8, 9)}, 0.95, CFG)


def test_save_load_roundtrip_continues_bit_identically(tmp_path: Path) -> None:
    a = FeedbackState()
    compress_step(a, deltas(0), 0.95, CFG)
    path = tmp_path / "feedback.safetensors"
    a.save(path)
    assert not (tmp_path / "feedback.safetensors.tmp").exists()
    b = FeedbackState.load(path)
    assert set(b.buffers) == set(a.buffers)
    out_a = compress_step(a, deltas(1), 0.95, CFG)
    out_b = compress_step(b, deltas(1), 0.95, CFG)
    for name in out_a:
        assert torch.equal(decode(out_a[name]), decode(out_b[name]))
        assert torch.equal(a.buffers[name], b.buffers[name])


def test_load_rejects_garbage_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(ConfigError, match="cannot read"):
        FeedbackState.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        FeedbackState.load(tmp_path / "missing.safetensors")


def test_old_buffers_are_never_modified_in_place() -> None:
    state = FeedbackState()
    compress_step(state, deltas(0), 0.95, CFG)
    previous = dict(state.buffers)
    copies = {n: b.clone() for n, b in previous.items()}
    compress_step(state, deltas(1), 0.95, CFG)
    assert all(torch.equal(previous[n], copies[n]) for n in previous)
    assert all(state.buffers[n] is not previous[n] for n in previous)
