"""What crosses a stage boundary, and the same model run in one process.

:class:`Boundary` turns the hidden states leaving a stage into what goes on the wire — all ``d``
numbers per token, or their ``k`` subspace coefficients — and back. Both directions are plain torch
ops, so autograd carries the gradient through them: the receiving stage's gradient for the wire
tensor is ``g·U`` (k numbers per token travel back) and the sending stage turns it into ``g_c·Uᵀ``.

:class:`BoundaryTransformer` is the unsplit model that applies the same boundaries in one process:
the reference a multi-process pipeline must match, the in-process simulation of a pipeline replica
in ``scripts/bench_pipeline.py``, and what a full replica trains when compression is not selective.
Its parameters have the model's names, so the inner trainer, the fingerprint and the codec use it
unchanged.

    model = BoundaryTransformer.wrap(build_model(cfg), boundaries=[2], boundary=Boundary(sub), fixed=t_fix)
    loss = lm_loss(model, tokens)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from client.pipeline.subspace import Subspace
from protocol.config import ModelConfig
from protocol.model import Transformer

__all__ = ["Boundary", "BoundaryTransformer"]


class Boundary:
    """Encoding of activations at a stage boundary: identity, or subspace coefficients."""

    def __init__(self, subspace: Subspace | None = None) -> None:
        self.subspace = subspace

    @property
    def compressed(self) -> bool:
        return self.subspace is not None

    def width(self, dim: int) -> int:
        """Numbers per token on the wire."""
        return dim if self.subspace is None else self.subspace.rank

    def bytes_per_token(self, dim: int, dtype: torch.dtype = torch.float32) -> int:
        """Activation bytes per token per boundary, forward (the backward gradient is the same size)."""
        return self.width(dim) * torch.empty((), dtype=dtype).element_size()

    def encode(self, h: Tensor, fixed_rows: Tensor | None) -> Tensor:
        if self.subspace is None:
            return h
        rows = torch.zeros_like(h) if fixed_rows is None else fixed_rows
        return self.subspace.to(h.device).compress(h, rows)

    def decode(self, wire: Tensor, fixed_rows: Tensor | None) -> Tensor:
        if self.subspace is None:
            return wire
        sub = self.subspace.to(wire.device)
        rows = wire.new_zeros(*wire.shape[:-1], sub.dim) if fixed_rows is None else fixed_rows
        return sub.decompress(wire, rows)


class BoundaryTransformer(Transformer):
    """A :class:`Transformer` whose forward passes its residual stream through boundaries.

    ``boundaries`` are block indices: the stream is encoded and decoded just before each of them,
    exactly as a pipeline whose stages start there. ``fixed`` is T_fix (added to the embedding and
    used to rebuild activations), or None without compression.
    """

    def __init__(self, cfg: ModelConfig, boundaries: Sequence[int], boundary: Boundary) -> None:
        super().__init__(cfg)
        if any(not 0 < b < cfg.n_layers for b in boundaries):
            raise ValueError(f"boundaries {list(boundaries)} must lie in 1..{cfg.n_layers - 1}")
        self.boundaries = sorted(set(boundaries))
        self.boundary = boundary
        self.register_buffer("fixed", None, persistent=False)

    @classmethod
    def wrap(
        cls,
        model: Transformer,
        boundaries: Sequence[int],
        boundary: Boundary,
        fixed: Tensor | None = None,
    ) -> BoundaryTransformer:
        """A copy of ``model``'s parameters behind the given boundaries (on the model's device)."""
        device = model.embed.weight.device
        with torch.device("meta"):
            out = cls(model.cfg, boundaries, boundary)
        out = out.to_empty(device=device)
        out.load_state_dict(model.state_dict())
        out.rope_cos, out.rope_sin = model.rope_cos.clone(), model.rope_sin.clone()
        out.set_fixed(fixed)
        return out

    def set_fixed(self, fixed: Tensor | None) -> None:
        self.fixed = None if fixed is None else fixed.to(self.embed.weight.device, torch.float32)

    def forward(self, tokens: Tensor) -> Tensor:
        rows = None if self.fixed is None else F.embedding(tokens, self.fixed)
        h = self.embed(tokens) if rows is None else self.embed(tokens) + rows
        start = 0
        for stop in [*self.boundaries, len(self.blocks)]:
            if start > 0:
                # float32 at the boundary even under bf16 autocast, as the stages send it.
                with torch.autocast(h.device.type, enabled=False):
                    h = self.boundary.decode(self.boundary.encode(h.float(), rows), rows)
            h = self.forward_slice(h, start, stop)
            start = stop
        return self.logits(h)
