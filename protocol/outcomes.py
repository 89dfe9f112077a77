"""What the validator decided about every contribution of a window, published for the peers.

An aggregate's manifest lists the accepted contributions only, each with its weight (1.0 but for
near-copies of earlier uploads): it tells a peer neither its score nor why it was rejected. So with every aggregate the validator publishes
the window's *outcomes* at ``<run>/outcomes/<window>``: one row per announced peer that uploaded
(accepted or not, its rejection reason, its loss score when it was scored, its reputation after
the window), as canonical JSON sorted by peer id::

    {"run_hash": "…", "window": 3, "outcomes": [
        {"peer": "…", "accepted": true, "reason": null, "score": 0.0123, "reputation": 0.19}, …]}

**Signed through the aggregate.** The object carries no signature of its own: the aggregate's
signed metadata holds its sha256 under :data:`OUTCOMES` (the way a checkpoint manifest vouches for
its weight files), so it costs one small object per window, no new object kind and no signature,
and a reader trusts it exactly as far as the aggregate that names it::

    blob = encode_outcomes(run_hash, window, [PeerOutcome(peer, True, None, 0.01, 0.19), ...])
    metadata[OUTCOMES] = outcomes_digest(blob)          # signed with the aggregate
    store.put(layout.outcomes_key(run, window), blob)   # before the aggregate is put
    table = read_outcomes(store, run, verified_aggregate)   # None: the aggregate names none
    table.get(peer_id)                                   # PeerOutcome or None (did not upload)

Reading is strict: bytes that do not hash to the named digest are ``DigestMismatch``, a body that
does not parse (not JSON, nested deeper than the interpreter's recursion limit, rows of another
shape) is ``MalformedPayload``. Parsing allocates at most ~24 × the body (a table of empty JSON
objects, the densest in Python objects; the fuzz tests bound it at 32 ×), and
:data:`MAX_OUTCOMES_BYTES` caps the body.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from protocol import layout
from protocol.errors import DigestMismatch, MalformedPayload, ObjectNotFound
from protocol.identity import is_peer_id
from protocol.store.base import ObjectStore

if TYPE_CHECKING:  # the wire format loads torch; a log or a status table needs only these rows
    from protocol.wire import Aggregate, Verified

__all__ = [
    "MAX_OUTCOMES_BYTES",
    "OUTCOMES",
    "Outcomes",
    "PeerOutcome",
    "decode_outcomes",
    "encode_outcomes",
    "outcomes_digest",
    "read_outcomes",
    "verdict",
]

OUTCOMES = "outcomes"  # the aggregate metadata field holding the outcomes' sha256
MAX_OUTCOMES_BYTES = 32 << 20  # ~250,000 rows; a window never has that many announced uploaders


@dataclass(frozen=True)
class PeerOutcome:
    """One peer's contribution in one window: accepted or rejected (``reason``), its loss score
    (None: not scored this window) and its reputation after the window (None: no standing).

    The one shape of a peer's outcome: published here, shown by ``sparseloco status``, folded into
    reputation (:mod:`validator.reputation`), the outcome part of a contribution log row
    (``ContributionRecord.outcome``) and what the demo reads back from the log. The published rows
    carry the first five fields only; ``window`` is the table's (None in a decoded row: see
    :attr:`Outcomes.window`), ``check`` the check that failed (None when accepted or not known)
    and ``weight`` the contribution's weight in the aggregate (None when not known)."""

    peer: str
    accepted: bool
    reason: str | None = None
    score: float | None = None
    reputation: float | None = None
    _: KW_ONLY
    window: int | None = None
    check: str | None = None
    weight: float | None = None


def verdict(outcome: PeerOutcome | None) -> dict[str, Any]:
    """The fields a peer reports of its own outcome (the ``applied`` event, ``windows.jsonl``):
    ``accepted``, ``reason``, ``score``, ``reputation``, each None without an outcome."""
    o = outcome
    return {
        "accepted": o.accepted if o else None,
        "reason": o.reason if o else None,
        "score": o.score if o else None,
        "reputation": o.reputation if o else None,
    }


@dataclass(frozen=True)
class Outcomes:
    """The outcomes of one window, by peer id."""

    run_hash: str
    window: int
    rows: Mapping[str, PeerOutcome]

    def get(self, peer: str) -> PeerOutcome | None:
        return self.rows.get(peer)


def encode_outcomes(run_hash: str, window: int, rows: Iterable[PeerOutcome]) -> bytes:
    """The canonical bytes (sorted by peer; non-finite numbers are written as null)."""
    table = [
        {
            "peer": r.peer,
            "accepted": r.accepted,
            "reason": r.reason,
            "score": _finite(r.score),
            "reputation": _finite(r.reputation),
        }
        for r in sorted(rows, key=lambda r: r.peer)
    ]
    body = {"run_hash": run_hash, "window": window, "outcomes": table}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def outcomes_digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def decode_outcomes(blob: bytes, *, digest: str, run_hash: str, window: int) -> Outcomes:
    """Parse bytes that must hash to ``digest`` (from a verified aggregate) and name this run and
    window; DigestMismatch or MalformedPayload otherwise."""
    if outcomes_digest(blob) != digest:
        raise DigestMismatch(f"the outcomes of window {window} do not match the digest their aggregate signed")
    try:
        raw = json.loads(blob)
    except ValueError as exc:  # UnicodeDecodeError included
        raise MalformedPayload(f"outcomes of window {window} are not JSON: {exc}") from None
    except RecursionError:  # the rows nest 3 levels deep; the parser stops at the interpreter's limit
        raise MalformedPayload(f"outcomes of window {window} nest deeper than any outcomes table") from None
    if not isinstance(raw, dict) or raw.get("run_hash") != run_hash or raw.get("window") != window:
        raise MalformedPayload(f"the outcomes object does not name run {run_hash[:16]} window {window}")
    table = raw.get("outcomes")
    if not isinstance(table, list):
        raise MalformedPayload("outcomes: no list of rows")
    rows: dict[str, PeerOutcome] = {}
    for item in table:
        row = _row(item)
        if row.peer in rows:
            raise MalformedPayload(f"outcomes: peer {row.peer} appears twice")
        rows[row.peer] = row
    return Outcomes(run_hash, window, rows)


def read_outcomes(store: ObjectStore, run: str, aggregate: Verified[Aggregate]) -> Outcomes | None:
    """The outcomes a verified aggregate vouches for; None when it names none (a validator of an
    earlier version). ObjectNotFound when they are missing, ProtocolError when they do not verify."""
    agg = aggregate.value
    digest = agg.metadata.get(OUTCOMES)
    if digest is None:
        return None
    if not isinstance(digest, str):
        raise MalformedPayload(f"aggregate {agg.window}: the {OUTCOMES} field is not a digest")
    try:
        blob = store.get(layout.outcomes_key(run, agg.window), max_bytes=MAX_OUTCOMES_BYTES)
    except ObjectNotFound:
        raise ObjectNotFound(f"aggregate {agg.window} names outcomes that are not in the store") from None
    return decode_outcomes(blob, digest=digest, run_hash=agg.run_hash, window=agg.window)


def _row(item: Any) -> PeerOutcome:
    if not isinstance(item, dict) or set(item) != {"peer", "accepted", "reason", "score", "reputation"}:
        raise MalformedPayload("outcomes: a row without exactly peer, accepted, reason, score, reputation")
    peer, accepted, reason = item["peer"], item["accepted"], item["reason"]
    if not isinstance(peer, str) or not is_peer_id(peer):
        raise MalformedPayload(f"outcomes: not a peer id: {peer!r}")
    if not isinstance(accepted, bool) or not (reason is None or isinstance(reason, str)):
        raise MalformedPayload(f"outcomes: bad accepted/reason of peer {peer}")
    return PeerOutcome(peer, accepted, reason, _number(item["score"], peer), _number(item["reputation"], peer))


def _number(value: Any, peer: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MalformedPayload(f"outcomes: a number of peer {peer} is not a finite number")
    return float(value)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
