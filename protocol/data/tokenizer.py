"""Tokenizers: byte-level by default (no download), a Hugging Face ``tokenizer.json`` when asked.

``load_tokenizer("bytes")`` maps UTF-8 bytes to ids 0..255; byte 0 (absent from source text) ends a
document. ``load_tokenizer("path/to/tokenizer.json")`` uses the ``tokenizers`` package, imported
only then, so the default install needs nothing beyond torch.

A run names its tokenizer in the RunSpec (``data.tokenizer``) by content: ``bytes``, or
``hf:<sha256 of the tokenizer.json>``, the file itself lying in the run's store
(:func:`protocol.data.run_data.run_tokenizer` fetches and verifies it into the data cache, where
``load_tokenizer("hf:<sha256>", cache=...)`` finds it). A tokenizer's :attr:`~Tokenizer.name` is
exactly that string.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Protocol

from protocol.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "tokenizer_digest"]

_HF_NAME = re.compile(r"hf:([0-9a-f]{64})")


class Tokenizer(Protocol):
    name: str  # stable identifier: "bytes" or "hf:<sha256>"; in the RunSpec, manifests and cache keys
    vocab_size: int
    eos_id: int | None  # appended after every document when not None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, document separator byte 0."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (``tokenizers`` package, imported lazily)."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("a tokenizer.json needs the 'tokenizers' package: pip install tokenizers") from exc
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"tokenizer file not found: {p}")
        self._tok: Any = _HF.from_file(str(p))
        self.path = p
        self.digest = hashlib.sha256(p.read_bytes()).hexdigest()
        self.name = f"hf:{self.digest}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> int | None:
        candidates = [eos_token] if eos_token else ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
        for tok in candidates:
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of every text, on the library's threads."""
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def tokenizer_digest(spec: str) -> str | None:
    """The sha256 of the tokenizer.json an ``hf:<sha256>`` name stands for (None for others)."""
    m = _HF_NAME.fullmatch(spec)
    return m.group(1) if m else None


def load_tokenizer(spec: str, *, cache: Path | None = None) -> ByteTokenizer | HFTokenizer:
    """``"bytes"``, a path to a ``tokenizer.json``, or ``"hf:<sha256>"``: that file as
    ``<cache>/<sha256>.json`` (where :func:`protocol.data.run_data.run_tokenizer` puts a run's)."""
    if spec == "bytes":
        return ByteTokenizer()
    digest = tokenizer_digest(spec)
    if digest is not None:
        path = (cache or Path(".")) / f"{digest}.json"
        if cache is None or not path.is_file():
            raise ConfigError(
                f"the tokenizer {spec[:19]}… is not on this machine: it lies in the run's store, "
                "from where the run's data is opened (protocol.data.run_data.run_tokenizer)"
            )
        tok = HFTokenizer(path)
        if tok.name != spec:
            raise ConfigError(f"{path} does not hash to {spec}: remove it, it is fetched again")
        return tok
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    raise ConfigError(f"unknown tokenizer {spec!r}: use 'bytes', 'hf:<sha256>' or a path to a tokenizer.json")
