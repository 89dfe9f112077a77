"""A corpus as documents, and documents as a tokenized train/validation stream.

What ``sparseloco-validator init`` (and a local dataset) reads, by source name
(:func:`documents`)::

    builtin:stdlib    the Python standard library's .py source (tests excluded, capped at
                      STDLIB_CAP_BYTES), in an order hashed from the file names
    notes.txt         one document
    rows.jsonl        one document per line: the string under the text field (``text_field``)
    corpus/           every file below it, sorted: ``.jsonl`` files as JSONL, other UTF-8 text as
                      one document each; binary files are skipped

Documents are cut at line ends into ~16 KiB pieces, and each piece goes to the held-out ``val``
split by a hash of (document name, piece number), so the split does not depend on file order and
a single large file still splits (:func:`token_stream`). The end-of-document token follows a
document's last piece.

    for split, ids in token_stream(documents("builtin:stdlib"), tokenizer, val_fraction=0.02): ...
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from protocol.data.tokenizer import ByteTokenizer, HFTokenizer
from protocol.errors import ConfigError

__all__ = [
    "BUILTIN_STDLIB",
    "PIECE_BYTES",
    "STDLIB_CAP_BYTES",
    "documents",
    "jsonl_documents",
    "source_bytes",
    "stdlib_documents",
    "text_documents",
    "token_stream",
    "tokenize",
]

BUILTIN_STDLIB = "builtin:stdlib"
STDLIB_CAP_BYTES = 8 << 20
PIECE_BYTES = 1 << 14  # documents are assigned to train/val in pieces of this size
BATCH_PIECES = 256  # pieces a Hugging Face tokenizer encodes at once
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}

Document = tuple[str, bytes]  # (name, UTF-8 text)


# ----------------------------------------------------------------------------- sources
def stdlib_documents(cap_bytes: int = STDLIB_CAP_BYTES) -> Iterator[Document]:
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


def text_documents(path: str | Path) -> Iterator[Document]:
    """A text file, or every UTF-8 text file under a directory (binary files skipped), sorted."""
    root = Path(path)
    for p in _files(root):
        data = _text(p)
        if data is not None:
            yield _name(root, p), data


def jsonl_documents(path: str | Path, text_field: str = "text") -> Iterator[Document]:
    """One document per line of a JSONL file: the string under ``text_field`` (blank lines
    skipped). A line that is not a JSON object with that string is a ConfigError naming it."""
    p = Path(path)
    with p.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{p}:{n} is not JSON: {exc}") from exc
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{p}:{n} has no string field {text_field!r}")
            yield f"{p.name}:{n}", text.encode("utf-8")


def documents(source: str, text_field: str = "text") -> Iterator[Document]:
    """The documents of one source (see the module docstring); ConfigError when it is missing."""
    if source == BUILTIN_STDLIB:
        yield from stdlib_documents()
        return
    root = Path(source).expanduser()
    if not root.exists():
        raise ConfigError(f"corpus not found: {source!r}")
    for p in _files(root):
        if p.suffix == ".jsonl":
            for name, row in jsonl_documents(p, text_field):
                yield f"{_name(root, p)}:{name.rsplit(':', 1)[1]}", row
            continue
        text = _text(p)
        if text is not None:
            yield _name(root, p), text


def source_bytes(source: str) -> int:
    """The bytes a source holds (for progress): its files' sizes, or the stdlib cap."""
    if source == BUILTIN_STDLIB:
        return STDLIB_CAP_BYTES
    root = Path(source).expanduser()
    return sum(p.stat().st_size for p in _files(root)) if root.exists() else 0


def _files(root: Path) -> list[Path]:
    return [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())


def _name(root: Path, p: Path) -> str:
    return str(p.relative_to(root)) if p != root else p.name


def _text(p: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text (no NUL), else None."""
    data = p.read_bytes()
    if b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


# ----------------------------------------------------------------------------- tokens
def token_stream(
    docs: Iterable[Document], tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float
) -> Iterator[tuple[str, np.ndarray]]:
    """``(split, ids)`` for every piece of every document, in order (see the module docstring)."""
    batch: list[tuple[str, bytes, bool]] = []  # (split, piece, last piece of its document)
    for name, data in docs:
        parts = pieces(data)
        for i, piece in enumerate(parts):
            batch.append(("val" if _unit(f"val|{name}|{i}") < val_fraction else "train", piece, i == len(parts) - 1))
        if len(batch) >= BATCH_PIECES:
            yield from _tokenized(batch, tokenizer)
            batch = []
    yield from _tokenized(batch, tokenizer)


def _tokenized(
    batch: list[tuple[str, bytes, bool]], tokenizer: ByteTokenizer | HFTokenizer
) -> Iterator[tuple[str, np.ndarray]]:
    """The pieces of ``batch`` tokenized (a Hugging Face tokenizer encodes them in parallel)."""
    if isinstance(tokenizer, ByteTokenizer):
        for split, piece, last in batch:
            yield split, tokenize(tokenizer, piece, eos=last)
        return
    encoded = tokenizer.encode_batch([piece.decode("utf-8", errors="replace") for _, piece, _ in batch])
    for (split, _, last), ids in zip(batch, encoded):
        yield split, _with_eos(np.asarray(ids, dtype=np.int64), tokenizer, last)


def pieces(data: bytes) -> list[bytes]:
    """Cut a document at line ends into pieces of about PIECE_BYTES, so one big file still splits."""
    out, start = [], 0
    while len(data) - start > PIECE_BYTES:
        cut = data.rfind(b"\n", start, start + PIECE_BYTES) + 1 or start + PIECE_BYTES  # -1 + 1: no line end
        out.append(data[start:cut])
        start = cut
    out.append(data[start:])
    return out


def tokenize(tokenizer: ByteTokenizer | HFTokenizer, data: bytes, eos: bool = True) -> np.ndarray:
    """The ids of UTF-8 ``data``, followed by the end-of-document id when ``eos`` (and it has one)."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    else:
        ids = np.asarray(tokenizer.encode(data.decode("utf-8", errors="replace")), dtype=np.int64)
    return _with_eos(ids, tokenizer, eos)


def _with_eos(ids: np.ndarray, tokenizer: ByteTokenizer | HFTokenizer, eos: bool) -> np.ndarray:
    if eos and tokenizer.eos_id is not None:
        return np.append(ids, np.asarray([tokenizer.eos_id], dtype=ids.dtype))
    return ids


def _unit(key: str) -> float:
    """A stable number in [0, 1) (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") / 2**64
