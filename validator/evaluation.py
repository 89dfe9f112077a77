"""The validator's periodic evaluation of θ: loss, perplexity and bits per byte every N windows.

A local setting of one validator (``sparseloco-validator run --eval-every N``), never part of the
RunSpec: it changes nothing anyone signs or verifies, only what the operator can read. After the
aggregate of window ``t`` is published, with ``(t + 1) % N == 0``, θ_{t+1} is scored on a fixed
set of ``sequences`` sequences of the validation split (:func:`protocol.data.assignment.validation_batches`,
more than the per-window ``val_loss`` uses) by :func:`protocol.evaluation.score_lm` — the
numbers ``sparseloco eval`` prints for the same θ and sequence count. The result is a row of the
contribution log's ``evaluations`` table (``sparseloco-validator logs --evals``, ``--summary``)::

    periodic = PeriodicEval(every=5, sequences=256, dataset=ds, data=spec.data)
    if periodic.due(window):
        log.record_evaluation(periodic.evaluate(model, window, fingerprint, device))
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from protocol.config import DataConfig
from protocol.data.assignment import TokenDataset, validation_batches
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from protocol.evaluation import score_lm
from validator.log import EvaluationRecord

__all__ = ["DEFAULT_EVAL_SEQUENCES", "PeriodicEval"]

DEFAULT_EVAL_SEQUENCES = 256


class PeriodicEval:
    """When θ is evaluated (every ``every`` windows; 0: never) and on which sequences."""

    def __init__(
        self,
        *,
        every: int,
        sequences: int,
        dataset: TokenDataset,
        data: DataConfig,
        tokenizer: Callable[[], ByteTokenizer | HFTokenizer] | None = None,
    ) -> None:
        """``tokenizer``: how to get the run's tokenizer when first needed (default: from
        ``data.tokenizer`` on this machine; a run's ``hf:<sha256>`` one comes from its store)."""
        if every < 0 or sequences < 1:
            raise ValueError("every must be >= 0 and sequences >= 1")
        self.every, self.sequences = every, sequences
        self.dataset, self.data = dataset, data
        self._load_tokenizer = tokenizer or (lambda: load_tokenizer(data.tokenizer))
        self._tokenizer: ByteTokenizer | HFTokenizer | None = None
        self._batches: list[Tensor] | None = None  # built on first use: fixed for the whole run

    def due(self, window: int) -> bool:
        """Whether θ after the aggregate of ``window`` is evaluated."""
        return self.every > 0 and (window + 1) % self.every == 0

    def evaluate(
        self, model: nn.Module, window: int, fingerprint: str, device: torch.device | str = "cpu"
    ) -> EvaluationRecord:
        """Score ``model`` (holding θ after aggregate ``window``, of ``fingerprint``)."""
        started = time.monotonic()
        if self._batches is None:
            self._batches = validation_batches(self.dataset, self.sequences, self.data.batch_size, self.data.seq_len)
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        score = score_lm(model, self._batches, self._tokenizer, device)
        return EvaluationRecord(
            window=window,
            fingerprint=fingerprint,
            sequences=score.sequences,
            tokens=score.tokens,
            bytes=score.bytes,
            loss=score.loss,
            perplexity=score.perplexity,
            bits_per_byte=score.bits_per_byte,
            evaluated_at=time.time(),
            seconds=round(time.monotonic() - started, 3),
        )
