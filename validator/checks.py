"""The cheap checks every contribution goes through, each a small pure function.

A check returns a :class:`~validator.log.CheckRow` ``(name, passed, reason)``; ``reason`` is the
stable name written to the contribution log. Order (the first failure decides the rejection
reason; later checks are not run; :data:`validator.reasons.CHECK_ORDER`, from the table of checks
and reasons in :mod:`validator.reasons`)::

    size  format  signature  run  window  registered  codec  schema  finite  sync  excluded
    immutable  norm  copy  score  probation  capacity  stable

``size`` … ``finite`` are mostly enforced by :func:`protocol.wire.decode_contribution` (given the
window, the run's codec and the model's schema, so a hostile tensor table is refused before the
codec allocates anything) and :func:`protocol.codec.unpack`; :func:`rows_for_error` maps the ``reason`` of the
:class:`~protocol.errors.ProtocolError` they raise to the check that failed.

**Blame only what a peer signed.** The bytes at ``contrib/<t>/<peer>`` may not be the peer's: on a
shared directory anyone can write there, and any store can be handed a copy of the peer's own
object of another window or run. Unless the object is signed by ``<peer>`` for this run and window
(``size`` through ``window``), it says nothing about the peer: it is rejected with reason
``foreign`` (:data:`~validator.reasons.FOREIGN`, neutral for reputation) and the detail says what
was found, instead of ``bad_signature`` or ``wrong_window`` against the peer. Everything after
that (a malformed body, the codec, the schema …) the peer signed, and is its own
(:mod:`validator.reputation`). ``screen`` runs the per-contribution checks on one received object;
the checks from ``immutable`` on need the log, the whole window, the loss evaluation or the
aggregate and live in :mod:`validator.window_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from protocol.aggregate import SparseDict, sparse_of
from protocol.config import CodecConfig
from protocol.errors import ProtocolError
from protocol.identity import peer_id_of
from protocol.wire import Contribution, Kind
from protocol.wire.contribution import parse_contribution
from protocol.wire.frame import Envelope, open_envelope
from validator.held import Held, hold
from validator.log import CheckRow
from validator.reasons import CHECK_ORDER, FOREIGN, REASONS
from validator.reference import Measured
from validator.sketch import Sketcher, offsets

__all__ = [
    "CHECK_ORDER",
    "Context",
    "Screened",
    "check_codec",
    "check_excluded",
    "check_finite",
    "check_registered",
    "check_schema",
    "check_size",
    "check_sync",
    "check_window",
    "foreign",
    "rows_for_error",
    "screen",
]


# ProtocolError.reason (raised while decoding) -> the check that failed: the reason's usual check
_REASON_CHECK = {r.name: r.checks[0] for r in REASONS if r.checks[0] in CHECK_ORDER}


_DECODE_CHECKS = ("size", "format", "signature", "run", "window", "codec")


def ok(name: str) -> CheckRow:
    return CheckRow(name, True, None)


def fail(name: str, reason: str) -> CheckRow:
    return CheckRow(name, False, reason)


def rows_for_error(reason: str, registered: CheckRow | None = None, *, signed: bool = False) -> tuple[CheckRow, ...]:
    """Check rows for a decode failure: every check before the failing one passed.

    Only checks decoding performs are claimed (it is given the window, codec and schema);
    ``registered``, when given, is the registration check's row and is placed in its turn (a
    failed one ends the rows: it decides the rejection). ``signed``: the envelope verified as the
    peer's, so a structural failure is in the body it signed (check ``schema``)."""
    name = _REASON_CHECK.get(reason, "format")
    if signed and name in ("size", "format", "signature"):
        name = "schema"
    rows: list[CheckRow] = []
    for n in CHECK_ORDER[: CHECK_ORDER.index(name)]:
        if n in _DECODE_CHECKS:
            rows.append(ok(n))
        elif n == "registered" and registered is not None:
            rows.append(registered)
            if not registered.passed:
                return tuple(rows)
    return (*rows, fail(name, reason))


# ---------------------------------------------------------------------------- single checks
def check_size(nbytes: int, max_bytes: int) -> CheckRow:
    return ok("size") if 0 < nbytes <= max_bytes else fail("size", "too_large" if nbytes > 0 else "empty")


def check_window(claimed: int, window: int) -> CheckRow:
    """A contribution signed for another window (a replay of an older one) is rejected."""
    return ok("window") if claimed == window else fail("window", "wrong_window")


def check_registered(peer: str, registered: Collection[str]) -> CheckRow:
    """The signer must have published a signed announcement (its key is registered)."""
    return ok("registered") if peer in registered else fail("registered", "unregistered")


def check_codec(cfg: CodecConfig, run_cfg: CodecConfig) -> CheckRow:
    return ok("codec") if cfg == run_cfg else fail("codec", "wrong_codec")


def check_schema(shapes: Mapping[str, tuple[int, ...]], schema: Mapping[str, tuple[int, ...]]) -> CheckRow:
    """Tensors must be a non-empty subset of the model's, each with the model's shape
    (pipeline stages send only their slice)."""
    if not shapes:
        return fail("schema", "empty_contribution")
    for name, shape in shapes.items():
        if name not in schema or tuple(schema[name]) != tuple(shape):
            return fail("schema", "schema_mismatch")
    return ok("schema")


def check_finite(sparse: SparseDict) -> CheckRow:
    for _, vals in sparse.values():
        if not bool(torch.isfinite(vals).all()):
            return fail("finite", "non_finite")
    return ok("finite")


def check_sync(base: str, expected_base: str, previous_base: str | None = None) -> CheckRow:
    """The contribution must have trained from the current aggregate (or genesis at window 0), or,
    in a run with ``outer.delay = 1``, from the one before it (``previous_base``): a peer trains
    window t while aggregate t−1 is still being published."""
    return ok("sync") if base in (expected_base, previous_base) else fail("sync", "stale_base")


def check_excluded(excluded: bool) -> CheckRow:
    return fail("excluded", "excluded") if excluded else ok("excluded")


# ---------------------------------------------------------------------------- one contribution
@dataclass(frozen=True, kw_only=True)
class Context:
    """What the per-contribution checks compare against in this window, and how a contribution
    that passes them is sampled (``sketch``; None: every position, :mod:`validator.sketch`)."""

    run_hash: str
    window: int
    expected_base: str
    previous_base: str | None = None  # also accepted (outer.delay = 1): the base of window − 1
    codec: CodecConfig
    schema: Mapping[str, tuple[int, ...]]
    max_bytes: int
    registered: frozenset[str] = frozenset()
    excluded: frozenset[str] = frozenset()
    sketch: Sketcher | None = None


@dataclass(frozen=True, kw_only=True)
class Screened:
    """A contribution after the per-contribution checks; ``reason`` None when all passed.
    ``held``: what the validator keeps of a contribution the peer signed for this run and window
    (:mod:`validator.held`; its digest goes into the aggregate's manifest), None otherwise."""

    peer: str
    checks: tuple[CheckRow, ...]
    reason: str | None
    detail: str | None = None
    held: Held | None = None
    overlap: float | None = None  # largest Top-k index overlap with an earlier upload
    weight: float = 1.0  # share of influence left after the copy check (validator.copies.influence)
    ties: tuple[tuple[str, float], ...] = ()  # similar uploads of unknown order: (peer, pair's weight)


def screen(peer: str, data: bytes, ctx: Context) -> Screened:
    """Run ``size`` … ``excluded`` on the bytes found at ``contrib/<window>/<peer>``. Pure.

    A contribution the peer signed is decoded once here and kept as a :class:`~validator.held.Held`
    (its bytes, norms and sampled entries), whatever the verdict."""
    size = check_size(len(data), ctx.max_bytes)
    if not size.passed:
        return foreign(peer, "size", f"{size.reason}: {len(data)} bytes, cap {ctx.max_bytes}")
    try:
        env = open_envelope(data, max_bytes=ctx.max_bytes, run_hash=None, kind=Kind.CONTRIBUTION)
    except ProtocolError as exc:  # not a signed object at all: nobody can be named
        return foreign(peer, rows_for_error(exc.reason)[-1].name, str(exc))
    attribution = _attribution(peer, env, ctx)
    if attribution is not None:
        return foreign(peer, *attribution)
    try:
        # With the window, codec and schema given, a hostile tensor table is refused before the
        # codec allocates anything for it; a subset of the schema is fine (pipeline stages).
        verified = parse_contribution(env, schema=ctx.schema, partial=True, codec_cfg=ctx.codec)
    except ProtocolError as exc:
        return _undecodable(peer, exc, ctx)
    c = verified.value
    rows = [ok("size"), ok("format"), ok("signature"), ok("run")]
    sparse: SparseDict = {}
    sk = ctx.sketch or Sketcher(offsets(ctx.schema))
    check: Callable[[], CheckRow]
    for check in (
        lambda: check_window(c.window, ctx.window),
        lambda: check_registered(peer, ctx.registered),
        lambda: check_codec(c.codec, ctx.codec),
        lambda: check_schema({n: tuple(e.shape) for n, e in c.tensors.items()}, ctx.schema),
        lambda: check_finite(sparse),
        lambda: check_sync(c.base, ctx.expected_base, ctx.previous_base),
        lambda: check_excluded(peer in ctx.excluded),
    ):
        row = check()
        rows.append(row)
        if not row.passed:
            held = Held(verified.digest, b"", 0, Measured({}, {}), sk.entries({}))  # its digest is logged
            return Screened(peer=peer, checks=tuple(rows), reason=row.reason, detail=_detail(row, c, ctx), held=held)
        if row.name == "schema":
            sparse = sparse_of(c.tensors)  # decoded once, after the shapes are known to be sane
    return Screened(
        peer=peer, checks=tuple(rows), reason=None, held=hold(data, verified.digest, sparse, ctx.schema, sk)
    )


def foreign(peer: str, check: str, detail: str) -> Screened:
    """An object at ``peer``'s key that ``peer`` did not sign for this run and window (module doc):
    rejected as ``foreign`` by ``check`` (the checks before it passed); the detail says what was found."""
    passed = tuple(ok(n) for n in CHECK_ORDER[: CHECK_ORDER.index(check)] if n in _DECODE_CHECKS)
    rows = (*passed, CheckRow(check, False, FOREIGN))
    return Screened(peer=peer, checks=rows, reason=FOREIGN, detail=f"not signed by this peer: {detail}")


def _attribution(peer: str, env: Envelope, ctx: Context) -> tuple[str, str] | None:
    """(check, what was found) when a verified envelope is not ``peer``'s object of this run and
    window; None when it is."""
    signer = peer_id_of(env.public_key)
    if signer != peer:
        return "signature", f"signed by {signer}"
    if env.run_hash != ctx.run_hash:
        return "run", f"signed for run {env.run_hash[:16]}, a copy from another run"
    if env.window != ctx.window:
        return "window", f"signed for window {env.window}, a copy from another window"
    return None


def _undecodable(peer: str, exc: ProtocolError, ctx: Context) -> Screened:
    """A contribution whose envelope is the peer's but whose body failed to decode (the peer signed
    it: a structural failure is check ``schema``); an unregistered sender is named as such when its
    check comes before the failing one."""
    rows = rows_for_error(exc.reason, check_registered(peer, ctx.registered), signed=True)
    if rows[-1].name == "registered":
        return Screened(peer=peer, checks=rows, reason=rows[-1].reason, detail="no signed announcement for this peer")
    return Screened(peer=peer, checks=rows, reason=exc.reason, detail=str(exc))


def _detail(row: CheckRow, c: Contribution, ctx: Context) -> str:
    if row.name == "window":
        return f"signed for window {c.window}, expected {ctx.window}"
    if row.name == "sync":
        also = f" (or {ctx.previous_base[:16]})" if ctx.previous_base not in (None, ctx.expected_base) else ""
        return f"trained from {c.base[:16]}, current is {ctx.expected_base[:16]}{also}"
    if row.name == "schema":
        return "tensors not a subset of the model or shapes differ"
    return row.reason or row.name
