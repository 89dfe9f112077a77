"""DiLoCo's dense outer step: mean of fp32 pseudo-gradients, then SGD with Nesterov momentum.

The baseline SparseLoCo is compared against in the simulator (``SimConfig(method="diloco")``); peers
and the validator run SparseLoCo only::

    outer = NesterovOuter(lr=0.7, momentum=0.9)
    outer.step(params, dense_mean([delta_r for r in replicas]))   # θ ← θ − lr·(g + μ·m)

Same update as ``torch.optim.SGD(nesterov=True)`` with the pseudo-gradient as the gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["NesterovOuter", "dense_mean"]


def dense_mean(deltas: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Coordinate-wise mean of dense pseudo-gradients (float32, summed in the order given)."""
    if not deltas:
        raise ValueError("dense_mean needs at least one pseudo-gradient")
    out: dict[str, Tensor] = {}
    for name in deltas[0]:
        acc = torch.zeros_like(deltas[0][name], dtype=torch.float64)
        for d in deltas:
            acc += d[name].double()
        out[name] = (acc / len(deltas)).float()
    return out


class NesterovOuter:
    """Outer SGD with Nesterov momentum over named parameters; state is one buffer per tensor."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, params: Mapping[str, Tensor], grad: Mapping[str, Tensor]) -> None:
        for name, g in grad.items():
            p = params[name]
            g = g.to(p.device, p.dtype)
            buf = self.buffers.get(name)
            if buf is None:
                buf = self.buffers[name] = g.clone()
            else:
                buf.mul_(self.momentum).add_(g)
            p.sub_(g + self.momentum * buf, alpha=self.lr)

    def state_dict(self) -> dict[str, Tensor]:
        """Momentum buffers by tensor name (safetensors-friendly)."""
        return {name: b.detach().cpu().clone() for name, b in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.buffers = {name: t.clone() for name, t in state.items()}
