"""Building a run's dataset from a corpus, and putting it into the run's store.

The first half of ``sparseloco-validator init`` (:mod:`validator.init`): the corpus is tokenized
once, here, into content-addressed shards and described by a :class:`~protocol.wire.DatasetManifest`
whose digest goes into the RunSpec; once the run hash exists, shards, tokenizer file and signed
manifest go to ``<run>/data/`` (:mod:`protocol.data.run_data` reads them back)::

    built = build_dataset(["corpus/", "builtin:stdlib"], tokenizer, val_fraction=0.02, work=tmp)
    spec = spec.replace(data={"dataset": built.digest, "tokenizer": tokenizer.name})
    publish_dataset(store, run_id(spec.hash()), spec.hash(), built, validator_identity)

Inputs (:mod:`protocol.data.corpus`): ``builtin:stdlib``, text files and directories, JSONL files (the
string under ``text_field`` of every line), and shard directories written before (their tokens are
taken as they are, split as they were; their tokenizer must be this one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol import layout
from protocol.data.corpus import Document, documents, source_bytes, token_stream
from protocol.data.shards import INDEX, shard_index, write_token_shards
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer
from protocol.data.tokens import TokenDataset
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.store.base import ObjectStore, put_once
from protocol.wire import DatasetManifest, DatasetShard, block_digests, dataset_digest, encode_dataset
from protocol.wire.dataset import DEFAULT_BLOCK_TOKENS

__all__ = ["DEFAULT_SHARD_TOKENS", "BuiltDataset", "build_dataset", "corpus_bytes", "publish_dataset"]

# 1 Mi tokens (2 MiB of byte tokens) per shard object; readers fetch blocks of it (protocol.wire.dataset).
DEFAULT_SHARD_TOKENS = 1 << 20

Progress = Callable[[int], None]  # called with the bytes just processed


@dataclass(frozen=True)
class BuiltDataset:
    """A tokenized corpus on local disk: its manifest, where each shard file lies, the tokenizer
    file (None for byte tokens), and the shards opened as a local dataset (for checks)."""

    manifest: DatasetManifest
    files: dict[str, Path]  # sha256 -> shard file
    tokenizer_file: Path | None
    local: TokenDataset
    documents: int

    @property
    def digest(self) -> str:
        return dataset_digest(self.manifest)

    def total_bytes(self) -> int:
        return sum(self.manifest.shard_bytes(s) for s in self.manifest.shards)


def corpus_bytes(sources: Sequence[str]) -> int:
    """What :func:`build_dataset` will read, in bytes (for a progress bar)."""
    return sum(_shard_dir_bytes(Path(s)) if _is_shard_dir(s) else source_bytes(s) for s in sources)


def build_dataset(
    sources: Sequence[str],
    tokenizer: ByteTokenizer | HFTokenizer,
    *,
    val_fraction: float,
    work: Path,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    text_field: str = "text",
    progress: Progress | None = None,
) -> BuiltDataset:
    """Tokenize ``sources`` into shards under ``work`` (a new directory) and describe them."""
    if not sources:
        raise ConfigError("give at least one corpus")
    counter = _Counter(progress)
    chunks = _chunks(sources, tokenizer, val_fraction, text_field, counter)
    local = write_token_shards(
        work / "shards",
        chunks,
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        shard_tokens=shard_tokens,
    )
    index = shard_index(local.path)
    token_bytes = 2 if tokenizer.vocab_size <= 1 << 16 else 4
    shards, files = [], {}
    for split in ("train", "val"):
        for entry in index["splits"][split]:
            if entry["tokens"]:  # a split that ends on a shard boundary leaves no empty file behind
                path = local.path / entry["file"]
                blocks = block_digests(path.read_bytes(), block_tokens * token_bytes)
                shards.append(DatasetShard(split, entry["sha256"], int(entry["tokens"]), blocks))
                files[entry["sha256"]] = path
    if not any(s.split == "train" for s in shards) or not any(s.split == "val" for s in shards):
        raise ConfigError(
            "the corpus is too small for both a train and a validation split (documents go to the "
            f"validation split in pieces; data.val_fraction is {val_fraction})"
        )
    manifest = DatasetManifest(
        tokenizer=tokenizer.name,
        token_bytes=token_bytes,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        shards=tuple(shards),
        metadata={"documents": counter.documents, "val_fraction": float(val_fraction)},
        block_tokens=block_tokens,
    )
    tokenizer_file = tokenizer.path if isinstance(tokenizer, HFTokenizer) else None
    return BuiltDataset(manifest, files, tokenizer_file, local, counter.documents)


def publish_dataset(
    store: ObjectStore,
    run: str,
    run_hash: str,
    built: BuiltDataset,
    identity: Identity,
    *,
    progress: Progress | None = None,
) -> None:
    """Put the tokenizer file, every shard (each once: names are content addresses, and a shard
    already there is not sent again) and last the signed manifest, so that a manifest never
    names a missing shard. Rerunning it is harmless."""
    if built.tokenizer_file is not None:
        data = built.tokenizer_file.read_bytes()
        put_once(store, layout.tokenizer_key(run, hashlib.sha256(data).hexdigest()), data)
    for sha, path in built.files.items():
        key = layout.shard_key(run, sha)
        if not store.exists(key):
            put_once(store, key, path.read_bytes())
        if progress is not None:
            progress(path.stat().st_size)
    put_once(store, layout.dataset_manifest_key(run), encode_dataset(built.manifest, run_hash, identity))


# ----------------------------------------------------------------------------- inputs
class _Counter:
    """Counts documents and reports the bytes read."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.documents = progress, 0

    def docs(self, stream: Iterator[Document]) -> Iterator[Document]:
        for doc in stream:
            self.documents += 1
            if self.progress is not None:
                self.progress(len(doc[1]))
            yield doc

    def tokens(self, n_bytes: int) -> None:
        if self.progress is not None:
            self.progress(n_bytes)


def _chunks(
    sources: Sequence[str],
    tokenizer: ByteTokenizer | HFTokenizer,
    val_fraction: float,
    text_field: str,
    counter: _Counter,
) -> Iterator[tuple[str, np.ndarray]]:
    for source in sources:
        if _is_shard_dir(source):
            yield from _shard_dir_chunks(Path(source), tokenizer, counter)
        else:
            yield from token_stream(counter.docs(documents(source, text_field)), tokenizer, val_fraction)


def _is_shard_dir(source: str) -> bool:
    return (Path(source).expanduser() / INDEX).is_file()


def _shard_dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.expanduser().glob("*.bin"))


def _shard_dir_chunks(
    path: Path, tokenizer: ByteTokenizer | HFTokenizer, counter: _Counter
) -> Iterator[tuple[str, np.ndarray]]:
    """The tokens of a shard directory, split as it was split (its tokenizer must be ours)."""
    root = path.expanduser()
    index = shard_index(root)
    if index["tokenizer"] != tokenizer.name:
        raise ConfigError(f"{root} was tokenized with {index['tokenizer']!r}, this run uses {tokenizer.name!r}")
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    for split in ("train", "val"):
        for entry in index["splits"][split]:
            data = (root / entry["file"]).read_bytes()
            counter.tokens(len(data))
            yield split, np.frombuffer(data, dtype=dtype)
