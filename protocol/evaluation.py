"""How good θ is on held-out tokens: loss, perplexity and bits per byte.

A loss in nats per token depends on the tokenizer; bits per byte does not, so models with different
tokenizers compare on it. The validator's periodic evaluation and ``sparseloco eval`` both call
:func:`score_lm`, so a number in the contribution log and one printed by a user agree::

    batches = validation_batches(dataset, 256, spec.data.batch_size, spec.data.seq_len)
    score = score_lm(model, batches, load_tokenizer(spec.data.tokenizer))
    score.loss, score.perplexity, score.bits_per_byte

The loss is the same mean next-token cross-entropy as :func:`protocol.model.eval_loss` (all
sequences have one length, so the mean over tokens is the mean over sequences).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.data.tokenizer import ByteTokenizer, HFTokenizer
from protocol.model import autocast_for

__all__ = ["LMScore", "score_lm", "text_bytes"]


@dataclass(frozen=True)
class LMScore:
    """Next-token prediction quality over ``sequences`` held-out sequences."""

    loss: float  # mean cross-entropy, nats per predicted token
    tokens: int  # predicted tokens
    bytes: int  # UTF-8 bytes of text those tokens stand for
    sequences: int

    @property
    def perplexity(self) -> float:
        """exp(loss); infinite for a loss too large to exponentiate."""
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bits_per_byte(self) -> float:
        """Total bits (nats / ln 2) over the bytes of text predicted."""
        return self.loss * self.tokens / (max(self.bytes, 1) * math.log(2))


def text_bytes(tokenizer: ByteTokenizer | HFTokenizer, ids: Sequence[int]) -> int:
    """How many UTF-8 bytes ``ids`` stand for.

    Byte tokens are one byte each (the document separator, byte 0, included). Other tokenizers
    are decoded: a sequence cut out of a longer text may start or end inside a character, which
    moves the count by a few bytes per sequence at most."""
    if isinstance(tokenizer, ByteTokenizer):
        return len(ids)
    return len(tokenizer.decode(list(ids)).encode("utf-8"))


@torch.no_grad()
def score_lm(
    model: nn.Module,
    batches: Iterable[Tensor],
    tokenizer: ByteTokenizer | HFTokenizer,
    device: torch.device | str = "cpu",
) -> LMScore:
    """Loss, token and byte counts of ``model`` on ``batches`` [B, T+1] (inputs ``[:, :-1]``,
    targets ``[:, 1:]``); the model is left in its previous mode."""
    dev = torch.device(device)
    was_training = model.training
    model.eval()
    nats, tokens, nbytes, sequences = 0.0, 0, 0, 0
    try:
        for batch in batches:
            x = batch.to(dev, non_blocking=True)
            with autocast_for(dev):
                logits = model(x[:, :-1])
            targets = x[:, 1:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
            nats += float(loss)
            tokens += targets.numel()
            nbytes += sum(text_bytes(tokenizer, row) for row in batch[:, 1:].tolist())
            sequences += batch.shape[0]
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("score_lm needs at least one batch")
    return LMScore(loss=nats / tokens, tokens=tokens, bytes=nbytes, sequences=sequences)
