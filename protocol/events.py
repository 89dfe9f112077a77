"""What peers and validators report while they run: one typed event stream.

Every process writes the same frozen records, either as JSON lines (``--status-json``, what
``sparseloco demo`` and other programs read) or as human lines rendered from the same records::

    emit = EventWriter(sys.stdout)                      # --status-json
    emit(PeerWindow(window=3, outcome="uploaded", upload_bytes=48213, ...))
    for event in read_events(lines):                   # the reader side (demo, tests)
        if isinstance(event, WindowPublished): ...
    describe(event)                                     # "window 3 published: accepted=3 ..."

A JSON line is ``{"event": <kind>, "time": <unix s>, ...fields}``. Readers are lenient about lines
that are not events (a stray log line) but strict about events: a known kind with wrong fields is
an error, so a producer and a reader that drifted apart fail loudly in tests.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

OUTCOMES = ("uploaded", "skipped", "failed", "rejected_by_store")


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every event: ``time`` is unix seconds when it happened."""

    kind: ClassVar[str] = ""
    time: float = field(default_factory=lambda: round(time.time(), 3))

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.kind, **dataclasses.asdict(self)}


_KINDS: dict[str, type[Event]] = {}


def _event(kind: str) -> Any:
    """Register a frozen keyword-only event class under ``kind``."""

    def wrap(cls: type[Event]) -> type[Event]:
        cls.kind = kind
        _KINDS[kind] = cls
        return cls

    return wrap


# ---------------------------------------------------------------------- peer
@_event("peer_started")
@dataclass(frozen=True, kw_only=True)
class PeerStarted(Event):
    """Who and which run, before anything can wait: compare ``run_hash`` with the operator's
    (``sparseloco run-id run.toml``). ``store``: where this peer looks for the run."""

    peer_id: str
    run_id: str
    run_hash: str
    store: str


@_event("waiting_for_genesis")
@dataclass(frozen=True, kw_only=True)
class WaitingForGenesis(Event):
    """No signed genesis checkpoint for ``run_hash`` in ``store`` yet; ``join`` gives up after
    ``timeout_s`` (the validator is not up, or this run.toml differs from the operator's)."""

    run_id: str
    run_hash: str
    store: str
    waited_s: float
    timeout_s: float


@_event("announced")
@dataclass(frozen=True, kw_only=True)
class Announced(Event):
    peer_id: str


@_event("joined")
@dataclass(frozen=True, kw_only=True)
class Joined(Event):
    """The peer holds θ of ``window`` (restored state, newest checkpoint, replayed aggregates)."""

    peer_id: str
    window: int
    fingerprint: str
    replayed_from: int
    resumed: bool
    resumed_window: int | None = None
    staged_window: int | None = None  # the contribution staged with the restored e, if any
    feedback_norm: float = 0.0
    inner_step: int = 0
    join_s: float = 0.0


@_event("awaiting_signatures")
@dataclass(frozen=True, kw_only=True)
class AwaitingSignatures(Event):
    """Several validators: aggregate ``window`` is not certified yet; ``quorum`` of the
    ``validators`` must endorse one digest, ``endorsements`` is the most one digest has so far
    (``endorsed``: validators that endorsed any). A peer reports it when the count changes."""

    window: int
    quorum: int
    validators: int
    endorsements: int
    endorsed: int = 0


@_event("applied")
@dataclass(frozen=True, kw_only=True)
class Applied(Event):
    """Aggregate ``window`` applied: θ now has ``fingerprint``; ``included``: our contribution is in it.

    ``accepted``, ``reason``, ``score``, ``reputation``: what the validator decided about our
    contribution to ``window`` (:func:`protocol.outcomes.verdict` of our
    :class:`~protocol.outcomes.PeerOutcome`, vouched for by the aggregate); None when we did not
    upload to it or the aggregate names no outcomes. ``weight`` is the manifest weight
    (1.0 for every accepted contribution), not a score."""

    window: int
    fingerprint: str
    included: bool
    weight: float | None
    contributors: int
    accepted: bool | None = None
    reason: str | None = None
    score: float | None = None
    reputation: float | None = None


@_event("resync")
@dataclass(frozen=True, kw_only=True)
class Resynced(Event):
    """θ did not reproduce an aggregate's fingerprint; rebuilt from the newest checkpoint."""

    window: int
    reason: str
    detail: str = ""


@_event("sync_failed")
@dataclass(frozen=True, kw_only=True)
class SyncFailed(Event):
    window: int
    reason: str
    detail: str = ""


@_event("downloading")
@dataclass(frozen=True, kw_only=True)
class Downloading(Event):
    """A large object (``what``: ``checkpoint 120``, ``aggregate 57``) is being read in ranges:
    ``done_bytes`` of ``total_bytes`` so far at ``bytes_per_s`` since it began, ``eta_s`` left at
    that rate (None before anything arrived). Reported at most every 10 s where no live panel
    shows it."""

    what: str
    done_bytes: int
    total_bytes: int
    bytes_per_s: float
    eta_s: float | None = None


@_event("downloaded")
@dataclass(frozen=True, kw_only=True)
class Downloaded(Event):
    """A large object was read whole and verified: ``size_bytes`` in ``seconds``."""

    what: str
    size_bytes: int
    seconds: float
    bytes_per_s: float


@_event("window")
@dataclass(frozen=True, kw_only=True)
class PeerWindow(Event):
    """One window's outcome on a peer: ``uploaded``, ``skipped`` (with a reason) or ``failed``."""

    window: int
    outcome: str
    reason: str | None = None
    detail: str = ""
    loss_first: float | None = None
    loss: float | None = None
    tokens: int = 0
    inner_s: float = 0.0
    compress_s: float = 0.0
    upload_bytes: int = 0
    upload_s: float = 0.0  # from the put's first attempt to its end, waits between attempts included
    upload_attempts: int = 0  # puts tried (retried on transient failures until the upload deadline)
    upload_down_s: float = 0.0  # of upload_s, in failed attempts and the waits after them
    feedback_norm: float | None = None
    trained_from: int | None = None  # the window θ opened when training started (window − 1: overlapped)
    stale_steps: int = 0  # inner steps trained before θ held the aggregate that opens the window
    forecast_wait_s: float = 0.0  # of inner_s, the wait for the others' contributions before the first step
    aggregate_wait_s: float = 0.0  # of inner_s, the wait mid-window for the aggregate that opens the window
    download_bytes: int = 0  # read from the store since the previous window report: aggregates, checkpoints, data_bytes
    data_bytes: int = 0  # fetched from the store since the last trained window (blocks, prefetch)
    data_hits: int = 0  # blocks the window read that were already local (cached or prefetched)
    data_misses: int = 0  # blocks it had to wait for
    wire_up_bytes: int = 0  # sent on the store's sockets since the previous window report: headers, grants, retries
    wire_down_bytes: int = 0  # received on them since the previous window report (0: a store without sockets)
    requests: dict[str, int] = field(
        default_factory=dict
    )  # sent to the bucket since the previous report, by kind (GET, HEAD, LIST, PUT)


@_event("resumed_upload")
@dataclass(frozen=True, kw_only=True)
class ResumedUpload(Event):
    """A contribution staged before a restart, uploaded (or not) after it."""

    window: int
    outcome: str
    reason: str | None = None


@_event("stopped")
@dataclass(frozen=True, kw_only=True)
class Stopped(Event):
    """A peer or validator stopped; ``reason``: ``done``, ``interrupted`` or ``stopped``.
    ``withdrawn``: a peer's signed withdrawal is in the store (the validator stops waiting for it)."""

    role: str = "peer"
    reason: str = "done"
    window: int | None = None
    windows_trained: int = 0
    inner_s: float = 0.0
    fingerprint: str = ""
    withdrawn: bool = False


@_event("failed")
@dataclass(frozen=True, kw_only=True)
class Failed(Event):
    """A process could not go on (cannot join, configuration error)."""

    role: str = "peer"
    reason: str
    detail: str = ""


# ---------------------------------------------------------------------- validator
@_event("validator_started")
@dataclass(frozen=True, kw_only=True)
class ValidatorStarted(Event):
    peer_id: str
    run_id: str
    run_hash: str
    store: str
    device: str


@_event("window_opened")
@dataclass(frozen=True, kw_only=True)
class WindowOpened(Event):
    """The validator is gathering ``window`` (after genesis, a publish, or a restart)."""

    window: int
    base: str
    opened_at: float


@_event("window_waiting")
@dataclass(frozen=True, kw_only=True)
class WindowWaiting(Event):
    """``window`` is still open because of ``waiting_for`` (peer ids expected but not uploaded yet);
    ``uploaded`` contributions are in; the window closes in ``closes_in_s`` at the latest."""

    window: int
    waiting_for: list[str]
    uploaded: int
    closes_in_s: float


@_event("window_published")
@dataclass(frozen=True, kw_only=True)
class WindowPublished(Event):
    """Aggregate ``window`` is in the store: the next window is open."""

    window: int
    accepted: int
    rejected: int
    val_loss: float
    digest: str
    fingerprint: str
    published_at: float
    reasons: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    uploaded: int = 0  # peers whose contribution was read (accepted + rejected, unannounced excluded)
    download_bytes: int = 0  # the bytes of those contributions
    # several validators (protocol.quorum): who proposed it, in which view, whose endorsements
    # certified it ("" / 0 / [] with one validator)
    leader: str = ""
    view: int = 0
    signers: list[str] = field(default_factory=list)


@_event("agreement")
@dataclass(frozen=True, kw_only=True)
class AgreementStep(Event):
    """A step of window ``window``'s agreement among several validators, as one validator saw it
    (``validator.agreement``): ``step`` is ``proposed``, ``endorsed``, ``objected`` (``detail``:
    the reasons), ``handover`` (view ``view`` began) or ``certified`` (``detail``: the signers)."""

    window: int
    validator: str
    step: str
    digest: str = ""
    view: int = 0
    detail: str = ""


@_event("window_retry")
@dataclass(frozen=True, kw_only=True)
class WindowRetry(Event):
    """A window could not be completed (a store error); the validator retries it after
    ``wait_s``. ``attempt``: the failures of this window so far, of at most ``limit`` before it
    gives up (:mod:`validator.retry`)."""

    window: int
    reason: str
    detail: str = ""
    attempt: int = 1
    limit: int = 0
    wait_s: float = 0.0


@_event("window_held")
@dataclass(frozen=True, kw_only=True)
class WindowHeld(Event):
    """A restarted validator gathered nothing for ``window`` and holds it, unpublished, until a
    peer is heard from (it announces, joins again or asks for a grant), at most ``hold_s`` seconds
    (:mod:`validator.hold`); ``announced``: the announcements it tracks, withdrawn ones aside."""

    window: int
    announced: int = 0
    hold_s: float = 0.0


@_event("store_errors")
@dataclass(frozen=True, kw_only=True)
class StoreErrors(Event):
    """The store requests of one window that failed, summed up once when the window's gather ends
    instead of a line per request (:mod:`validator.outage`): how many failed by kind (what was
    asked: ``list_contributions``, ``list_announcements``, ``read_announcement``,
    ``read_contribution``) and by reason, the first and last failure (unix s), whether a request
    succeeded after the last one (``recovered``), and the last error without URL query strings."""

    window: int
    failed: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    first_at: float = 0.0
    last_at: float = 0.0
    recovered: bool = False
    detail: str = ""


@_event("checkpoint_skipped")
@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(Event):
    """The checkpoint of ``window`` could not be published (a store error): the run goes on without
    it, joiners start from the one before, and the next checkpoint window publishes again."""

    window: int
    reason: str
    detail: str = ""


@_event("store_object_rejected")
@dataclass(frozen=True, kw_only=True)
class StoreObjectRejected(Event):
    """An object in the store failed verification where the validator relies on it (``key``, why:
    ``reason``): it is not trusted, and never a reason to delete anything."""

    key: str
    reason: str
    detail: str = ""


@_event("model_evaluated")
@dataclass(frozen=True, kw_only=True)
class ModelEvaluated(Event):
    """θ after aggregate ``window`` scored on the validation split (``--eval-every``; nats per token)."""

    window: int
    fingerprint: str
    sequences: int
    loss: float
    perplexity: float
    bits_per_byte: float
    seconds: float


@_event("grants_served")
@dataclass(frozen=True, kw_only=True)
class GrantsServed(Event):
    """The validator's grant server listens at ``url`` (``--grant-port``): peers whose
    ``store.grant_url`` names it need no store credential. ``warnings``: what its operator should
    know about how it listens (beyond this machine, plain HTTP)."""

    url: str
    warnings: list[str] = field(default_factory=list)


@_event("granted")
@dataclass(frozen=True, kw_only=True)
class Granted(Event):
    """A presigned request was handed out: ``op`` (put, get, head, list) of ``key`` (a prefix
    for list) to ``peer_id`` at ``address``; ``size``: the exact bytes a put may send;
    ``expires_at``: unix seconds."""

    peer_id: str
    address: str
    op: str
    key: str
    size: int = 0
    expires_at: float


@_event("grant_denied")
@dataclass(frozen=True, kw_only=True)
class GrantDenied(Event):
    """A grant request was refused with ``reason`` (protocol.store.grants.STATUS) and HTTP ``status``;
    ``peer_id`` is "" when the request did not verify. ``unreported``: refusals for the same reason
    to the same network since the last one reported, left out to keep a flood from flooding the log
    (``validator.grants.GrantPolicy.event_rate``)."""

    peer_id: str
    address: str
    op: str
    key: str
    reason: str
    status: int
    detail: str = ""
    unreported: int = 0


# ---------------------------------------------------------------------- reading and writing
def to_json(event: Event) -> str:
    return json.dumps(event.to_dict(), sort_keys=True, allow_nan=True)


def from_dict(raw: dict[str, Any]) -> Event:
    """The event ``raw`` describes; ValueError for an unknown kind or fields that do not fit it."""
    kind = raw.get("event")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    fields = {k: v for k, v in raw.items() if k != "event"}
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ValueError(f"event {kind!r} does not fit its record: {exc}") from exc


def parse_line(line: str) -> Event | None:
    """The event on one line of a ``--status-json`` stream, or None for a line that is not one."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    if not isinstance(raw, dict) or "event" not in raw:
        return None
    return from_dict(raw)


def read_events(lines: Iterable[str]) -> Iterator[Event]:
    for line in lines:
        event = parse_line(line)
        if event is not None:
            yield event


class EventWriter:
    """Writes events as JSON lines to ``stream`` (flushed per line, so a reader sees them at once).
    Thread-safe: a validator's grant server reports from its own threads."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        line = to_json(event) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


# ---------------------------------------------------------------------- human lines
def describe(event: Event) -> str:
    """One human line for ``event`` (rich markup; the caller adds the timestamp)."""
    if isinstance(event, PeerWindow):
        return (
            f"[bold]window {event.window}[/bold] {event.outcome}"
            f"  loss {_num(event.loss, '{:.4f}')}"
            f"  upload {_num(event.upload_bytes or None, '{:,}')} B"
            f"  inner {event.inner_s:.1f} s"
            + (
                f" (of which {event.aggregate_wait_s:.1f} s waiting for aggregate {event.window - 1})"
                if event.aggregate_wait_s >= 0.5
                else ""
            )
            + (f"  data {event.data_bytes:,} B" if event.data_bytes else "")
            + (
                f"  wire ↑{event.wire_up_bytes:,} ↓{event.wire_down_bytes:,} B"
                if event.wire_up_bytes or event.wire_down_bytes
                else ""
            )
            + (
                f"  ({_plain(event.reason)}" + (f": {_plain(event.detail)})" if event.detail else ")")
                if event.reason
                else ""
            )
        )
    if isinstance(event, WindowPublished):
        reasons = " ".join(f"{k}={v}" for k, v in sorted(event.reasons.items()))
        phases = " ".join(f"{k} {v:.1f}s" for k, v in event.seconds.items())
        return (
            f"window {event.window} published: accepted={event.accepted} rejected={event.rejected} "
            f"val_loss={event.val_loss:.4f} fingerprint={event.fingerprint[:16]} digest={event.digest[:16]} ({phases})"
            + (f" rejected: {reasons}" if reasons else "")
            + (
                f" leader {event.leader[:12]} view {event.view}, signed by {', '.join(s[:12] for s in event.signers)}"
                if event.signers
                else ""
            )
        )
    if isinstance(event, AgreementStep):
        return (
            f"window {event.window}: {event.validator[:12]} {event.step}"
            + (f" {event.digest[:16]}" if event.digest else "")
            + (f" (view {event.view})" if event.view else "")
            + (f": {event.detail}" if event.detail else "")
        )
    if isinstance(event, AwaitingSignatures):
        n = event.endorsements
        split = f", {event.endorsed} validators endorsed different digests" if event.endorsed > n else ""
        return (
            f"waiting for {event.quorum} of {event.validators} validators to sign aggregate {event.window} "
            f"({n} endorsement{'' if n == 1 else 's'} so far{split})"
        )
    if isinstance(event, Applied):
        verdict = ""
        if event.accepted is not None:
            verdict = "  accepted" if event.accepted else f"  rejected ({event.reason})"
            verdict += f"  score {_num(event.score, '{:+.4g}')}  rep {_num(event.reputation, '{:.3f}')}"
        return (
            f"window {event.window} applied: {event.contributors} contributor(s)"
            f"  fingerprint {event.fingerprint[:16]}{verdict}"
        )
    if isinstance(event, Downloading):
        return download_line(event.what, event.done_bytes, event.total_bytes, event.bytes_per_s, event.eta_s)
    if isinstance(event, Downloaded):
        return (
            f"{event.what} downloaded: {_bytes(event.size_bytes)} in {_duration(event.seconds)}"
            f" ({_bytes(event.bytes_per_s)}/s)"
        )
    if isinstance(event, WindowOpened):
        return f"window {event.window} open (base {event.base[:16]})"
    if isinstance(event, Stopped):
        at = "" if event.window is None else f" at window {event.window}"
        if event.role != "peer":
            return f"{event.role} stopped ({event.reason}){at}"
        return (
            f"peer stopped ({event.reason}){at}: {event.windows_trained} window(s) trained since it started,"
            f" {event.inner_s:.0f} s of inner steps"
            + (f", θ {event.fingerprint[:16]}" if event.fingerprint else "")
            + ("; withdrawn: the validator no longer waits for it" if event.withdrawn else "")
        )
    if isinstance(event, WindowHeld):
        return (
            f"window {event.window}: nothing was uploaded since the restart; held until a peer is heard from "
            f"(an announcement, a rejoin or a grant; {event.announced} announced earlier), at most "
            f"{_duration(event.hold_s)}"
        )
    if isinstance(event, StoreErrors):
        kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(event.failed.items()))
        span = f"{time.strftime('%H:%M:%S', time.localtime(event.first_at))}–"
        span += time.strftime("%H:%M:%S", time.localtime(event.last_at))
        return (
            f"window {event.window}: {sum(event.failed.values()):,} store request(s) failed {span} ({kinds}), "
            + ("the store answered again" if event.recovered else "not answering when the gather ended")
            + (f"; last: {_plain(event.detail)}" if event.detail else "")
        )
    if isinstance(event, ModelEvaluated):
        return (
            f"window {event.window} evaluated: loss={event.loss:.4f} perplexity={event.perplexity:.3f} "
            f"bits_per_byte={event.bits_per_byte:.4f} on {event.sequences} sequences ({event.seconds:.1f}s)"
        )
    if isinstance(event, ValidatorStarted):
        return (
            f"validator {event.peer_id} run {event.run_id} (hash {event.run_hash}) store {_plain(event.store)}"
            f" device {event.device}"
        )
    if isinstance(event, PeerStarted):
        return f"peer {event.peer_id} run {event.run_id} (hash {event.run_hash}) store {_plain(event.store)}"
    if isinstance(event, WaitingForGenesis):
        return (
            f"waiting for genesis of run {event.run_id} in {_plain(event.store)}: {event.waited_s:.0f} s"
            f" of {event.timeout_s:.0f} s (hash {event.run_hash})"
        )
    if isinstance(event, GrantsServed):
        return f"grants served at {event.url}" + "".join(f"\n  [bold]warning:[/bold] {w}" for w in event.warnings)
    if isinstance(event, Granted):
        return f"granted {event.op} {event.key} to {event.peer_id[:12]} at {event.address}" + (
            f" ({event.size:,} B)" if event.op == "put" else ""
        )
    if isinstance(event, GrantDenied):
        who = event.peer_id[:12] or "an unverified request"
        more = f"; {event.unreported:,} more like it not reported" if event.unreported else ""
        return (
            f"grant denied: {event.op} {event.key} to {who} at {event.address}: {event.reason} ({event.detail}){more}"
        )
    if isinstance(event, WindowWaiting):
        ids = ", ".join(p[:12] for p in event.waiting_for)
        return (
            f"window {event.window} waiting for {len(event.waiting_for)} peer(s): {ids}"
            f" ({event.uploaded} uploaded, closes in {event.closes_in_s:.0f} s at the latest)"
        )
    fields = {k: v for k, v in dataclasses.asdict(event).items() if k != "time" and v not in (None, "")}
    return f"[dim]{event.kind}[/dim] " + "  ".join(f"{k}={_plain(v)}" for k, v in fields.items())


def download_line(what: str, done: int, total: int, bytes_per_s: float, eta_s: float | None) -> str:
    """``checkpoint 120 1.2/3.4 GB, 12 MB/s, ETA 3m02s``: a transfer in progress, for people."""
    unit, scale = _unit(total)
    eta = "-" if eta_s is None else _duration(eta_s)
    return f"{what} {done / scale:.1f}/{total / scale:.1f} {unit}, {_bytes(bytes_per_s)}/s, ETA {eta}"


def _unit(n: float) -> tuple[str, float]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return unit, scale
    return "B", 1.0


def _bytes(n: float) -> str:
    unit, scale = _unit(n)
    return f"{n:.0f} B" if unit == "B" else f"{n / scale:.1f} {unit}"


def _duration(seconds: float) -> str:
    """``12s``, ``3m02s``, ``1h05m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _plain(value: object) -> str:
    """``value`` as text that rich prints as is (``[local]`` in a message is not a markup tag)."""
    return str(value).replace("[", "\\[")


def _num(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
