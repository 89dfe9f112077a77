"""How good a checkpoint is (``sparseloco eval``): loss, perplexity and bits per byte on held-out text.

    data = heldout_data(spec, None, sequences=256, store=store)   # the run's validation split
    data = heldout_data(spec, "notes.txt", sequences=64)          # any text, all of it
    score = score_lm(model_of(spec, ckpt), data.batches, data.tokenizer)   # protocol.evaluation

What is held out:

* no ``--data``: the validation split of the run's own dataset, read from the run's store (the
  shards it touches are fetched and verified into the data cache) — the same split, sequence
  length and spacing the validator's ``val_loss`` uses (:func:`protocol.data.assignment.validation_batches`);
  with ``sequences`` equal to ``validator.eval_sequences`` the loss is the validator's;
* ``builtin:stdlib`` or a shard directory: that dataset's validation split, tokenized on this machine;
* any other text file or directory: all of its text, tokenized with the run's tokenizer, one
  end-of-document token after each file.

Sequences are ``data.seq_len + 1`` tokens, evenly spaced over the held-out tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from protocol.config import RunSpec
from protocol.data.assignment import INDEX, open_dataset, text_documents, validation_batches
from protocol.data.run_data import dataset_of, run_tokenizer
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from protocol.errors import ConfigError
from protocol.settings import DataSettings
from protocol.store.base import ObjectStore

__all__ = ["HeldOut", "heldout_data"]


@dataclass(frozen=True)
class HeldOut:
    """Batches [B, seq_len + 1] of held-out tokens and where they come from."""

    description: str  # e.g. "builtin:stdlib (validation split)"
    batches: list[Tensor]
    tokenizer: ByteTokenizer | HFTokenizer
    available_tokens: int  # held-out tokens the sequences were spread over


def heldout_data(
    spec: RunSpec,
    data: str | None,
    *,
    sequences: int,
    local: DataSettings | None = None,
    store: ObjectStore | None = None,
) -> HeldOut:
    """The held-out sequences ``data`` names (see the module docstring). ``store``: the run's
    store (needed for the run's own dataset and an ``hf:<sha256>`` tokenizer); ``local``: this
    machine's data cache settings."""
    if sequences < 1:
        raise ConfigError("sequences must be >= 1")
    d, local = spec.data, local or DataSettings()
    tok = run_tokenizer(spec, store, local) if store is not None else load_tokenizer(d.tokenizer)
    if data is None or _is_dataset(data):
        if data is not None:
            ds, source = open_dataset(d, data, local), data
        elif store is not None:
            ds, source = dataset_of(spec, store, local), "the run's dataset"
        elif d.dataset:
            raise ConfigError("the run's dataset lies in its store: give the store")
        else:  # an in-process run on the local built-in corpus
            ds, source = open_dataset(d, local=local), "builtin:stdlib"
        batches = validation_batches(ds, sequences, d.batch_size, d.seq_len)
        return HeldOut(f"{source} (validation split)", batches, tok, len(ds.val))
    path = Path(data).expanduser()
    if not path.exists():
        raise ConfigError(f"data not found: {data!r}")
    tokens = _tokenize_all(path, tok)
    return HeldOut(f"{data} (all text)", _even_sequences(tokens, sequences, d.batch_size, d.seq_len), tok, len(tokens))


def _is_dataset(data: str) -> bool:
    return data.startswith("builtin:") or (Path(data).expanduser() / INDEX).is_file()


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
