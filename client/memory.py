"""How many sequences fit one forward/backward pass: the automatic ``compute.micro_batch_size``.

A peer trains each inner step on ``data.batch_size`` sequences; with ``compute.micro_batch_size`` 0
(the default) it picks how many go through the model at once::

    auto_micro_batch(spec.model, spec.data, torch.device("cuda"))   # from the free device memory
    activation_bytes_per_sequence(spec.model, spec.data.seq_len)    # the estimate it divides by

On a CPU the whole batch goes at once (host memory is not the limit this guards against). On CUDA
the free memory (``torch.cuda.mem_get_info``, measured after the model is on the device) less what
training adds once it starts — fp32 gradients, the two AdamW moments and autocast's bf16 copies of
the weights, 14 bytes per parameter — and a margin, divided by an estimate of the activations one
sequence keeps for the backward pass.

The estimate counts what autograd saves per token under bf16 autocast in :mod:`protocol.model`'s
layers, rounded up: in every block the fp32 inputs and outputs of both RMSNorms, the bf16 inputs of
the six projections, q, k, v and the attention output, the rotary embedding's fp32 halves, and the
four ffn-wide bf16 tensors of the SwiGLU; after the blocks, the logits in bf16 and fp32, the
log-softmax and the gradient of the logits. Attention is assumed to run fused
(``scaled_dot_product_attention`` on CUDA keeps no T×T matrix). It errs high: a micro-batch that is
too small costs a little speed, one that is too large stops the peer.
"""

from __future__ import annotations

import torch

from protocol.config import DataConfig, ModelConfig
from protocol.model import param_schema

__all__ = [
    "BYTES_PER_TOKEN_DIM",
    "BYTES_PER_TOKEN_LAYER_DIM",
    "BYTES_PER_TOKEN_LAYER_FFN",
    "BYTES_PER_TOKEN_VOCAB",
    "TRAINING_BYTES_PER_PARAM",
    "activation_bytes_per_sequence",
    "auto_micro_batch",
    "micro_batch_for",
]

# Bytes autograd keeps per token (module docstring), per unit of model.dim in one block:
# 2 RMSNorms × (fp32 input + fp32 output + fp32 normalised) = 24; bf16 inputs of wq, wk, wv, wo,
# w_gate, w_up = 12; bf16 q, k, v and attention output = 8; rotary fp32 halves and results of q
# and k = 16; rounded up to 64 for the residual stream and the attention's log-sum-exp.
BYTES_PER_TOKEN_LAYER_DIM = 64
# Per unit of model.ffn_dim in one block: bf16 gate, silu(gate), up and their product.
BYTES_PER_TOKEN_LAYER_FFN = 8
# Per vocabulary entry: bf16 logits (2), their fp32 copy (4), log-softmax (4), its fp32 gradient
# (4) and the bf16 gradient of the projection's output (2).
BYTES_PER_TOKEN_VOCAB = 16
# Per unit of model.dim outside the blocks: the embedding's output and the final norm (fp32).
BYTES_PER_TOKEN_DIM = 16
# What training allocates per parameter once it starts: fp32 gradient (4), AdamW's two fp32
# moments (8), autocast's cached bf16 copy of the weight (2).
TRAINING_BYTES_PER_PARAM = 14
MARGIN_FRACTION = 0.05  # of the device's memory, kept free (allocator fragmentation, CUDA context)
MIN_MARGIN_BYTES = 1 << 30


def activation_bytes_per_sequence(model: ModelConfig, seq_len: int) -> int:
    """Estimated bytes one sequence of ``seq_len`` tokens keeps for the backward pass (CUDA, bf16)."""
    per_layer = BYTES_PER_TOKEN_LAYER_DIM * model.dim + BYTES_PER_TOKEN_LAYER_FFN * model.ffn_dim
    per_token = model.n_layers * per_layer + BYTES_PER_TOKEN_VOCAB * model.vocab_size + BYTES_PER_TOKEN_DIM * model.dim
    return seq_len * per_token


def micro_batch_for(free_bytes: int, *, per_sequence: int, reserved: int, batch_size: int) -> int:
    """Sequences per pass: as many as ``free_bytes − reserved`` holds at ``per_sequence`` each,
    between 1 and ``batch_size``."""
    if per_sequence <= 0 or batch_size <= 0:
        raise ValueError("per_sequence and batch_size must be > 0")
    fits = (free_bytes - reserved) // per_sequence
    return max(1, min(batch_size, fits))


def auto_micro_batch(model: ModelConfig, data: DataConfig, device: torch.device) -> int:
    """``compute.micro_batch_size`` when it is 0: 0 (the whole batch) off CUDA; on CUDA from the
    free memory of ``device``, with the model already on it (module docstring)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    params = sum(_numel(shape) for shape in param_schema(model).values())
    margin = max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * total))
    return micro_batch_for(
        free,
        per_sequence=activation_bytes_per_sequence(model, data.seq_len),
        reserved=TRAINING_BYTES_PER_PARAM * params + margin,
        batch_size=data.batch_size,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
