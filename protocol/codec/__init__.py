"""Chunk-wise Top-k with 2-bit values and coded indices: ``encode``/``decode`` and the payload bytes."""

from protocol.codec.sparse import (
    Encoded,
    decode,
    encode,
    pack,
    to_sparse,
    unpack,
)

__all__ = [
    "Encoded",
    "encode",
    "decode",
    "to_sparse",
    "pack",
    "unpack",
]
