"""Incremental decoding for :class:`protocol.model.Transformer`: keys and values are kept, not recomputed.

``Transformer.forward`` recomputes every position for every new token (O(T²) per token). Here
each block's keys and values of the tokens seen so far are cached, and a step runs only the new
tokens through the model, attending to the cache::

    cache = KVCache()
    logits = forward_cached(model, prompt[None], cache)          # [1, T, vocab]; cache.length == T
    logits = forward_cached(model, next_token[None, None], cache)  # [1, 1, vocab]; one more position

The arithmetic is the model's own: the same submodules, RoPE tables and attention, the new tokens
rotated at their absolute positions (``cache.length`` onwards). Positions cannot exceed
``model.cfg.max_seq_len``, where the RoPE tables end (the caller slides the window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from protocol.model import Attention, Block, Transformer, apply_rope

__all__ = ["KVCache", "forward_cached"]


@dataclass
class KVCache:
    """Per block, keys and values [B, heads, length, head_dim] of the positions decoded so far."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    length: int = 0


@torch.no_grad()
def forward_cached(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    """Logits [B, T, vocab] (float32) of ``tokens`` [B, T], which follow the ``cache.length``
    positions in ``cache``; appends their keys and values."""
    start, t = cache.length, tokens.shape[1]
    cos, sin = model.rope(start + t)  # ValueError past max_seq_len
    cos, sin = cos[start:], sin[start:]
    # New token i (absolute position start + i) sees every cached position and new tokens 0..i:
    # from an empty cache that is the model's own causal attention; one new token sees everything.
    mask: Tensor | None = None
    if start > 0 and t > 1:
        mask = torch.ones(t, start + t, dtype=torch.bool, device=tokens.device).tril(start)
    x = model.embed(tokens)
    for i, module in enumerate(model.blocks):
        block = cast(Block, module)
        x = x + _attend(block.attn, block.attn_norm(x), cos, sin, mask, start == 0 and t > 1, cache, i)
        x = x + block.mlp(block.mlp_norm(x))
    cache.length = start + t
    return model.logits(x)


def _attend(
    attn: Attention, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, causal: bool, cache: KVCache, i: int
) -> Tensor:
    b, t, d = x.shape
    shape = (b, t, attn.n_heads, attn.head_dim)
    q = apply_rope(attn.wq(x).view(shape).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(x).view(shape).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(shape).transpose(1, 2)
    if i < len(cache.keys):
        k = torch.cat((cache.keys[i], k), dim=2)
        v = torch.cat((cache.values[i], v), dim=2)
        cache.keys[i], cache.values[i] = k, v
    else:
        cache.keys.append(k)
        cache.values.append(v)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return cast(Tensor, attn.wo(y.transpose(1, 2).reshape(b, t, d)))
