"""One stage of a pipeline replica: a contiguous slice of the decoder's blocks.

The first stage also holds the token embedding, the last the final norm and output head. A stage's
parameters keep their global names (``embed.weight``, ``blocks.3.attn.wo.weight``, ``head.…``), so
its pseudo-gradient is a subset of the model's tensors and the validator aggregates it as such.

With subspace compression every stage also holds the fixed embedding ``T_fix`` (a frozen buffer,
rebuilt from the synchronised embedding at every window by :func:`client.pipeline.subspace.localize`):
the first stage adds it to the trainable embedding, every stage uses its rows to rebuild the
activations it receives.

    plans = plan_stages(cfg.n_layers, 2)
    stage = Stage(build_model(cfg), plans[1])          # blocks [2, 4) + head
    stage.load(global_params, fixed)                   # θ slice and T_fix
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.errors import ConfigError
from protocol.model import Transformer

__all__ = ["Stage", "StagePlan", "plan_stages"]


@dataclass(frozen=True)
class StagePlan:
    """Stage ``index`` of ``stages`` holds blocks ``[start, stop)``."""

    index: int
    stages: int
    start: int
    stop: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    def owns(self, name: str) -> bool:
        """Whether the global parameter ``name`` belongs to this stage."""
        if name.startswith("embed."):
            return self.first
        if name.startswith("head."):
            return self.last
        if name.startswith("blocks."):
            return self.start <= int(name.split(".")[1]) < self.stop
        raise ConfigError(f"parameter {name!r} belongs to no stage")


def plan_stages(n_layers: int, stages: int) -> list[StagePlan]:
    """Split ``n_layers`` blocks into ``stages`` contiguous slices, as even as possible.

    Earlier stages get the extra block when it does not divide (the last stage also runs the head).
    """
    if not 1 <= stages <= n_layers:
        raise ConfigError(f"cannot split {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    plans, start = [], 0
    for i in range(stages):
        stop = start + base + (1 if i < extra else 0)
        plans.append(StagePlan(i, stages, start, stop))
        start = stop
    return plans


class Stage(nn.Module):
    """The modules of one stage, taken from a full :class:`Transformer` (which may then be dropped)."""

    rope_cos: Tensor  # buffers (register_buffer): declared so they type as tensors
    rope_sin: Tensor
    fixed: Tensor | None

    def __init__(self, model: Transformer, plan: StagePlan) -> None:
        super().__init__()
        if model.head.output is None and plan.stages > 1:
            raise ConfigError("pipeline replicas need untied embeddings (model.tie_embeddings = false)")
        self.plan = plan
        self.embed = model.embed if plan.first else None
        # Keyed by the global block index so parameter names match the full model's.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(plan.start, plan.stop)})
        self.head = model.head if plan.last else None
        self.max_seq_len = model.cfg.max_seq_len
        self.dim = model.cfg.dim
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)
        self.register_buffer("fixed", None, persistent=False)

    # ------------------------------------------------------------------ state
    def slice_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's trainable parameters under their global names."""
        return dict(self.named_parameters())

    @torch.no_grad()
    def load(self, params: Mapping[str, Tensor], fixed: Tensor | None) -> None:
        """Copy this stage's slice of ``params`` in (others are ignored) and set T_fix."""
        for name, p in self.slice_parameters().items():
            if name not in params:
                raise ConfigError(f"parameters lack {name!r} for stage {self.plan.index}")
            p.copy_(params[name])
        self.fixed = None if fixed is None else fixed.to(self.rope_cos.device, torch.float32)

    # ------------------------------------------------------------------ compute
    def fixed_rows(self, tokens: Tensor) -> Tensor | None:
        return None if self.fixed is None else F.embedding(tokens, self.fixed)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        if self.embed is None:
            raise ConfigError(f"stage {self.plan.index} has no embedding")
        h: Tensor = self.embed(tokens)
        rows = self.fixed_rows(tokens)
        return h if rows is None else h + rows

    def run_blocks(self, h: Tensor) -> Tensor:
        t = h.shape[1]
        if t > self.max_seq_len:
            raise ConfigError(f"sequence of {t} tokens exceeds max_seq_len={self.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks.values():
            h = block(h, cos, sin)
        return h

    def logits(self, h: Tensor) -> Tensor:
        if self.head is None:
            raise ConfigError(f"stage {self.plan.index} has no head")
        out: Tensor = self.head(h)
        return out.float()
