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

    encoded, after = compress_step(state, delta, beta=spec.outer.beta, cfg=spec.codec_at(window))
    ...                                      # sign and stage ``encoded``; only then:
    state = after
    state = after.returned(encoded)          # the bytes never reached the store: e keeps Δ̂

A peer holds e in place instead (:class:`FeedbackBuffers`): one float32 buffer per tensor and
never a second copy of it, because e is as large as θ. Its :meth:`FeedbackBuffers.compress` folds
a window's Δ into e tensor by tensor through the same step as :func:`compress_step` (the same
bytes and the same e), and takes Δ lazily, so that at most one Δ tensor exists at a time::

    e = FeedbackBuffers()
    encoded = e.compress(((n, delta_of(n)) for n in names), beta=spec.outer.beta, cfg=spec.codec_at(window))
    e.give_back(encoded)                     # the bytes never reached the store: e keeps Δ̂

Persisting the buffers is the peer's business (its state directory, :mod:`client.state`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
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


class FeedbackBuffers:
    """e held in place, by tensor name (float32): what a peer carries between windows.

    Unlike :class:`FeedbackState` it changes: only through :meth:`compress` (a window's Δ folded
    in), :meth:`give_back` (bytes that never reached anyone) and :meth:`adopt`. Missing names
    start at zero. :meth:`view` is a read-only :class:`FeedbackState` sharing the tensors.
    """

    def __init__(self, buffers: Mapping[str, Tensor] | None = None) -> None:
        self.buffers: dict[str, Tensor] = dict(buffers or {})

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> FeedbackBuffers:
        """The buffers :meth:`state_dict` described; ConfigError for one that is not floating point."""
        return cls(FeedbackState.from_state_dict(state).buffers)

    def view(self) -> FeedbackState:
        """The current e as a :class:`FeedbackState` (no copy: valid until e next changes)."""
        return FeedbackState(self.buffers)

    def state_dict(self) -> dict[str, Tensor]:
        """The buffers on the CPU, contiguous (no copy for the CPU buffers a peer holds)."""
        return self.view().state_dict()

    def norm(self) -> float:
        return self.view().norm()

    def compress(self, deltas: Iterable[tuple[str, Tensor]], beta: float, cfg: CodecConfig) -> dict[str, Encoded]:
        """``e ← β·e + Δ; Δ̂ = Q(TopK(e)); e ← e − decode(Δ̂)`` in place, one tensor at a time.

        ``deltas`` yields (name, Δ) pairs; each Δ must be a float32 tensor the caller gives away
        (it is the scratch space of the step, so no other tensor of its size is allocated). The
        result and e equal :func:`compress_step`'s bit for bit. A tensor that is not finite raises
        ``NonFiniteValues`` with every earlier tensor already folded in: check Δ first.
        """
        out: dict[str, Encoded] = {}
        for name, d in deltas:
            if d.dtype != torch.float32:
                raise ConfigError(f"delta {name!r} must be float32 (it is folded into e in place)")
            old = self.buffers.get(name)
            enc, acc = _step(name, d, old, beta, cfg, owned=True)
            if old is None or old.device != acc.device:
                self.buffers[name] = acc
            else:
                old.copy_(acc)
            out[name] = enc
        return out

    def give_back(self, sent: Mapping[str, Encoded]) -> None:
        """``e += decode(Δ̂)`` in place: ``sent`` was subtracted, but it never reached anyone
        (see :meth:`FeedbackState.returned`)."""
        for name in sent:
            if name not in self.buffers:
                raise ConfigError(f"error-feedback buffer {name!r} is missing: it was never compressed")
        for name, enc in sent.items():
            buf = self.buffers[name]
            buf.add_(decode(enc).to(buf.device, torch.float32))

    def adopt(self, state: FeedbackState) -> None:
        """Take over ``state``'s buffers (a trainer that computed e′ as a value, e.g. a pipeline stage)."""
        self.buffers.update(state.buffers)


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
        out[name], new[name] = _step(name, d, state.buffers.get(name), beta, cfg, owned=False)
    return out, FeedbackState({**state.buffers, **new})


def _step(
    name: str, delta: Tensor, old: Tensor | None, beta: float, cfg: CodecConfig, *, owned: bool
) -> tuple[Encoded, Tensor]:
    """One tensor's step, shared by :func:`compress_step` and :meth:`FeedbackBuffers.compress`:
    ``acc = β·e + Δ; Δ̂ = Q(TopK(acc))``; returns ``(Δ̂, acc − decode(Δ̂))``. ``owned``: ``delta`` is
    float32 and the caller's to overwrite (the in-place fold allocates nothing of its size)."""
    if old is not None and old.shape != delta.shape:
        raise ConfigError(f"error-feedback buffer {name!r} has shape {tuple(old.shape)}, delta {tuple(delta.shape)}")
    d32 = delta.detach().to(torch.float32)
    if old is None:
        acc = d32 if owned else d32.clone()
    elif owned:
        acc = d32.add_(old.to(d32.device), alpha=beta)
    else:
        acc = torch.add(d32, old.to(d32.device), alpha=beta)
    enc = encode(acc, cfg)
    return enc, acc.sub_(decode(enc))
