"""Error feedback: the state a peer carries between windows, and the one function that uses it.

SparseLoCo replaces outer momentum by an error buffer per tensor::

    e ← β·e + Δ            # decay what was not sent yet, add this window's pseudo-gradient
    Δ̂ = Q(TopK(e))         # what is sent (codec.encode)
    e ← e − decode(Δ̂)      # keep everything that was not sent, quantization error included

so ``e_new + decode(Δ̂) == β·e_old + Δ`` up to float rounding. Buffers are float32 whatever the
dtype of Δ, live on Δ's device, and are checkpointed with :meth:`FeedbackState.save` (safetensors)
because losing them on restart throws away every delayed update (a production failure mode).

    state = FeedbackState.load(path) if path.exists() else FeedbackState()
    encoded = compress_step(state, delta, beta=spec.outer.beta, cfg=spec.codec)
    state.save(path)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from protocol.codec import Encoded, decode, encode
from protocol.config import CodecConfig
from protocol.errors import ConfigError


@dataclass
class FeedbackState:
    """Error-feedback buffers by tensor name (float32). Missing names start at zero."""

    buffers: dict[str, Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Tensor]:
        return {name: buf.detach().cpu().contiguous() for name, buf in self.buffers.items()}

    def load_state_dict(self, state: dict[str, Tensor], device: torch.device | str | None = None) -> None:
        for name, buf in state.items():
            if not buf.is_floating_point():
                raise ConfigError(f"error-feedback buffer {name!r} is not floating point")
        self.buffers = {n: b.to(device=device, dtype=torch.float32) for n, b in state.items()}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffers atomically as safetensors (a crash never leaves half a file)."""
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        save_file(self.state_dict(), str(tmp), metadata={"kind": "sparseloco-error-feedback"})
        os.replace(tmp, target)

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: torch.device | str | None = None) -> FeedbackState:
        state = cls()
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as err:
            raise ConfigError(f"cannot read error-feedback state {path}: {err}") from err
        state.load_state_dict(tensors, device)
        return state


def compress_step(
    state: FeedbackState, delta: dict[str, Tensor], beta: float, cfg: CodecConfig
) -> dict[str, Encoded]:
    """``e ← β·e + Δ; Δ̂ = Q(TopK(e)); e ← e − decode(Δ̂)`` for every tensor of ``delta``.

    All-or-nothing: if any tensor fails to encode (NaN/Inf raise ``NonFiniteValues``) the state is
    left unchanged. Buffers are replaced by new tensors, never modified in place, so a caller that
    keeps ``dict(state.buffers)`` can roll back when the contribution is not sent. Returns the
    encoded tensors by name, in the order of ``delta``.
    """
    new: dict[str, Tensor] = {}
    out: dict[str, Encoded] = {}
    for name, d in delta.items():
        old = state.buffers.get(name)
        if old is not None and old.shape != d.shape:
            raise ConfigError(f"error-feedback buffer {name!r} has shape {tuple(old.shape)}, delta {tuple(d.shape)}")
        d32 = d.detach().to(torch.float32)
        acc = d32.clone() if old is None else torch.add(d32, old.to(d32.device), alpha=beta)
        enc = encode(acc, cfg)
        new[name] = acc.sub_(decode(enc))
        out[name] = enc
    state.buffers.update(new)
    return out
