"""Object keys: the one layout every store (directory, S3, DHT, memory) uses.

::

    <run>/contrib/<window>/<peer_id>        signed contribution, one per peer and window
    <run>/aggregate/<window>                signed aggregate
    <run>/checkpoint/<window>/<file>        checkpoint files; ``manifest`` is the signed manifest
    <run>/peers/<peer_id>                   signed announcement
    <run>/data/manifest                     signed dataset manifest (the RunSpec names its digest)
    <run>/data/shard/<sha256>               a token shard, named by the sha256 of its bytes
    <run>/data/tokenizer/<sha256>           the run's tokenizer.json, named likewise
    <run>/probe/<peer_id>                   any bytes: a peer's write and bandwidth probe (preflight)
    <run>/outcomes/<window>                 the validator's per-peer outcomes of a window, trusted
                                            through the aggregate that names their sha256

``<run>`` is :func:`run_id` of the RunSpec hash (its first 16 hex characters) unless an operator
names it. Windows are zero-padded to 8 digits so that a lexicographic listing is in window order.
:func:`parse_key` reads a key back strictly: anything that :func:`contrib_key` and friends would
not have produced raises :class:`MalformedPayload` (keys come from listings of shared stores).

    run = run_id(spec.hash())
    store.put(contrib_key(run, 12, ident.peer_id), blob, if_absent=True)
    for key in store.list(contrib_prefix(run, 12)):
        peer = parse_key(key, run=run).peer_id
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.errors import InvalidKey, MalformedPayload
from protocol.identity import is_peer_id

WINDOW_DIGITS = 8
MAX_WINDOW = 10**WINDOW_DIGITS - 1
RUN_ID_CHARS = 16
CHECKPOINT_MANIFEST = "manifest"
DATASET_MANIFEST = "manifest"
DATA_OBJECTS = ("shard", "tokenizer")  # content-addressed objects under <run>/data/
_RUN_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_WINDOW_RE = re.compile(rf"^[0-9]{{{WINDOW_DIGITS}}}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
KINDS = ("contrib", "aggregate", "checkpoint", "peers", "data", "probe", "outcomes") + (
    "proposal",
    "endorsement",
    "objection",
)
# What each validator of a run with several writes under its own id (protocol/wire/quorum.py).
VALIDATOR_KINDS = ("proposal", "endorsement", "objection")


def run_id(run_hash: str) -> str:
    """The short run name used as the key prefix: the first 16 hex chars of the RunSpec hash."""
    if not re.fullmatch(r"[0-9a-f]{64}", run_hash):
        raise MalformedPayload("run hash must be 64 lowercase hex characters")
    return run_hash[:RUN_ID_CHARS]


def window_str(window: int) -> str:
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_WINDOW:
        raise MalformedPayload(f"window must be an integer in 0..{MAX_WINDOW}, got {window!r}")
    return f"{window:0{WINDOW_DIGITS}d}"


def _run(run: str) -> str:
    if not _RUN_RE.match(run):
        raise MalformedPayload(f"run name {run!r} must match {_RUN_RE.pattern}")
    return run


def _peer(peer_id: str) -> str:
    if not is_peer_id(peer_id):
        raise MalformedPayload(f"not a peer id: {peer_id!r}")
    return peer_id


def check_file_name(name: str) -> str:
    """A checkpoint file name: one safe path segment (no ``/``, no leading dot). Returns it."""
    if not _FILE_RE.match(name):
        raise MalformedPayload(f"checkpoint file name {name!r} must match {_FILE_RE.pattern}")
    return name


# ------------------------------------------------------------------------------ builders
def contribs_prefix(run: str) -> str:
    """Every window's contributions (what retention lists)."""
    return f"{_run(run)}/contrib/"


def contrib_prefix(run: str, window: int) -> str:
    return f"{_run(run)}/contrib/{window_str(window)}/"


def contrib_key(run: str, window: int, peer_id: str) -> str:
    return contrib_prefix(run, window) + _peer(peer_id)


def aggregate_prefix(run: str) -> str:
    return f"{_run(run)}/aggregate/"


def aggregate_key(run: str, window: int) -> str:
    return aggregate_prefix(run) + window_str(window)


def validator_objects_prefix(run: str, kind: str) -> str:
    """Every window's objects of one of ``VALIDATOR_KINDS`` (proposals, endorsements, objections)."""
    if kind not in VALIDATOR_KINDS:
        raise InvalidKey(f"{kind!r} is not a kind of validator object")
    return f"{_run(run)}/{kind}/"


def proposal_prefix(run: str, window: int) -> str:
    return f"{_run(run)}/proposal/{window_str(window)}/"


def proposal_key(run: str, window: int, validator_id: str) -> str:
    """The proposal of ``window`` by the validator ``validator_id`` (at most one per window)."""
    return proposal_prefix(run, window) + _peer(validator_id)


def endorsement_prefix(run: str, window: int) -> str:
    return f"{_run(run)}/endorsement/{window_str(window)}/"


def endorsement_key(run: str, window: int, validator_id: str) -> str:
    """The one endorsement ``validator_id`` gives in ``window``."""
    return endorsement_prefix(run, window) + _peer(validator_id)


def objection_prefix(run: str, window: int) -> str:
    return f"{_run(run)}/objection/{window_str(window)}/"


def objection_key(run: str, window: int, validator_id: str, proposer_id: str) -> str:
    """``validator_id``'s objection to the proposal of ``proposer_id`` in ``window``."""
    return objection_prefix(run, window) + _peer(validator_id) + "/" + _peer(proposer_id)


def outcomes_key(run: str, window: int) -> str:
    """The per-peer outcomes of ``window`` (:mod:`protocol.outcomes`)."""
    return f"{_run(run)}/outcomes/" + window_str(window)


def checkpoints_prefix(run: str) -> str:
    return f"{_run(run)}/checkpoint/"


def checkpoint_prefix(run: str, window: int) -> str:
    return checkpoints_prefix(run) + window_str(window) + "/"


def checkpoint_key(run: str, window: int, file: str) -> str:
    return checkpoint_prefix(run, window) + check_file_name(file)


def checkpoint_manifest_key(run: str, window: int) -> str:
    return checkpoint_key(run, window, CHECKPOINT_MANIFEST)


def peers_prefix(run: str) -> str:
    return f"{_run(run)}/peers/"


def peer_key(run: str, peer_id: str) -> str:
    return peers_prefix(run) + _peer(peer_id)


def data_prefix(run: str) -> str:
    return f"{_run(run)}/data/"


def dataset_manifest_key(run: str) -> str:
    return data_prefix(run) + DATASET_MANIFEST


def shard_key(run: str, sha256: str) -> str:
    """A token shard of the run's dataset, named by the sha256 hex of its bytes."""
    return data_prefix(run) + "shard/" + _sha256(sha256)


def tokenizer_key(run: str, sha256: str) -> str:
    """The run's tokenizer.json, named by the sha256 hex of its bytes."""
    return data_prefix(run) + "tokenizer/" + _sha256(sha256)


def _sha256(text: str) -> str:
    if not _SHA256_RE.match(text):
        raise MalformedPayload(f"not a sha256 hex digest: {text!r}")
    return text


def probe_key(run: str, peer_id: str) -> str:
    """Where ``sparseloco-peer preflight`` checks that this peer can write, and how fast: nobody
    reads it as part of the run."""
    return f"{_run(run)}/probe/{_peer(peer_id)}"


# ------------------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class ParsedKey:
    """What a key names. ``window`` is None for peers, probes and data; ``peer_id``/``file`` where
    applicable. Data keys: ``file`` is ``manifest``, ``shard`` or ``tokenizer``, ``sha256`` the
    content address of the latter two."""

    run: str
    kind: str  # one of KINDS
    window: int | None = None
    peer_id: str | None = None
    file: str | None = None
    sha256: str | None = None


def parse_window(text: str) -> int:
    """Exactly 8 decimal digits -> int (``"00000012"`` -> 12); anything else is malformed."""
    if not _WINDOW_RE.match(text):
        raise MalformedPayload(f"window segment {text!r} is not {WINDOW_DIGITS} digits")
    return int(text)


def parse_key(key: str, *, run: str | None = None) -> ParsedKey:
    """Parse a key produced by this module; ``run`` (optional) must then match its first segment."""
    parts = key.split("/")
    if len(parts) < 2 or (run is not None and parts[0] != run):
        raise MalformedPayload(f"key {key!r} is not under run {run!r}")
    r, kind, rest = _run(parts[0]), parts[1], parts[2:]
    if kind == "contrib" and len(rest) == 2:
        return ParsedKey(r, kind, parse_window(rest[0]), peer_id=_peer(rest[1]))
    if kind in ("aggregate", "outcomes") and len(rest) == 1:
        return ParsedKey(r, kind, parse_window(rest[0]))
    if kind == "checkpoint" and len(rest) == 2:
        return ParsedKey(r, kind, parse_window(rest[0]), file=check_file_name(rest[1]))
    if kind in ("proposal", "endorsement") and len(rest) == 2:
        return ParsedKey(r, kind, parse_window(rest[0]), peer_id=_peer(rest[1]))
    if kind == "objection" and len(rest) == 3:
        return ParsedKey(r, kind, parse_window(rest[0]), peer_id=_peer(rest[1]), file=_peer(rest[2]))
    if kind in ("peers", "probe") and len(rest) == 1:
        return ParsedKey(r, kind, peer_id=_peer(rest[0]))
    if kind == "data" and rest == [DATASET_MANIFEST]:
        return ParsedKey(r, kind, file=DATASET_MANIFEST)
    if kind == "data" and len(rest) == 2 and rest[0] in DATA_OBJECTS:
        return ParsedKey(r, kind, file=rest[0], sha256=_sha256(rest[1]))
    raise MalformedPayload(f"key {key!r} does not follow the object layout")
