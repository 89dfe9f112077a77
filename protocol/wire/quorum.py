"""The signed objects of several validators: a proposal, an endorsement, an objection, a certificate.

With more than one validator (:mod:`protocol.quorum`) an aggregate reaches peers in four steps:

``Proposal`` (by the view's leader, ``<run>/proposal/<t>/<validator id>``)
    body: view, the clip caps it applied to every accepted contribution (per tensor: norm cap and
    row cap, either of them off (infinite), row length, and the rows capped below the row cap, the
    rows held back at 0 among them; peers and tensors sorted); payload: the leader's signed
    :class:`~protocol.wire.aggregate.Aggregate` (Δ̄ in its published form, the manifest of
    contributions by digest with their weights, θ_{t+1}'s fingerprint, the scoring seed reveal).
    Everything another validator needs to recompute Δ̄ and θ_{t+1} bit for bit.
``Endorsement`` (by each validator that signs it, ``<run>/endorsement/<t>/<validator id>``)
    body: view, proposer, the aggregate's digest. A validator writes at most one per window.
``Objection`` (``<run>/objection/<t>/<validator id>/<proposer id>``)
    body: view, proposer, the aggregate's digest, and the reasons: which check failed, for which
    contribution, with the numbers.
``Certificate`` (by any validator, ``<run>/aggregate/<t>``)
    body: m endorsements of one digest; payload: the aggregate. What peers read: one object, the
    aggregate and its m signatures (:func:`decode_certificate`).

    blob = encode_endorsement(Endorsement(run_hash, t, view, proposer, agg_digest), identity)
    e = decode_endorsement(blob, run_hash=h, allowed_signers=keys, window=t)
    cert = decode_certificate(data, run_hash=h, max_bytes=cap, allowed_signers=keys, quorum=m, window=t)
    cert.value.aggregate          # Verified[Aggregate], its digest the chain's next base
    cert.value.signers            # the validator ids whose endorsements it carries
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.aggregate import NormLimit
from protocol.errors import MalformedPayload, ProtocolError
from protocol.identity import PEER_ID_BYTES, Identity, peer_id_of
from protocol.wire.aggregate import Aggregate, decode_aggregate
from protocol.wire.fields import Reader, Schema, Writer, digest_to_bytes, read_peer_id, write_peer_id
from protocol.wire.frame import ENVELOPE_OVERHEAD, Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_signer, check_window_sender, verified

__all__ = [
    "MAX_ENDORSEMENT_BYTES",
    "MAX_OBJECTION_BYTES",
    "Caps",
    "Certificate",
    "Endorsement",
    "NoQuorum",
    "Objection",
    "Proposal",
    "Reason",
    "caps_of",
    "certificate_bytes",
    "decode_certificate",
    "decode_endorsement",
    "decode_objection",
    "decode_proposal",
    "encode_certificate",
    "encode_endorsement",
    "encode_objection",
    "encode_proposal",
    "limits_of",
]

MAX_ENDORSEMENT_BYTES = 1024
MAX_OBJECTION_BYTES = 64 << 10
MAX_REASONS = 64
MAX_LABEL_BYTES = 64  # a reason's check and peer (UTF-8 bytes)
MAX_DETAIL_BYTES = 512  # a reason's numbers: MAX_REASONS of the longest reasons fit MAX_OBJECTION_BYTES
MAX_VIEW = 1 << 20


class NoQuorum(ProtocolError):
    """A certificate without m valid endorsements of its aggregate by distinct validators."""

    reason = "no_quorum"


@dataclass(frozen=True)
class TensorCaps:
    """One contribution's caps on one tensor as :class:`~protocol.aggregate.NormLimit` applies them:
    ``rows`` lists only the rows capped below ``row`` (row index, cap)."""

    norm: float
    row: float
    row_len: int
    rows: tuple[tuple[int, float], ...] = ()


Caps = Mapping[str, Mapping[str, TensorCaps] | None]  # peer → tensor → caps (None: not clipped)


def caps_of(limits: Mapping[str, Mapping[str, NormLimit] | None]) -> dict[str, dict[str, TensorCaps] | None]:
    """The wire form of a window's clip caps (every peer's ``NormLimit`` per tensor)."""
    out: dict[str, dict[str, TensorCaps] | None] = {}
    for peer, per_tensor in limits.items():
        if per_tensor is None:
            out[peer] = None
            continue
        out[peer] = {name: _tensor_caps(lim) for name, lim in per_tensor.items()}
    return out


def _tensor_caps(lim: NormLimit) -> TensorCaps:
    rows: tuple[tuple[int, float], ...] = ()
    if lim.rows is not None and lim.row_len > 0:
        r = lim.rows.to(torch.float64)
        # under a row cap, the rows capped below it; without one, only the rows held back (cap 0)
        below = torch.nonzero(r < lim.row if lim.row > 0 else r == 0).flatten().tolist()
        rows = tuple((int(i), float(r[i])) for i in below)
    return TensorCaps(float(lim.norm), float(lim.row), int(lim.row_len), rows)


def limits_of(caps: Caps, schema: Schema) -> dict[str, dict[str, NormLimit] | None]:
    """The ``NormLimit`` every peer's contribution is clipped to, rebuilt from the wire form:
    ``min(row, rows[i])`` is the same cap the leader applied (MalformedPayload for caps on a
    tensor outside ``schema`` or a row outside it)."""
    out: dict[str, dict[str, NormLimit] | None] = {}
    for peer, per_tensor in caps.items():
        if per_tensor is None:
            out[peer] = None
            continue
        out[peer] = {name: _limit(name, c, schema) for name, c in per_tensor.items()}
    return out


def _limit(name: str, c: TensorCaps, schema: Schema) -> NormLimit:
    if name not in schema:
        raise MalformedPayload(f"caps for {name!r}, which is not a parameter of the model")
    if not c.rows:
        return NormLimit(c.norm, c.row, c.row_len)
    numel = 1
    for d in schema[name]:
        numel *= d
    if c.row_len <= 0 or numel % c.row_len:
        raise MalformedPayload(f"{name}: row caps with row length {c.row_len}")
    n_rows = numel // c.row_len
    dense = torch.full((n_rows,), c.row if c.row > 0 else float("inf"), dtype=torch.float64)
    for i, cap in c.rows:
        if not 0 <= i < n_rows:
            raise MalformedPayload(f"{name}: row cap for row {i} of {n_rows}")
        dense[i] = cap
    return NormLimit(c.norm, c.row, c.row_len, dense)


# ------------------------------------------------------------------------------ proposal
MAX_REFERENCE_BYTES = 4 << 20


@dataclass(frozen=True)
class Proposal:
    """A leader's aggregate of window ``aggregate.value.window`` in ``view``, with the caps it
    applied and ``reference``: the norm reference after the window (the validator's JSON form),
    whose sha256 the aggregate's signed metadata names, so that every validator continues from
    the same one."""

    view: int
    caps: Caps
    aggregate: Verified[Aggregate]
    reference: bytes = b""


def encode_proposal(
    view: int,
    caps: Caps,
    aggregate: bytes,
    window: int,
    run_hash: str,
    identity: Identity,
    reference: bytes = b"",
) -> bytes:
    """Sign a proposal around ``aggregate`` (the leader's signed aggregate bytes)."""
    w = Writer()
    w.varint(view)
    w.varint(len(caps))
    for peer in sorted(caps):
        write_peer_id(w, peer)
        per_tensor = caps[peer]
        w.u8(0 if per_tensor is None else 1)
        if per_tensor is None:
            continue
        w.varint(len(per_tensor))
        for name in sorted(per_tensor):
            c = per_tensor[name]
            w.text(name, 255)
            _write_caps(w, c.norm, c.row)
            w.varint(c.row_len)
            w.varint(len(c.rows))
            for i, cap in c.rows:
                w.varint(i)
                w.f64(cap)
    if len(reference) > MAX_REFERENCE_BYTES:
        raise MalformedPayload(f"a reference of {len(reference)} bytes, at most {MAX_REFERENCE_BYTES}")
    w.varint(len(reference))
    w.raw(reference)
    return seal(Kind.PROPOSAL, run_hash, window, identity, w.getvalue(), aggregate)


def decode_proposal(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Collection[bytes | str] | None,
    window: int | None = None,
    schema: Schema | None = None,
) -> Verified[Proposal]:
    """Verify a proposal and the aggregate inside it, signed by the same validator key for the same
    window (BadSignature / WrongWindow otherwise), plus the aggregate's own errors."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.PROPOSAL)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    r = Reader(env.body, "proposal")
    view = r.varint(MAX_VIEW)
    caps: dict[str, dict[str, TensorCaps] | None] = {}
    for _ in range(r.count(PEER_ID_BYTES + 1, 1 << 20, "capped contributions")):
        peer = read_peer_id(r)
        if caps and peer <= next(reversed(caps)):
            raise r.fail(f"caps of {peer} out of order or twice")
        clipped = r.u8()
        if clipped > 1:
            raise r.fail(f"caps of {peer}: flag {clipped}")
        caps[peer] = _read_tensor_caps(r) if clipped else None
    reference = bytes(r.take(r.varint(MAX_REFERENCE_BYTES)))
    r.end()
    agg = decode_aggregate(
        bytes(env.payload),
        run_hash=run_hash,
        max_bytes=max_bytes,
        allowed_signers=allowed_signers,
        window=env.window,
        schema=schema,
    )
    if agg.public_key != env.public_key:
        raise MalformedPayload(f"proposal by {peer_id_of(env.public_key)} carries an aggregate by {agg.sender}")
    return verified(Proposal(view, caps, agg, reference), env)


def _write_caps(w: Writer, norm: float, row: float) -> None:
    """A tensor's norm and row caps: a flags byte (bit 0: no norm cap, bit 1: no row cap above the
    per-row ones, i.e. an infinite cap, which an f64 field cannot hold), then each finite cap."""
    if math.isnan(norm) or math.isnan(row) or norm < 0 or row < 0:
        raise MalformedPayload(f"caps must be numbers >= 0, got norm {norm} and row {row}")
    w.u8(int(norm == math.inf) | int(row == math.inf) << 1)
    for cap in (norm, row):
        if cap != math.inf:
            w.f64(cap)


def _read_cap(r: Reader, off: bool) -> float:
    if off:
        return math.inf
    cap = r.f64()
    if cap < 0:
        raise r.fail(f"negative cap {cap}")
    return cap


def _read_tensor_caps(r: Reader) -> dict[str, TensorCaps]:
    out: dict[str, TensorCaps] = {}
    for _ in range(r.count(4, 1 << 14, "capped tensors")):
        name, flags = r.text(255), r.u8()
        if flags > 3:
            raise r.fail(f"caps of {name!r}: flags {flags}")
        norm, row, row_len = _read_cap(r, bool(flags & 1)), _read_cap(r, bool(flags & 2)), r.varint()
        rows = tuple((r.varint(), _read_cap(r, False)) for _ in range(r.count(9, 1 << 26, "row caps")))
        if out and name <= next(reversed(out)):
            raise r.fail(f"caps of {name!r} out of order or twice")
        if any(b[0] <= a[0] for a, b in zip(rows, rows[1:], strict=False)):
            raise r.fail(f"row caps of {name!r} are not sorted and unique")
        out[name] = TensorCaps(norm, row, row_len, rows)
    return out


# ------------------------------------------------------------------------------ endorsement
@dataclass(frozen=True)
class Endorsement:
    """A validator's signature of ``aggregate`` (a digest), proposed by ``proposer`` in ``view``."""

    run_hash: str
    window: int
    view: int
    proposer: str
    aggregate: str


def encode_endorsement(e: Endorsement, identity: Identity) -> bytes:
    w = Writer()
    w.varint(e.view)
    write_peer_id(w, e.proposer)
    w.raw(digest_to_bytes(e.aggregate))
    return seal(Kind.ENDORSEMENT, e.run_hash, e.window, identity, w.getvalue(), b"")


def decode_endorsement(
    data: bytes,
    *,
    run_hash: str | None,
    allowed_signers: Collection[bytes | str] | None,
    window: int | None = None,
    sender: str | None = None,
) -> Verified[Endorsement]:
    env = open_envelope(data, max_bytes=MAX_ENDORSEMENT_BYTES, run_hash=run_hash, kind=Kind.ENDORSEMENT)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, sender)
    r = Reader(env.body, "endorsement")
    view, proposer, digest = r.varint(MAX_VIEW), read_peer_id(r), r.digest()
    r.end()
    if len(env.payload):
        raise MalformedPayload("an endorsement has no payload")
    return verified(Endorsement(env.run_hash, env.window, view, proposer, digest), env)


# ------------------------------------------------------------------------------ objection
@dataclass(frozen=True)
class Reason:
    """Why a validator refused an aggregate: the ``check`` that failed, the contribution's ``peer``
    ("" for the aggregate as a whole) and the numbers (``detail``)."""

    check: str
    peer: str
    detail: str


@dataclass(frozen=True)
class Objection:
    """A validator's signed refusal of ``aggregate`` (a digest) proposed by ``proposer`` in ``view``."""

    run_hash: str
    window: int
    view: int
    proposer: str
    aggregate: str
    reasons: tuple[Reason, ...]


def encode_objection(o: Objection, identity: Identity) -> bytes:
    w = Writer()
    w.varint(o.view)
    write_peer_id(w, o.proposer)
    w.raw(digest_to_bytes(o.aggregate))
    reasons = o.reasons[:MAX_REASONS]
    w.varint(len(reasons))
    for reason in reasons:
        w.text(_clip_text(reason.check, MAX_LABEL_BYTES), MAX_LABEL_BYTES)
        w.text(_clip_text(reason.peer, MAX_LABEL_BYTES), MAX_LABEL_BYTES)
        w.text(_clip_text(reason.detail, MAX_DETAIL_BYTES), MAX_DETAIL_BYTES)
    return seal(Kind.OBJECTION, o.run_hash, o.window, identity, w.getvalue(), b"")


def _clip_text(text: str, max_bytes: int) -> str:
    """``text`` if its UTF-8 form fits ``max_bytes``, else its longest prefix that fits with "…"."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[: max_bytes - len("…".encode())].decode("utf-8", errors="ignore") + "…"


def decode_objection(
    data: bytes,
    *,
    run_hash: str | None,
    allowed_signers: Collection[bytes | str] | None,
    window: int | None = None,
    sender: str | None = None,
) -> Verified[Objection]:
    env = open_envelope(data, max_bytes=MAX_OBJECTION_BYTES, run_hash=run_hash, kind=Kind.OBJECTION)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, sender)
    r = Reader(env.body, "objection")
    view, proposer, digest = r.varint(MAX_VIEW), read_peer_id(r), r.digest()
    reasons = tuple(
        Reason(r.text(MAX_LABEL_BYTES), r.text(MAX_LABEL_BYTES), r.text(MAX_DETAIL_BYTES))
        for _ in range(r.count(3, MAX_REASONS, "reasons"))
    )
    r.end()
    return verified(Objection(env.run_hash, env.window, view, proposer, digest, reasons), env)


# ------------------------------------------------------------------------------ certificate
@dataclass(frozen=True)
class Certificate:
    """An aggregate with the endorsements of ``signers`` (≥ m distinct validator ids) of its digest."""

    aggregate: Verified[Aggregate]
    signers: tuple[str, ...]


def certificate_bytes(max_aggregate_bytes: int, n_validators: int) -> int:
    """The read cap of a certificate: the aggregate's plus n endorsements and the frame."""
    return max_aggregate_bytes + n_validators * (MAX_ENDORSEMENT_BYTES + 8) + ENVELOPE_OVERHEAD + 16


def encode_certificate(
    aggregate: bytes, endorsements: Sequence[bytes], window: int, run_hash: str, identity: Identity
) -> bytes:
    w = Writer()
    w.varint(len(endorsements))
    for e in endorsements:
        w.varint(len(e))
        w.raw(e)
    return seal(Kind.CERTIFICATE, run_hash, window, identity, w.getvalue(), aggregate)


def decode_certificate(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Collection[bytes | str] | None,
    quorum: int,
    window: int | None = None,
    schema: Schema | None = None,
) -> Verified[Certificate]:
    """Verify a certificate: written by a validator key, an aggregate that verifies, and at least
    ``quorum`` endorsements of exactly its digest by distinct allowed keys (NoQuorum otherwise;
    endorsements of other digests or windows are ignored, not counted). The digest a reader chains
    on is the aggregate's, whichever validator wrote the certificate."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.CERTIFICATE)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    agg = decode_aggregate(
        bytes(env.payload),
        run_hash=run_hash,
        max_bytes=max_bytes,
        allowed_signers=allowed_signers,
        window=env.window,
        schema=schema,
    )
    r = Reader(env.body, "certificate")
    signers: list[str] = []
    for _ in range(r.count(ENVELOPE_OVERHEAD, 1 << 10, "endorsements")):
        blob = bytes(r.take(r.varint(MAX_ENDORSEMENT_BYTES)))
        try:
            e = decode_endorsement(blob, run_hash=env.run_hash, allowed_signers=allowed_signers, window=env.window)
        except ProtocolError:
            continue
        if e.value.aggregate == agg.digest and e.sender not in signers:
            signers.append(e.sender)
    r.end()
    if len(signers) < quorum:
        raise NoQuorum(f"aggregate {agg.digest[:16]} of window {env.window} has {len(signers)} of {quorum} signatures")
    return verified(Certificate(agg, tuple(sorted(signers))), env)
