"""Tokenized shards and the deterministic assignment of batches to peers.

**Shard format.** A directory with ``index.json`` and flat little-endian ``uint16`` (vocab ≤ 65536)
or ``uint32`` token files, memory-mapped on open::

    {"format": "sparseloco-shards", "version": 1, "dtype": "uint16", "vocab_size": 256,
     "tokenizer": "bytes", "eos_id": 0,
     "splits": {"train": [{"file": "train-00000.bin", "tokens": N, "sha256": "..."}], "val": [...]}}

Documents are cut at line ends into ~16 KiB pieces, and each piece is assigned to the held-out ``val``
split by a hash of (document name, piece number), so the split does not depend on file order and a
single large file still splits. ``builtin:stdlib`` is the Python standard library's ``.py`` source (capped at
:data:`STDLIB_CAP_BYTES`), tokenized on first use into the cache (``[local.data] cache_dir``, else
``$SPARSELOCO_CACHE``, else ``~/.cache/sparseloco``). Which corpus a machine reads is a local
setting (:class:`protocol.settings.DataSettings`); how it is cut into batches is the RunSpec's
:class:`~protocol.config.DataConfig`. It depends on the interpreter version; runs across machines should ship
prepared shards (``scripts/prepare_data.py``) and compare :attr:`TokenDataset.digest`.

**Assignment.** The train stream is cut into slots of ``seq_len + 1`` tokens (window-dependent
offset). Window t permutes the slots with a keyed affine bijection; peer p reads the ``n`` slots of
lane ``L(p)``, so lanes never overlap within a window. An integer peer (a simulator replica) is its
own lane, hence exactly disjoint; a string peer id is hashed to a lane per window (two ids share a
lane with probability 1/n_lanes). Everything is a pure function of (run seed, peer, window), so the
validator reproduces a peer's batches exactly.

    ds = open_dataset(spec.data, settings.data)
    batches = assigned_batches(ds, spec.seed, peer_id, window, spec.inner.steps,
                               spec.data.batch_size, spec.data.seq_len)   # list of [B, T+1]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from protocol.config import DataConfig
from protocol.errors import ConfigError
from protocol.files import atomic_write
from protocol.settings import DataSettings
from protocol.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "STDLIB_CAP_BYTES",
    "TokenDataset",
    "TokenSplit",
    "assigned_batches",
    "cache_dir",
    "open_dataset",
    "open_shards",
    "random_batches",
    "stdlib_documents",
    "text_documents",
    "validation_batches",
    "write_shards",
]

FORMAT = "sparseloco-shards"
VERSION = 1
INDEX = "index.json"
SHARD_TOKENS = 1 << 26  # tokens per shard file
STDLIB_CAP_BYTES = 8 << 20
PIECE_BYTES = 1 << 14  # documents are assigned to train/val in pieces of this size
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------- reading
class TokenSplit:
    """One split as a virtual concatenation of memory-mapped shard files."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` (may cross shard boundaries)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"read [{start}, {start + length}) outside split of {len(self)} tokens")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, pos = [], start
        while pos < start + length:
            a, off = self.arrays[i], pos - int(self.starts[i])
            take = min(len(a) - off, start + length - pos)
            parts.append(a[off : off + take])
            pos, i = pos + take, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass(frozen=True)
class TokenDataset:
    """An opened shard directory: ``train`` and ``val`` splits, ``vocab_size``, ``digest``."""

    path: Path
    train: TokenSplit
    val: TokenSplit
    vocab_size: int
    tokenizer: str
    digest: str  # sha256 of index.json, which names every shard's sha256


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
        splits = {n: TokenSplit([_map(root, s, dtype) for s in index["splits"].get(n, [])]) for n in ("train", "val")}
        vocab_size, tokenizer = int(index["vocab_size"]), str(index["tokenizer"])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{root / INDEX} is malformed: {exc!r}") from exc
    if len(splits["train"]) == 0 or len(splits["val"]) == 0:
        raise ConfigError(
            f"{root}: train and val splits must both hold tokens (documents are split in {PIECE_BYTES} byte "
            "pieces; a tiny corpus may need more text or a larger data.val_fraction)"
        )
    return TokenDataset(root, splits["train"], splits["val"], vocab_size, tokenizer, hashlib.sha256(raw).hexdigest())


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
    def __init__(self, out: Path, split: str, dtype: Any) -> None:
        self.out, self.split, self.dtype = out, split, dtype
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: np.ndarray) -> None:
        self.buf.append(ids.astype(self.dtype, copy=False))
        self.buffered += len(ids)
        while self.buffered >= SHARD_TOKENS:
            flat = np.concatenate(self.buf)
            self._flush(flat[:SHARD_TOKENS])
            self.buf, self.buffered = [flat[SHARD_TOKENS:]], len(flat) - SHARD_TOKENS

    def close(self) -> list[dict[str, Any]]:
        if self.buffered or not self.shards:
            self._flush(np.concatenate(self.buf) if self.buf else np.zeros(0, self.dtype))
        return self.shards

    def _flush(self, tokens: np.ndarray) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        data = tokens.astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tobytes()
        atomic_write(self.out / name, data)
        self.shards.append({"file": name, "tokens": len(tokens), "sha256": hashlib.sha256(data).hexdigest()})


def write_shards(
    out_dir: str | Path,
    documents: Iterable[tuple[str, bytes]],
    tokenizer: ByteTokenizer | HFTokenizer,
    val_fraction: float,
) -> TokenDataset:
    """Tokenize ``(name, utf-8 bytes)`` documents into a shard directory (atomically) and open it.

    Every file is written durably into a temporary directory that is then renamed to ``out_dir``:
    a crash leaves no directory, never one with a truncated shard."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        writers = {s: _ShardWriter(tmp, s, dtype) for s in ("train", "val")}
        for name, data in documents:
            pieces = _pieces(data)
            for i, piece in enumerate(pieces):
                ids = _tokenize(tokenizer, piece, eos=i == len(pieces) - 1)
                writers["val" if _unit(f"val|{name}|{i}") < val_fraction else "train"].add(ids)
        index = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.name,
            "eos_id": tokenizer.eos_id,
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


def _pieces(data: bytes) -> list[bytes]:
    """Cut a document at line ends into pieces of about PIECE_BYTES, so one big file still splits."""
    out, start = [], 0
    while len(data) - start > PIECE_BYTES:
        cut = data.rfind(b"\n", start, start + PIECE_BYTES) + 1 or start + PIECE_BYTES  # -1 + 1: no line end
        out.append(data[start:cut])
        start = cut
    out.append(data[start:])
    return out


def _tokenize(tokenizer: ByteTokenizer | HFTokenizer, data: bytes, eos: bool = True) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    else:
        ids = np.asarray(tokenizer.encode(data.decode("utf-8", errors="replace")), dtype=np.int64)
    if eos and tokenizer.eos_id is not None:
        ids = np.append(ids, np.asarray([tokenizer.eos_id], dtype=ids.dtype))
    return ids


# ----------------------------------------------------------------------------- sources
def cache_dir(local: DataSettings | None = None) -> Path:
    """``local.cache_dir``, else ``$SPARSELOCO_CACHE``, else ``~/.cache/sparseloco``."""
    if local is not None and local.cache_dir:
        return Path(local.cache_dir).expanduser()
    env = os.environ.get("SPARSELOCO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparseloco"


def stdlib_documents(cap_bytes: int = STDLIB_CAP_BYTES) -> Iterator[tuple[str, bytes]]:
    """The interpreter's standard-library ``.py`` files (tests excluded), in a hashed order, capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts)]
    files.sort(key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).digest())
    total = 0
    for p in files:
        data = p.read_bytes()
        if b"\x00" in data or total >= cap_bytes:
            continue
        total += len(data)
        yield str(p.relative_to(root)), data


def text_documents(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """A text file, or every UTF-8 text file under a directory (binary files skipped), sorted."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for p in files:
        data = p.read_bytes()
        if b"\x00" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield str(p.relative_to(root) if p != root else p.name), data


def open_dataset(cfg: DataConfig, local: DataSettings | None = None) -> TokenDataset:
    """Open this machine's corpus ``local.source`` (default ``builtin:stdlib``), a shard directory,
    or a text file/directory, cut as the RunSpec's ``cfg`` says.

    Text sources are tokenized once into the cache, keyed by the source, its files' sizes and
    mtimes, the tokenizer and the validation fraction.
    """
    local = local or DataSettings()
    tok = load_tokenizer(cfg.tokenizer)
    if local.source == "builtin:stdlib":
        ver = sysconfig.get_python_version()
        key = _key("stdlib", VERSION, ver, tok.name, STDLIB_CAP_BYTES, PIECE_BYTES, cfg.val_fraction)
        return _cached(key, stdlib_documents, tok, cfg.val_fraction, local)
    src = Path(local.source).expanduser()
    if (src / INDEX).is_file():
        ds = open_shards(src)
        if ds.tokenizer != tok.name:
            raise ConfigError(f"{src} was tokenized with {ds.tokenizer!r}, the run uses {tok.name!r}")
        return ds
    if not src.exists():
        raise ConfigError(f"data source not found: {local.source!r}")
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = _key("text", VERSION, str(src.resolve()), stamp, tok.name, PIECE_BYTES, cfg.val_fraction)
    return _cached(key, lambda: text_documents(src), tok, cfg.val_fraction, local)


def _cached(
    key: str,
    docs: Callable[[], Iterable[tuple[str, bytes]]],
    tok: ByteTokenizer | HFTokenizer,
    val_fraction: float,
    local: DataSettings,
) -> TokenDataset:
    out = cache_dir(local) / key
    if (out / INDEX).is_file():
        return open_shards(out)
    ds = write_shards(out, docs(), tok, val_fraction)
    if local.cache_max_bytes:
        _trim_cache(out.parent, keep=out, cap_bytes=local.cache_max_bytes)
    return ds


def _trim_cache(root: Path, *, keep: Path, cap_bytes: int) -> None:
    """Remove the least recently written cache entries (never ``keep``) until ``root`` holds at
    most ``cap_bytes``. An entry is one tokenized source; a removed one is rebuilt when needed."""
    entries = [p for p in root.iterdir() if (p / INDEX).is_file()]  # published entries, not temporaries
    size = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in entries}
    total = sum(size.values())
    for p in sorted(entries, key=lambda p: p.stat().st_mtime):
        if total <= cap_bytes:
            return
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)
            total -= size[p]


def _key(kind: str, *parts: Any) -> str:
    return f"{kind}-{hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]}"


# ----------------------------------------------------------------------------- batches
def _h(*parts: Any) -> int:
    """A stable 64-bit hash (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


def _unit(key: str) -> float:
    return _h(key) / 2**64


def _affine(n_slots: int, run_seed: int, window: int) -> tuple[int, int]:
    """Multiplier coprime with n_slots and an offset: j -> (a·j + b) mod n_slots is a bijection."""
    a = _h("mul", run_seed, window) % n_slots or 1
    while math.gcd(a, n_slots) != 1:
        a = a + 1 if a + 1 < n_slots else 1
    return a, _h("add", run_seed, window) % n_slots


def _stack(split: TokenSplit, starts: Iterable[int], length: int) -> Tensor:
    rows = [split.read(int(s), length).astype(np.int64) for s in starts]
    return torch.from_numpy(np.stack(rows))


def assigned_batches(
    dataset: TokenDataset,
    run_seed: int,
    peer: str | int,
    window: int,
    n_steps: int,
    batch_size: int,
    seq_len: int,
) -> list[Tensor]:
    """The ``n_steps`` batches [batch_size, seq_len + 1] (int64, CPU) peer ``peer`` trains on in ``window``."""
    span = seq_len + 1
    n_slots = (len(dataset.train) - span) // span
    per_peer = n_steps * batch_size
    n_lanes = n_slots // per_peer
    if n_lanes < 1:
        raise ConfigError(f"train split of {len(dataset.train)} tokens is too small for {per_peer} sequences")
    if isinstance(peer, int):
        if not 0 <= peer < n_lanes:
            raise ConfigError(f"integer peer lane {peer} outside 0..{n_lanes - 1}")
        lane = peer
    else:
        lane = _h("lane", run_seed, window, peer) % n_lanes
    a, b = _affine(n_slots, run_seed, window)
    shift = _h("shift", run_seed, window) % span
    j = np.arange(lane * per_peer, (lane + 1) * per_peer, dtype=np.int64)
    slots = (a * j + b) % n_slots  # a·j < 2^63 for any dataset below ~3·10^9 slots
    tokens = _stack(dataset.train, shift + slots * span, span)
    return list(torch.split(tokens, batch_size))


def random_batches(dataset: TokenDataset, seed: int, n_batches: int, batch_size: int, seq_len: int) -> list[Tensor]:
    """Uniformly random train sequences from ``seed`` (the validator's reference batches)."""
    gen = np.random.default_rng(_h("random", seed))
    starts = gen.integers(0, len(dataset.train) - seq_len - 1, size=n_batches * batch_size)
    return list(torch.split(_stack(dataset.train, starts, seq_len + 1), batch_size))


def validation_batches(dataset: TokenDataset, n_sequences: int, batch_size: int, seq_len: int) -> list[Tensor]:
    """A fixed set of held-out sequences, evenly spaced over the val split (same for everyone)."""
    span = seq_len + 1
    n_slots = len(dataset.val) // span
    if n_slots < 1:
        raise ConfigError(f"validation split of {len(dataset.val)} tokens is shorter than one sequence")
    n = min(n_sequences, n_slots)
    starts = (np.arange(n, dtype=np.int64) * n_slots // n) * span
    return list(torch.split(_stack(dataset.val, starts, span), batch_size))


def pipeline_data_key(group: str) -> str:
    """The name under which a pipeline replica's batches are assigned (for
    :func:`assigned_batches`): every stage of replica ``group`` trains on the same batches, and
    the validator scores each stage's contribution on them."""
    return f"pipeline:{group}"
