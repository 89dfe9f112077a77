"""Tokenizer files of an exported model, for ``transformers.AutoTokenizer``.

A run on a Hugging Face ``tokenizer.json`` ships that file. A run on byte tokens gets a
``tokenizer.json`` built here with the ``tokenizers`` library that maps text exactly as
:class:`protocol.data.tokenizer.ByteTokenizer` does: UTF-8 byte ``b`` is token ``b``, for all 256 bytes.

It is a BPE model without merges whose vocabulary holds the byte tokens ``<0x01>`` … ``<0xFF>``
with ``byte_fallback``: every character is missing from the vocabulary, so it falls back to its
UTF-8 bytes. Token 0 is the character U+0000 itself, registered as the special end-of-document
token: byte 0 is the document separator of the byte tokenizer, and a U+0000 in the text is that
same byte, so the mapping stays exact. The decoder turns byte tokens back into text.

    files = tokenizer_files(run_tokenizer(spec, store), max_length=spec.model.max_seq_len)
    for name, data in files.items(): (out_dir / name).write_bytes(data)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol.data.tokenizer import ByteTokenizer, HFTokenizer
from protocol.errors import ConfigError

__all__ = ["byte_tokenizer", "eos_token", "tokenizer_files"]

BYTE_EOS = "\x00"  # the byte tokenizer's document separator as text


def byte_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to :class:`ByteTokenizer` (ids 0..255 = bytes)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models
    except ImportError as exc:
        raise ConfigError(
            "exporting a byte-token model writes a tokenizer.json with the 'tokenizers' package: pip install tokenizers"
        ) from exc
    vocab = {BYTE_EOS: 0, **{f"<0x{b:02X}>": b for b in range(1, 256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True, normalized=False)])
    return tok


def eos_token(tokenizer: ByteTokenizer | HFTokenizer) -> str | None:
    """The text of the end-of-document token, or None when the tokenizer has none."""
    if isinstance(tokenizer, ByteTokenizer):
        return BYTE_EOS
    if tokenizer.eos_id is None:
        return None
    from tokenizers import Tokenizer  # present: HFTokenizer loaded the file with it

    token = Tokenizer.from_file(str(tokenizer.path)).id_to_token(tokenizer.eos_id)
    return None if token is None else str(token)


def tokenizer_files(tokenizer: ByteTokenizer | HFTokenizer, *, max_length: int) -> dict[str, bytes]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, by file name
    (a run's Hugging Face tokenizer ships its own ``tokenizer.json``, byte for byte)."""
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer_json = byte_tokenizer().to_str().encode()
    else:
        tokenizer_json = Path(tokenizer.path).read_bytes()
    eos = eos_token(tokenizer)
    special = {"eos_token": eos, "pad_token": eos} if eos is not None else {}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(special),
    }


def _json(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
