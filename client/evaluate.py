"""How good a checkpoint is (``sparseloco eval``): loss, perplexity and bits per byte on held-out text.

    data = heldout_data(spec, None, sequences=256)       # the run's validation split
    data = heldout_data(spec, "notes.txt", sequences=64)  # any text, all of it
    score = score_lm(model_of(spec, ckpt), data.batches, data.tokenizer)   # protocol.evaluation

What is held out:

* no ``--data``: the validation split of the run's own dataset — the same split, sequence length
  and spacing the validator's ``val_loss`` uses (:func:`protocol.data.validation_batches`); with
  ``sequences`` equal to ``validator.eval_sequences`` the loss is the validator's;
* ``builtin:stdlib`` or a shard directory: that dataset's validation split;
* any other text file or directory: all of its text (unless it is the run's own source, whose
  validation split is used), tokenized with the run's tokenizer, one end-of-document token after
  each file.

Sequences are ``data.seq_len + 1`` tokens, evenly spaced over the held-out tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from protocol.config import RunSpec
from protocol.data import INDEX, open_dataset, text_documents, validation_batches
from protocol.errors import ConfigError
from protocol.settings import DataSettings
from protocol.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["HeldOut", "heldout_data"]


@dataclass(frozen=True)
class HeldOut:
    """Batches [B, seq_len + 1] of held-out tokens and where they come from."""

    description: str  # e.g. "builtin:stdlib (validation split)"
    batches: list[Tensor]
    tokenizer: ByteTokenizer | HFTokenizer
    available_tokens: int  # held-out tokens the sequences were spread over


def heldout_data(spec: RunSpec, data: str | None, *, sequences: int, local: DataSettings | None = None) -> HeldOut:
    """The held-out sequences ``data`` names (see the module docstring); ``local``: this machine's
    data settings (the run's corpus ``local.source``, the cache)."""
    if sequences < 1:
        raise ConfigError("sequences must be >= 1")
    d, local = spec.data, local or DataSettings()
    if data is None or data == local.source or _is_dataset(data) or _same_path(data, local.source):
        source = local.source if data is None else data
        ds = open_dataset(d, dataclasses.replace(local, source=source))
        return HeldOut(
            f"{source} (validation split)",
            validation_batches(ds, sequences, d.batch_size, d.seq_len),
            load_tokenizer(d.tokenizer),
            len(ds.val),
        )
    path = Path(data).expanduser()
    if not path.exists():
        raise ConfigError(f"data not found: {data!r}")
    tok = load_tokenizer(d.tokenizer)
    tokens = _tokenize_all(path, tok)
    return HeldOut(f"{data} (all text)", _even_sequences(tokens, sequences, d.batch_size, d.seq_len), tok, len(tokens))


def _is_dataset(data: str) -> bool:
    return data.startswith("builtin:") or (Path(data).expanduser() / INDEX).is_file()


def _same_path(data: str, source: str) -> bool:
    if source.startswith("builtin:"):
        return False
    return Path(data).expanduser().resolve() == Path(source).expanduser().resolve()


def _tokenize_all(path: Path, tok: ByteTokenizer | HFTokenizer) -> np.ndarray:
    pieces = []
    for _, data in text_documents(path):
        ids = list(data) if isinstance(tok, ByteTokenizer) else tok.encode(data.decode("utf-8"))
        pieces.append(np.asarray(ids + ([tok.eos_id] if tok.eos_id is not None else []), dtype=np.int64))
    if not pieces:
        raise ConfigError(f"{path} holds no UTF-8 text")
    return np.concatenate(pieces)


def _even_sequences(tokens: np.ndarray, n: int, batch_size: int, seq_len: int) -> list[Tensor]:
    """Up to ``n`` sequences of ``seq_len + 1`` tokens, evenly spaced (as validation_batches does)."""
    span = seq_len + 1
    n_slots = len(tokens) // span
    if n_slots < 1:
        raise ConfigError(f"the text is {len(tokens)} tokens, shorter than one sequence of {span}")
    n = min(n, n_slots)
    starts = (np.arange(n, dtype=np.int64) * n_slots // n) * span
    rows = np.stack([tokens[s : s + span] for s in starts])
    return list(torch.split(torch.from_numpy(rows), batch_size))
