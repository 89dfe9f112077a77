"""Error feedback: the state a peer carries between windows, and the one function that uses it.

SparseLoCo replaces outer momentum by an error buffer per tensor::

    e ← β·e + Δ            # decay what was not sent yet, add this window's pseudo-gradient
    Δ̂ = Q(TopK(e))         # what is sent (codec.encode)
    e ← e − decode(Δ̂)      # keep everything that was not sent, quantization error included

so ``e_new + decode(Δ̂) == β·e_old + Δ`` up to float rounding. Buffers are float32 whatever the
dtype of Δ and live on Δ's device.

A :class:`FeedbackState` is a value: :func:`compress_step` returns the next state instead of
changing the one it is given, so a caller decides when the new ``e`` takes effect (the peer adopts
it in the same commit that stages the contribution it belongs to, see :mod:`client.peer`)::

    encoded, after = compress_step(state, delta, beta=spec.outer.beta, cfg=spec.codec)
    ...                                      # sign and stage ``encoded``; only then:
    state = after
    state = after.returned(encoded)          # the bytes never reached the store: e keeps Δ̂

Persisting the buffers is the peer's business (its state directory, :mod:`client.state`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from protocol.codec import Encoded, decode, encode
from protocol.config import CodecConfig
from protocol.errors import ConfigError


@dataclass(frozen=True)
class FeedbackState:
    """Error-feedback buffers by tensor name (float32), read-only. Missing names start at zero."""

    buffers: Mapping[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A private read-only copy: a caller's dict changing later cannot change this state.
        object.__setattr__(self, "buffers", MappingProxyType(dict(self.buffers)))

    def state_dict(self) -> dict[str, Tensor]:
        """The buffers on the CPU, contiguous (what a checkpoint stores)."""
        return {name: buf.detach().cpu().contiguous() for name, buf in self.buffers.items()}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], device: torch.device | str | None = None) -> FeedbackState:
        """The state :meth:`state_dict` described; ConfigError for a buffer that is not floating point."""
        for name, buf in state.items():
            if not buf.is_floating_point():
                raise ConfigError(f"error-feedback buffer {name!r} is not floating point")
        return cls({n: b.to(device=device, dtype=torch.float32) for n, b in state.items()})

    def norm(self) -> float:
        """‖e‖₂ over every buffer (float64 accumulation), for progress reports."""
        return math.sqrt(sum(float(b.double().pow(2).sum()) for b in self.buffers.values()))

    def returned(self, sent: Mapping[str, Encoded]) -> FeedbackState:
        """``e + decode(Δ̂)``: the state had ``sent`` subtracted, but it never reached anyone.

        Applied to the state :func:`compress_step` returned with ``sent``, the result is
        ``β·e_old + Δ`` up to float rounding: nothing of the window is lost, as if k had been 0.
        """
        new = dict(self.buffers)
        for name, enc in sent.items():
            buf = new.get(name)
            if buf is None:
                raise ConfigError(f"error-feedback buffer {name!r} is missing: it was never compressed")
            new[name] = buf + decode(enc).to(buf.device, torch.float32)
        return FeedbackState(new)


def compress_step(
    state: FeedbackState, delta: Mapping[str, Tensor], beta: float, cfg: CodecConfig
) -> tuple[dict[str, Encoded], FeedbackState]:
    """``e ← β·e + Δ; Δ̂ = Q(TopK(e)); e ← e − decode(Δ̂)`` for every tensor of ``delta``.

    Pure: returns ``(encoded, new_state)`` and leaves ``state`` (and its tensors) untouched, so a
    failure anywhere (NaN/Inf raise ``NonFiniteValues``) changes nothing. ``encoded`` holds the
    tensors by name, in the order of ``delta``; ``new_state`` keeps the buffers of names that are
    not in ``delta`` (a pipeline stage compresses only its own slice).
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
    return out, FeedbackState({**state.buffers, **new})
