"""A peer's signed, compressed pseudo-gradient for one window.

Body: base (aggregate digest or GENESIS), codec parameters, metadata, tensor table (one payload
length per tensor). Payload: :func:`protocol.codec.pack` of every tensor, in name order.

    blob = encode_contribution(Contribution(run_hash, window, base, spec.codec_at(window), encoded, meta), identity)
    c = decode_contribution(blob, run_hash=spec.hash(), max_bytes=cap, window=w, schema=shapes,
                            partial=True, codec_cfg=spec.codec_at(w))   # a stage may send a subset
    c.digest, c.sender, c.value.tensors["tok_emb.weight"]      # Encoded, ready for codec.decode
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol.codec import Encoded, pack, unpack
from protocol.config import CodecConfig
from protocol.errors import MalformedPayload, ProtocolError, SchemaMismatch, StaleBase, UnsupportedVersion
from protocol.identity import Identity
from protocol.wire.fields import (
    DTYPE_FLOAT32,
    Metadata,
    Reader,
    Schema,
    TensorEntry,
    Writer,
    check_dtype,
    check_schema,
    read_base,
    read_codec,
    read_metadata,
    read_table,
    shape_numel,
    split_payload,
    write_base,
    write_codec,
    write_metadata,
    write_table,
)
from protocol.wire.frame import Envelope, Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_window_sender, verified


@dataclass(frozen=True)
class Contribution:
    """A peer's compressed pseudo-gradient for one window. ``base``: aggregate digest or GENESIS."""

    run_hash: str
    window: int
    base: str
    codec: CodecConfig
    tensors: Mapping[str, Encoded]
    metadata: Metadata = field(default_factory=dict)

    @property
    def nnz(self) -> int:
        return sum(int(e.nnz) for e in self.tensors.values())


def encode_contribution(c: Contribution, identity: Identity) -> bytes:
    """Sign and serialize a contribution (tensors in name order; every ``Encoded`` uses ``c.codec``)."""
    names = sorted(c.tensors)
    blobs = []
    for name in names:
        if c.tensors[name].cfg != c.codec:
            raise MalformedPayload(f"{name}: encoded with another codec config than the contribution's")
        blobs.append(pack(c.tensors[name]))
    table = [TensorEntry(n, tuple(c.tensors[n].shape), DTYPE_FLOAT32, (len(b),)) for n, b in zip(names, blobs)]
    w = Writer()
    write_base(w, c.base)
    write_codec(w, c.codec)
    write_metadata(w, c.metadata)
    write_table(w, table)
    return seal(Kind.CONTRIBUTION, c.run_hash, c.window, identity, w.getvalue(), b"".join(blobs))


def decode_contribution(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    window: int | None = None,
    sender: str | None = None,
    base: str | None = None,
    schema: Schema | None = None,
    partial: bool = False,
    codec_cfg: CodecConfig | None = None,
) -> Verified[Contribution]:
    """Verify and parse a contribution.

    Raises PayloadTooLarge, UnsupportedVersion, MalformedPayload, BadSignature (also when signed by
    another peer than ``sender``), WrongRun, WrongWindow, StaleBase (``base`` differs),
    SchemaMismatch (tensor names/shapes vs ``schema``; codec params vs ``codec_cfg`` with reason
    ``wrong_codec``) and whatever
    ``codec.unpack`` raises for a bad tensor payload (InvalidIndices, NonFiniteValues ...).
    ``None`` skips the corresponding check. ``partial=True`` accepts a subset of ``schema``
    (pipeline stages). Pass ``schema`` when you can: shapes are then checked before the codec
    builds anything for them.
    """
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.CONTRIBUTION)
    check_window_sender(env, window, sender)
    return parse_contribution(env, base=base, schema=schema, partial=partial, codec_cfg=codec_cfg)


def parse_contribution(
    env: Envelope,
    *,
    base: str | None = None,
    schema: Schema | None = None,
    partial: bool = False,
    codec_cfg: CodecConfig | None = None,
) -> Verified[Contribution]:
    """The contribution inside ``env``, an envelope of kind CONTRIBUTION that
    :func:`~protocol.wire.frame.open_envelope` verified: what :func:`decode_contribution` does after
    the envelope checks, for a caller that looks at the envelope first (who signed it, for which
    run and window). Same errors and arguments."""
    if env.kind != Kind.CONTRIBUTION:
        raise UnsupportedVersion(f"expected kind contribution, found {env.kind.label}")
    c_base, cfg, metadata, table = read_header(env.body)
    if base is not None and c_base != base:
        raise StaleBase(f"trained from {c_base[:16]}, current aggregate is {base[:16]}")
    if codec_cfg is not None and cfg != codec_cfg:
        raise SchemaMismatch(f"codec parameters {cfg} differ from the run's {codec_cfg}", reason="wrong_codec")
    check_schema(table, schema, partial)
    tensors: dict[str, Encoded] = {}
    for t, blob in zip(table, split_payload(env.payload, [t.lengths[0] for t in table])):
        check_dtype(t)
        tensors[t.name] = unpack_tensor(t, blob, cfg)
    return verified(Contribution(env.run_hash, env.window, c_base, cfg, tensors, metadata), env)


def read_header(body: bytes | memoryview) -> tuple[str, CodecConfig, Metadata, list[TensorEntry]]:
    """(base, codec, metadata, tensor table) of a contribution's body (MalformedPayload ...)."""
    r = Reader(body, "contribution header")
    c_base = read_base(r)
    cfg = read_codec(r)
    metadata = read_metadata(r)
    table = read_table(r, n_lengths=1)
    r.end()
    return c_base, cfg, metadata, table


def unpack_tensor(t: TensorEntry, blob: memoryview, cfg: CodecConfig) -> Encoded:
    """One codec payload of a tensor table row (contributions, re-compressed aggregates)."""
    # Every chunk costs the codec at least one payload byte, so a shape far larger than its payload
    # is rejected here, before the codec builds per-chunk tables for it (inspect has no schema).
    if shape_numel(t.shape) > max(cfg.block * cfg.block, cfg.chunk_1d) * (len(blob) + 1):
        raise MalformedPayload(f"tensor {t.name}: shape {t.shape} cannot fit in {len(blob)} payload bytes")
    try:
        return unpack(bytes(blob), t.shape, cfg)
    except ProtocolError as exc:
        raise type(exc)(f"tensor {t.name}: {exc.args[0] if exc.args else exc}", reason=exc.reason) from exc
    except (ValueError, IndexError, RuntimeError, OverflowError) as exc:
        # A codec bug must not crash a validator on hostile bytes; record it as malformed.
        raise MalformedPayload(f"tensor {t.name}: payload rejected by the codec ({exc})") from exc
