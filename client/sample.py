"""Text from a checkpoint's model (``sparseloco sample``): a quick look at what the swarm learned.

    model = model_of(spec, ckpt, device)                   # client.checkpoints
    out = generate(model, prompt_ids, SampleSettings(max_new_tokens=200, temperature=0.8, top_p=0.95, seed=0))
    out.tokens, out.stopped        # the new token ids; "eos" or "length"

Decoding uses the KV cache of :mod:`client.kvcache`: one position per step. The prompt is
prefixed with the end-of-document token when the tokenizer has one, because that is what precedes
every document the model trained on. When the context reaches ``max_seq_len`` (where the model's
RoPE tables end), the newest half of it is re-encoded from position 0 and decoding goes on.
Sampling draws from a seeded CPU generator, so a seed gives the same text on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from client.kvcache import KVCache, forward_cached
from protocol.model import Transformer, autocast_for

__all__ = ["Generated", "SampleSettings", "generate", "pick_token"]


@dataclass(frozen=True)
class SampleSettings:
    """``temperature`` 0 is greedy; ``top_p`` < 1 samples from the smallest set of tokens whose
    probability reaches it (nucleus sampling)."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    stop_at_eos: bool = True


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # new tokens only
    stopped: str  # "eos" (the end-of-document token was drawn) or "length"


def pick_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from logits [vocab]: argmax at temperature 0, else a draw after temperature and top-p."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep a token while the mass before it is below top_p (the first token is always kept)
        keep = torch.cumsum(sorted_p, dim=0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], settings: SampleSettings, eos_id: int | None = None) -> Generated:
    """Continue ``prompt`` (token ids, not empty) by up to ``settings.max_new_tokens`` tokens."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model.embed.weight.device
    window = model.cfg.max_seq_len
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    context = list(prompt)
    out: list[int] = []
    with autocast_for(device):
        cache = KVCache()
        logits = _prefill(model, context[-window:], cache)
        while len(out) < settings.max_new_tokens:
            token = pick_token(logits, settings.temperature, settings.top_p, gen)
            if settings.stop_at_eos and token == eos_id:
                return Generated(out, "eos")
            out.append(token)
            context.append(token)
            if cache.length >= window:  # the RoPE tables end here: re-encode the newest half
                cache = KVCache()
                logits = _prefill(model, context[-(window // 2) :], cache)
            else:
                logits = forward_cached(model, torch.tensor([[token]], device=device), cache)[0, -1]
    return Generated(out, "length")


def _prefill(model: Transformer, tokens: list[int], cache: KVCache) -> Tensor:
    """Logits [vocab] after ``tokens``, with their keys and values in ``cache``."""
    x = torch.tensor([tokens], dtype=torch.long, device=model.embed.weight.device)
    return forward_cached(model, x, cache)[0, -1]
