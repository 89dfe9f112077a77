"""Tokenizers: byte-level by default (no download), a Hugging Face ``tokenizer.json`` when asked.

``load_tokenizer("bytes")`` maps UTF-8 bytes to ids 0..255; byte 0 (absent from source text) ends a
document. ``load_tokenizer("path/to/tokenizer.json")`` uses the ``tokenizers`` package, imported
only then, so the default install needs nothing beyond torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

from protocol.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    name: str  # stable identifier, part of shard indexes and cache keys
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
        digest = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        self.name = f"hf:{digest}"
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

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` or a path to a ``tokenizer.json``."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    raise ConfigError(f"unknown tokenizer {spec!r}: use 'bytes' or a path to a tokenizer.json")
