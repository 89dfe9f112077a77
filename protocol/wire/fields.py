"""Binary vocabulary of object bodies: a bounds-checked Reader/Writer and the typed fields built on it.

Integers are LEB128 varints (canonical form only), strings are varint-length-prefixed UTF-8, floats
are little-endian f64. Lists whose order carries no meaning (metadata, codec parameters, tensor
tables) are written sorted and read back only if sorted and unique, so that every value has exactly
one encoding. Every count is checked against the bytes left before a loop or allocation runs.

The per-kind modules (:mod:`protocol.wire.contribution`, :mod:`~protocol.wire.aggregate`,
:mod:`~protocol.wire.checkpoint`, :mod:`~protocol.wire.announcement`) build their bodies from these.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.config import CodecConfig
from protocol.errors import ConfigError, MalformedPayload, PayloadTooLarge, SchemaMismatch
from protocol.identity import PEER_ID_BYTES, is_peer_id

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def digest_to_bytes(text: str, *, what: str = "digest") -> bytes:
    """64 hex chars -> 32 bytes; MalformedPayload otherwise."""
    if not isinstance(text, str) or not _HEX64.fullmatch(text):
        raise MalformedPayload(f"{what} must be 64 hex characters")
    return bytes.fromhex(text)


class Writer:
    """Append-only builder for bodies: fixed-width ints, LEB128 varints, short strings."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def getvalue(self) -> bytes:
        return b"".join(self._parts)

    def raw(self, b: bytes) -> None:
        self._parts.append(bytes(b))

    def u8(self, v: int) -> None:
        self._parts.append(struct.pack("<B", v))

    def f64(self, v: float) -> None:
        if not math.isfinite(v):
            raise MalformedPayload(f"cannot encode non-finite number {v}")
        self._parts.append(struct.pack("<d", v))

    def varint(self, v: int) -> None:
        if v < 0 or v >= 2**63:
            raise MalformedPayload(f"cannot encode {v} as a varint")
        out = bytearray()
        while True:
            byte = v & 0x7F
            v >>= 7
            if v:
                out.append(byte | 0x80)
            else:
                out.append(byte)
                break
        self._parts.append(bytes(out))

    def text(self, s: str, max_len: int = 255) -> None:
        raw = s.encode("utf-8")
        if len(raw) > max_len:
            raise MalformedPayload(f"string of {len(raw)} bytes exceeds {max_len}")
        self.varint(len(raw))
        self._parts.append(raw)


class Reader:
    """Bounds-checked cursor over a body. Every failure is a MalformedPayload with the position."""

    def __init__(self, data: memoryview | bytes, what: str = "body") -> None:
        self._v = memoryview(data)
        self._pos = 0
        self._what = what

    @property
    def remaining(self) -> int:
        return len(self._v) - self._pos

    def fail(self, msg: str) -> MalformedPayload:
        return MalformedPayload(f"{self._what} at byte {self._pos}: {msg}")

    def take(self, n: int) -> memoryview:
        if n < 0 or n > self.remaining:
            raise self.fail(f"needs {n} bytes, {self.remaining} left")
        out = self._v[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        return int(self.take(1)[0])

    def f64(self) -> float:
        """A finite little-endian f64 (NaN and infinities are refused)."""
        (v,) = struct.unpack("<d", self.take(8))
        if not math.isfinite(v):
            raise self.fail("non-finite number")
        return float(v)

    def varint(self, max_value: int = 2**63 - 1) -> int:
        """LEB128, canonical form only (no redundant trailing zero groups), ≤ ``max_value``."""
        value = 0
        for i in range(10):
            byte = self.u8()
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                if byte == 0 and i > 0:
                    raise self.fail("non-canonical varint")
                if value > max_value:
                    raise self.fail(f"value {value} exceeds {max_value}")
                return value
        raise self.fail("varint longer than 10 bytes")

    def count(self, min_item_bytes: int, max_items: int, what: str) -> int:
        """An item count, rejected before any loop when the items could not fit in what is left."""
        n = self.varint(max_items)
        if n * min_item_bytes > self.remaining:
            raise self.fail(f"{n} {what} cannot fit in {self.remaining} bytes")
        return n

    def text(self, max_len: int = 255) -> str:
        n = self.varint(max_len)
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise self.fail("string is not UTF-8") from None

    def digest(self) -> str:
        return bytes(self.take(32)).hex()

    def end(self) -> None:
        if self.remaining:
            raise self.fail(f"{self.remaining} unexpected trailing bytes")


# ------------------------------------------------------------------------------ body fields
# Small typed values used by the bodies: metadata and codec parameters are (name, tag, value)
# lists; names are sorted and unique so every value has exactly one encoding.
GENESIS = "genesis"
_GENESIS_RAW = bytes(32)  # the "digest" a first-window object trains from
_TAG_INT, _TAG_FLOAT, _TAG_STR, _TAG_BOOL = 0, 1, 2, 3
MAX_METADATA = 64
MAX_TENSORS = 1 << 14
MAX_NDIM = 8
MAX_DIM = 2**32 - 1
MAX_NUMEL = 2**40

Scalar = int | float | str | bool
Metadata = Mapping[str, Scalar]


def write_base(w: Writer, base: str) -> None:
    w.raw(_GENESIS_RAW if base == GENESIS else digest_to_bytes(base, what="base digest"))


def read_base(r: Reader) -> str:
    raw = bytes(r.take(32))
    return GENESIS if raw == _GENESIS_RAW else raw.hex()


def write_peer_id(w: Writer, peer_id: str) -> None:
    if not is_peer_id(peer_id):
        raise MalformedPayload(f"not a peer id: {peer_id!r}")
    w.raw(base64.b32decode(peer_id.upper()))


def read_peer_id(r: Reader) -> str:
    return base64.b32encode(bytes(r.take(PEER_ID_BYTES))).decode("ascii").lower()


def write_fields(w: Writer, values: Mapping[str, Scalar], max_items: int = MAX_METADATA) -> None:
    if len(values) > max_items:
        raise MalformedPayload(f"{len(values)} fields exceed {max_items}")
    w.varint(len(values))
    for key in sorted(values):
        v = values[key]
        w.text(key, 64)
        if isinstance(v, bool):
            w.u8(_TAG_BOOL)
            w.u8(int(v))
        elif isinstance(v, int):
            w.u8(_TAG_INT)
            w.varint(_zigzag(v))
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise MalformedPayload(f"field {key!r} is not finite")
            w.u8(_TAG_FLOAT)
            w.f64(v)
        elif isinstance(v, str):
            w.u8(_TAG_STR)
            w.text(v, 1024)
        else:
            raise MalformedPayload(f"field {key!r} has unsupported type {type(v).__name__}")


def read_fields(r: Reader, max_items: int = MAX_METADATA) -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    prev = None
    for _ in range(r.count(3, max_items, "fields")):
        key = r.text(64)
        if prev is not None and key <= prev:
            raise r.fail(f"field {key!r} out of order or duplicated")
        prev = key
        tag = r.u8()
        if tag == _TAG_BOOL:
            b = r.u8()
            if b > 1:
                raise r.fail("bad boolean")
            out[key] = bool(b)
        elif tag == _TAG_INT:
            out[key] = _unzigzag(r.varint())
        elif tag == _TAG_FLOAT:
            out[key] = r.f64()
        elif tag == _TAG_STR:
            out[key] = r.text(1024)
        else:
            raise r.fail(f"unknown field type {tag}")
    return out


write_metadata, read_metadata = write_fields, read_fields

# The validator's clock: every aggregate and checkpoint manifest carries ``published_at`` (unix
# seconds: when the window after the aggregate, or the checkpoint's window, opened). It travels as
# one of the metadata fields, so those bodies stay one sorted field list.
PUBLISHED_AT = "published_at"


def write_published_metadata(w: Writer, published_at: float, metadata: Metadata) -> None:
    """``metadata`` with ``published_at`` added as an f64 field (``metadata`` must not hold it)."""
    if PUBLISHED_AT in metadata:
        raise MalformedPayload(f"{PUBLISHED_AT} is given on its own, not in the metadata")
    if not (math.isfinite(published_at) and published_at >= 0):
        raise MalformedPayload(f"{PUBLISHED_AT} {published_at} is not a time")
    write_metadata(w, {**metadata, PUBLISHED_AT: float(published_at)})


def read_published_metadata(r: Reader) -> tuple[float, dict[str, Scalar]]:
    """(``published_at``, the other metadata); MalformedPayload unless ``published_at`` is there,
    written as its one encoding (a non-negative f64)."""
    metadata = read_metadata(r)
    published_at = metadata.pop(PUBLISHED_AT, None)
    if not isinstance(published_at, float) or published_at < 0:
        raise r.fail(f"no {PUBLISHED_AT} time in the signed metadata")
    return published_at, metadata


# Bounds on codec parameters an object may carry. The chunk geometry of a shape costs up to
# ``block`` steps (the largest divisor search), so a huge block from the network would stall a
# decoder; these are far above any useful setting (64×64 tiles and runs of 4096 by default).
MAX_CODEC_BLOCK = 1024
MAX_CODEC_CHUNK_1D = 1 << 20


def _check_codec_bounds(cfg: CodecConfig) -> None:
    if cfg.block > MAX_CODEC_BLOCK or cfg.chunk_1d > MAX_CODEC_CHUNK_1D:
        raise MalformedPayload(
            f"codec block {cfg.block} / chunk_1d {cfg.chunk_1d} exceed {MAX_CODEC_BLOCK} / {MAX_CODEC_CHUNK_1D}"
        )


def write_codec(w: Writer, cfg: CodecConfig) -> None:
    _check_codec_bounds(cfg)
    write_fields(w, {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


def read_codec(r: Reader) -> CodecConfig:
    """Codec parameters: exactly the fields of :class:`CodecConfig`, each of its declared type."""
    values = read_fields(r)
    expected = {f.name: type(getattr(CodecConfig(), f.name)) for f in dataclasses.fields(CodecConfig)}
    if set(values) != set(expected):
        raise MalformedPayload(f"codec parameters {sorted(values)} differ from {sorted(expected)}")
    for name, tp in expected.items():
        if type(values[name]) is not tp:
            raise MalformedPayload(f"codec parameter {name} must be {tp.__name__}")
    checked: dict[str, Any] = values  # each value is now of its field's type, which mypy cannot follow
    try:
        cfg = CodecConfig(**checked)
    except ConfigError as exc:
        raise MalformedPayload(f"invalid codec parameters: {exc}") from None
    _check_codec_bounds(cfg)
    return cfg


# ------------------------------------------------------------------------------ tensor tables
Shape = tuple[int, ...]
Schema = Mapping[str, Shape]  # parameter name -> shape, e.g. ``protocol.model.param_schema(...)``
DTYPE_FLOAT32 = 0  # the only dtype on the wire today: decoded deltas are float32


@dataclass(frozen=True)
class TensorEntry:
    """One row of a tensor table: name, shape, dtype code and per-kind lengths."""

    name: str
    shape: Shape
    dtype: int
    lengths: tuple[int, ...]


def write_table(w: Writer, table: Sequence[TensorEntry]) -> None:
    """Rows must be sorted by name and unique. A name is written as the number of leading and
    trailing bytes it shares with the previous name plus the bytes in between, so that 75 LLaMA
    names ("blocks.3.attn.wq.weight" after "blocks.3.attn.wk.weight" costs 4 bytes) take ~0.4 KB."""
    if len(table) > MAX_TENSORS:
        raise MalformedPayload(f"{len(table)} tensors exceed {MAX_TENSORS}")
    w.varint(len(table))
    prev = b""
    for t in table:  # callers order rows and payloads alike: by name (UTF-8 order = code point order)
        name = t.name.encode("utf-8")
        if not name or len(name) > 255 or name <= prev or len(t.shape) > MAX_NDIM:
            raise MalformedPayload(f"cannot encode tensor {t.name!r} with shape {t.shape}")
        head, tail = _shared(prev, name)
        w.varint(head)
        w.varint(tail)
        w.varint(len(name) - head - tail)
        w.raw(name[head : len(name) - tail])
        w.u8(len(t.shape))
        for d in t.shape:
            w.varint(d)
        w.u8(t.dtype)
        for n in t.lengths:
            w.varint(n)
        prev = name


def read_table(r: Reader, n_lengths: int) -> list[TensorEntry]:
    out: list[TensorEntry] = []
    prev = b""
    for _ in range(r.count(5 + n_lengths, MAX_TENSORS, "tensors")):
        head = r.varint(len(prev))
        tail = r.varint(len(prev) - head)
        name = prev[:head] + bytes(r.take(r.varint(255 - head - tail))) + prev[len(prev) - tail :]
        if not name:
            raise r.fail("empty tensor name")
        if name == prev:
            raise SchemaMismatch(f"duplicate tensor {name.decode('utf-8', 'replace')!r}")
        if name < prev:
            raise r.fail("tensor table not sorted by name")
        if _shared(prev, name) != (head, tail):
            raise r.fail("tensor name not coded in its one canonical form")
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise r.fail("tensor name is not UTF-8") from None
        ndim = r.u8()
        if ndim > MAX_NDIM:
            raise r.fail(f"{text}: {ndim} dimensions")
        shape = tuple(r.varint(MAX_DIM) for _ in range(ndim))
        if math.prod(shape) > MAX_NUMEL:
            raise PayloadTooLarge(f"{text}: shape {shape} is too large")
        dtype = r.u8()
        lengths = tuple(r.varint(2**40) for _ in range(n_lengths))
        out.append(TensorEntry(text, shape, dtype, lengths))
        prev = name
    return out


def check_schema(table: Sequence[TensorEntry], schema: Schema | None, partial: bool = False) -> None:
    """SchemaMismatch unless every row is a tensor of ``schema`` with its shape and, unless
    ``partial``, every tensor of ``schema`` has a row. ``None`` checks nothing."""
    if schema is None:
        return
    names = {t.name for t in table}
    missing, unknown = [] if partial else sorted(set(schema) - names), sorted(names - set(schema))
    if missing or unknown:
        raise SchemaMismatch(f"missing tensors {missing[:5]}, unknown tensors {unknown[:5]}")
    for t in table:
        if tuple(schema[t.name]) != t.shape:
            raise SchemaMismatch(f"{t.name}: shape {t.shape}, expected {tuple(schema[t.name])}")


def check_dtype(t: TensorEntry) -> None:
    if t.dtype != DTYPE_FLOAT32:
        raise MalformedPayload(f"{t.name}: unknown dtype code {t.dtype}")


def split_payload(payload: memoryview, lengths: Sequence[int]) -> list[memoryview]:
    """Cut the payload into consecutive sections of ``lengths`` bytes, which must add up to all of it."""
    if sum(lengths) != len(payload):
        raise MalformedPayload(f"tensor table declares {sum(lengths)} payload bytes, object has {len(payload)}")
    out, pos = [], 0
    for n in lengths:
        out.append(payload[pos : pos + n])
        pos += n
    return out


def shape_numel(shape: Shape) -> int:
    return math.prod(shape)


def _shared(prev: bytes, name: bytes) -> tuple[int, int]:
    """Longest common prefix, then longest common suffix of what remains of both."""
    n = min(len(prev), len(name))
    head = 0
    while head < n and prev[head] == name[head]:
        head += 1
    tail = 0
    while tail < n - head and prev[-1 - tail] == name[-1 - tail]:
        tail += 1
    return head, tail


def _zigzag(v: int) -> int:
    if not -(2**62) <= v < 2**62:
        raise MalformedPayload(f"integer {v} out of range")
    return (v << 1) if v >= 0 else ((-v) << 1) - 1


def _unzigzag(v: int) -> int:
    return (v >> 1) if not v & 1 else -((v + 1) >> 1)
