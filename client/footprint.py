"""How much memory a peer needs to train a run's model, and the micro-batch size that fits.

    fp = footprint(spec, device_type="cuda")
    fp.device_bytes(micro_batch=4)          # weights + grads + AdamW moments + activations of 4 sequences
    suggest_micro_batch(fp, spec.data.batch_size, available=free_bytes)   # 0: no accumulation needed

The model (an estimate, deliberately on the high side):

* on the training device, per parameter: fp32 weights (4 B), fp32 gradients (4 B), AdamW's two
  moments (8 B);
* on the host, per parameter: the fp32 master copy of θ (4 B), the error-feedback buffer (4 B)
  and the pseudo-gradient while compressing (4 B) — on a CPU-only peer host and device are one;
* activations kept for the backward pass, per sequence of ``seq_len`` tokens and per layer: the
  block's inputs, q/k/v, the attention output, SwiGLU's three hidden tensors and residuals
  (``9·dim + 4·ffn_dim`` values a token), the attention matrix where the CPU materialises it
  (``2·n_heads·seq_len`` a token), and the logits with their softmax and gradient (``vocab`` values
  in bf16 plus two fp32 copies a token). Activations are bf16 under CUDA autocast, fp32 on a CPU.
  A 25 % margin covers allocator slack and temporaries.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from protocol.config import RunSpec
from protocol.model import param_schema

__all__ = ["Footprint", "available_memory", "footprint", "suggest_micro_batch"]

MARGIN = 1.25
USABLE = 0.9  # of the free memory: the allocator, the CUDA context and the data loader need some too


@dataclass(frozen=True)
class Footprint:
    """Bytes per part of one peer's training state (see the module docstring)."""

    parameters: int
    weights: int
    gradients: int
    moments: int
    host_state: int  # master θ, error feedback, pseudo-gradient
    activations_per_sequence: int
    shared_host: bool  # a CPU peer: host and device memory are the same

    def device_bytes(self, micro_batch: int) -> int:
        """What training a micro-batch of ``micro_batch`` sequences needs on the device."""
        static = self.weights + self.gradients + self.moments
        total = static + micro_batch * self.activations_per_sequence
        return total + (self.host_state if self.shared_host else 0)

    def to_json(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "weights": self.weights,
            "gradients": self.gradients,
            "moments": self.moments,
            "host_state": self.host_state,
            "activations_per_sequence": self.activations_per_sequence,
        }


def footprint(spec: RunSpec, device_type: str) -> Footprint:
    """The :class:`Footprint` of training ``spec``'s model on a ``device_type`` (cuda, cpu) device."""
    m, seq = spec.model, spec.data.seq_len
    n = sum(math.prod(shape) for shape in param_schema(m).values())
    act_bytes = 2 if device_type == "cuda" else 4
    per_token_layer = 9 * m.dim + 4 * m.ffn_dim + (0 if device_type == "cuda" else 2 * m.n_heads * seq)
    per_token_logits = m.vocab_size * (act_bytes + 8)
    activations = seq * (m.n_layers * per_token_layer * act_bytes + per_token_logits)
    return Footprint(
        parameters=n,
        weights=4 * n,
        gradients=4 * n,
        moments=8 * n,
        host_state=12 * n,
        activations_per_sequence=int(activations * MARGIN),
        shared_host=device_type != "cuda",
    )


def suggest_micro_batch(fp: Footprint, batch_size: int, available: int) -> int | None:
    """The ``compute.micro_batch_size`` to use with ``available`` free bytes: 0 when the whole
    batch fits, else the largest divisor of ``batch_size`` that fits, None when not even one
    sequence does."""
    budget = available * USABLE
    for micro in sorted((d for d in range(1, batch_size + 1) if batch_size % d == 0), reverse=True):
        if fp.device_bytes(micro) <= budget:
            return 0 if micro == batch_size else micro
    return None


def available_memory(device: str) -> int:
    """Free bytes on ``device``: CUDA's free memory, or the host's available memory."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():  # MemAvailable counts reclaimable caches, which free pages do not
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
