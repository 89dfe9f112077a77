"""Token shards in a local directory: how they are cut, written and memory-mapped.

A shard is a flat little-endian ``uint16`` (vocab ≤ 65536) or ``uint32`` token file, named in the
run's store by the sha256 of its bytes. A local shard directory lists its shards in ``index.json``::

    {"format": "sparseloco-shards", "version": 1, "dtype": "uint16", "vocab_size": 256,
     "tokenizer": "bytes", "eos_id": 0,
     "splits": {"train": [{"file": "train-00000.bin", "tokens": N, "sha256": "..."}], "val": [...]}}

``sparseloco-validator init`` writes one from a corpus (:func:`write_token_shards`) and uploads its
shards; a local directory also serves in-process runs directly (:func:`open_shards`)::

    ds = write_shards("data/mytext", text_documents("corpus/"), ByteTokenizer(), val_fraction=0.02)
    ds = open_shards("data/mytext")
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from protocol.data.corpus import Document, token_stream
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer
from protocol.data.tokens import TokenDataset, TokenSplit
from protocol.errors import ConfigError
from protocol.files import atomic_write

__all__ = ["FORMAT", "INDEX", "SHARD_TOKENS", "VERSION", "open_shards", "write_shards", "write_token_shards"]

FORMAT = "sparseloco-shards"
VERSION = 1
INDEX = "index.json"
SHARD_TOKENS = 1 << 26  # tokens per shard file of a local dataset


# ----------------------------------------------------------------------------- reading
def open_shards(path: str | Path) -> TokenDataset:
    """Open a shard directory, checking the index and every file's size (not its hash: speed)."""
    root = Path(path)
    try:
        raw = (root / INDEX).read_bytes()
        index = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"not a shard directory ({root / INDEX}): {exc}") from exc
    try:
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ConfigError(f"{root}: unsupported shard format {index.get('format')!r} v{index.get('version')}")
        dtype = {"uint16": np.uint16, "uint32": np.uint32}.get(index.get("dtype", ""))
        if dtype is None:
            raise ConfigError(f"{root}: unsupported token dtype {index.get('dtype')!r}")
        splits = {
            n: TokenSplit.of_arrays([_map(root, s, dtype) for s in index["splits"].get(n, [])])
            for n in ("train", "val")
        }
        vocab_size, tokenizer = int(index["vocab_size"]), str(index["tokenizer"])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{root / INDEX} is malformed: {exc!r}") from exc
    if len(splits["train"]) == 0 or len(splits["val"]) == 0:
        raise ConfigError(
            f"{root}: train and val splits must both hold tokens (documents are split in pieces; a tiny "
            "corpus may need more text or a larger data.val_fraction)"
        )
    digest = hashlib.sha256(raw).hexdigest()
    return TokenDataset(root, splits["train"], splits["val"], vocab_size, tokenizer, digest)


def shard_index(path: str | Path) -> dict[str, Any]:
    """The parsed ``index.json`` of a shard directory (as :func:`open_shards` checked it)."""
    open_shards(path)
    index: dict[str, Any] = json.loads((Path(path) / INDEX).read_bytes())
    return index


def _map(root: Path, shard: dict[str, Any], dtype: Any) -> np.ndarray:
    if not isinstance(shard.get("file"), str) or "/" in shard["file"] or shard["file"].startswith("."):
        raise ConfigError(f"{root}: bad shard file name {shard.get('file')!r}")
    f = root / shard["file"]
    expected = int(shard["tokens"]) * np.dtype(dtype).itemsize
    if not f.is_file() or f.stat().st_size != expected:
        raise ConfigError(f"shard {f} missing or not {expected} bytes")
    if expected == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(f, dtype=dtype, mode="r")


# ----------------------------------------------------------------------------- writing
class _ShardWriter:
    """Cuts one split's token stream into files of ``shard_tokens`` tokens, hashing each."""

    def __init__(self, out: Path, split: str, dtype: Any, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: np.ndarray) -> None:
        self.buf.append(ids.astype(self.dtype, copy=False))
        self.buffered += len(ids)
        while self.buffered >= self.shard_tokens:
            flat = np.concatenate(self.buf)
            self._flush(flat[: self.shard_tokens])
            self.buf, self.buffered = [flat[self.shard_tokens :]], len(flat) - self.shard_tokens

    def close(self) -> list[dict[str, Any]]:
        if self.buffered or not self.shards:
            self._flush(np.concatenate(self.buf) if self.buf else np.zeros(0, self.dtype))
        return self.shards

    def _flush(self, tokens: np.ndarray) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        data = tokens.astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tobytes()
        atomic_write(self.out / name, data)
        self.shards.append({"file": name, "tokens": len(tokens), "sha256": hashlib.sha256(data).hexdigest()})


def write_token_shards(
    out_dir: str | Path,
    chunks: Iterable[tuple[str, np.ndarray]],
    *,
    tokenizer: str,
    vocab_size: int,
    eos_id: int | None,
    shard_tokens: int = SHARD_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> TokenDataset:
    """Write ``(split, ids)`` chunks into a new shard directory ``out_dir`` (atomically) and open it.

    ``tokenizer``: the name of the tokenizer the ids come from; ``progress`` is called with the
    number of tokens of every chunk written. Every file is written durably into a temporary
    directory that is then renamed to ``out_dir``: a crash leaves no directory, never one with a
    truncated shard."""
    if shard_tokens < 1:
        raise ConfigError("shard_tokens must be >= 1")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
        for split, ids in chunks:
            writers[split].add(ids)
            if progress is not None:
                progress(len(ids))
        index = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": np.dtype(dtype).name,
            "vocab_size": vocab_size,
            "tokenizer": tokenizer,
            "eos_id": eos_id,
            "splits": {s: w.close() for s, w in writers.items()},
        }
        atomic_write(tmp / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())
        try:
            os.replace(tmp, out)  # atomic; fails if another process already published `out`
        except OSError:
            if not (out / INDEX).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return open_shards(out)


def write_shards(
    out_dir: str | Path,
    documents: Iterable[Document],
    tokenizer: ByteTokenizer | HFTokenizer,
    val_fraction: float,
    *,
    shard_tokens: int = SHARD_TOKENS,
) -> TokenDataset:
    """Tokenize ``(name, utf-8 bytes)`` documents into a shard directory (atomically) and open it
    (see :func:`protocol.data.corpus.token_stream` for the train/validation split)."""
    return write_token_shards(
        out_dir,
        token_stream(documents, tokenizer, val_fraction),
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        shard_tokens=shard_tokens,
    )
