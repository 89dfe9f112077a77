"""Grants: how a peer without a store credential reads the run and writes its own objects.

The validator holds the bucket's write credential and serves ``POST /v1/grant``
(``sparseloco-validator run --grant-port``). A peer asks, with a request signed by its Ed25519 key,
for one presigned request (:class:`~protocol.store.presign.Presigned`) at a time: a PUT of exactly
its own key with exactly the size it names, or a GET, HEAD or listing under the run's prefix. The
request is fresh (a timestamp within :data:`MAX_SKEW_S` of the validator's clock and a nonce used
once) and names the run hash, so it cannot be replayed, nor used in another run::

    body, headers = encode_request(GrantRequest.put(run_hash, key, len(blob), if_absent=True), identity)
    # POST body to <grant_url>/v1/grant with headers; 200 -> decode_grant(answer)
    signed = read_request(body, headers[SIGNATURE_HEADER])   # the validator: who asks for what

The body is one JSON object with exactly the fields of :class:`GrantRequest` plus ``public_key``
(hex; the peer id is derived from it); the ``X-Sparseloco-Signature`` header carries the hex
signature over :data:`DOMAIN` followed by the body bytes, as sent. An answer is 200 with the
presigned request as JSON (:func:`encode_grant`), or a refusal: an HTTP status and
``{"error": reason, "detail": text}`` (:class:`GrantRefused`, :data:`STATUS`).

Which keys a peer may write (:func:`write_scope`): its contribution ``<run>/contrib/<t>/<peer id>``,
its announcement ``<run>/peers/<peer id>`` and its probe ``<run>/probe/<peer id>``
(``sparseloco-peer preflight``). Which window is open, and the size caps, are the validator's
decision (``validator/grants.py``).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from protocol import layout
from protocol.errors import BadSignature, ProtocolError
from protocol.identity import Identity, peer_id_of, verify
from protocol.store.base import check_key, check_prefix
from protocol.store.presign import METHODS, Presigned

__all__ = [
    "DOMAIN",
    "GRANT_PATH",
    "INFO_PATH",
    "MAX_GRANT_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_SKEW_S",
    "OPS",
    "PROBE_MAX_BYTES",
    "SIGNATURE_HEADER",
    "STATUS",
    "GrantRefused",
    "GrantRequest",
    "SignedRequest",
    "decode_grant",
    "decode_info",
    "decode_refusal",
    "encode_grant",
    "encode_refusal",
    "encode_request",
    "read_request",
    "write_scope",
]

GRANT_PATH = "/v1/grant"
INFO_PATH = "/v1/info"
SIGNATURE_HEADER = "X-Sparseloco-Signature"
DOMAIN = b"sparseloco-grant-v1\n"  # a grant signature can never pass for an object's signature
MAX_REQUEST_BYTES = 4096
MAX_JSON_DEPTH = 4  # a request is a flat object; a grant's headers one level below it
MAX_GRANT_BYTES = 16384
MAX_SKEW_S = 300.0  # clocks of volunteers' machines drift; S3 itself allows 15 minutes
PROBE_MAX_BYTES = 16 << 20  # a preflight probe: enough to measure bandwidth, little to store
OPS = ("put", "get", "head", "list")

#: HTTP status of every refusal reason.
STATUS = {
    "malformed": 400,
    "bad_signature": 401,
    "stale": 401,
    "replayed": 401,
    "forbidden": 403,
    "not_announced": 403,
    "not_found": 404,
    "too_slow": 408,
    "wrong_run": 409,
    "window_closed": 409,
    "already_granted": 409,
    "too_large": 413,
    "rate_limited": 429,
    "server_error": 500,
    "unavailable": 503,
    "busy": 503,
}

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{32}")
_TOKEN = re.compile(r"[A-Za-z0-9+/=_.~-]{0,1024}")  # S3 continuation tokens are opaque base64-like text


class GrantRefused(ProtocolError):
    """The grant server refused a request; ``reason`` is one of :data:`STATUS` and ``status`` its
    HTTP status. ``retry_after_s``: for ``rate_limited``, when to ask again."""

    reason = "grant_refused"

    def __init__(self, reason: str, message: str, *, retry_after_s: float = 0.0) -> None:
        super().__init__(message, reason=reason)
        self.status = STATUS.get(reason, 400)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GrantRequest:
    """What a peer asks for; see the module docstring. Build with :meth:`put`, :meth:`read` or
    :meth:`listing` (they fill in the timestamp and a fresh nonce)."""

    run_hash: str
    op: str
    key: str
    size: int
    if_absent: bool
    token: str
    timestamp: float
    nonce: str

    @classmethod
    def put(cls, run_hash: str, key: str, size: int, *, if_absent: bool) -> GrantRequest:
        return cls(run_hash, "put", key, size, if_absent, "", time.time(), secrets.token_hex(16))

    @classmethod
    def read(cls, run_hash: str, op: str, key: str) -> GrantRequest:
        """A ``get`` or ``head`` of ``key``."""
        return cls(run_hash, op, key, 0, False, "", time.time(), secrets.token_hex(16))

    @classmethod
    def listing(cls, run_hash: str, prefix: str, token: str = "") -> GrantRequest:
        return cls(run_hash, "list", prefix, 0, False, token, time.time(), secrets.token_hex(16))

    def check(self) -> GrantRequest:
        """``self`` if every field is well formed, else :class:`GrantRefused` ``malformed``."""
        _check(bool(_HEX64.fullmatch(self.run_hash)), "run_hash must be 64 lowercase hex characters")
        _check(self.op in OPS, f"op must be one of {', '.join(OPS)}")
        _check(bool(_NONCE.fullmatch(self.nonce)), "nonce must be 32 lowercase hex characters")
        _check(math.isfinite(self.timestamp), "timestamp must be a finite number")
        _check(bool(_TOKEN.fullmatch(self.token)), "token has characters a continuation token never has")
        _check(self.size >= 0, "size must be >= 0")
        _check(self.op == "put" or (self.size == 0 and not self.if_absent), "size and if_absent are for put only")
        _check(self.op == "list" or not self.token, "token is for list only")
        try:
            check_prefix(self.key) if self.op == "list" else check_key(self.key)
        except ValueError as exc:  # InvalidKey
            raise GrantRefused("malformed", str(exc)) from None
        return self


@dataclass(frozen=True)
class SignedRequest:
    """A request whose signature verified: ``peer_id`` (of ``public_key``) asked for ``request``."""

    request: GrantRequest
    peer_id: str
    public_key: bytes


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise GrantRefused("malformed", message)


# ---------------------------------------------------------------------- requests
def encode_request(request: GrantRequest, identity: Identity) -> tuple[bytes, dict[str, str]]:
    """The body and headers of ``request`` signed by ``identity``."""
    payload = {**asdict(request.check()), "public_key": identity.public_key_hex}
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    signature = identity.sign(DOMAIN + body).hex()
    return body, {SIGNATURE_HEADER: signature, "Content-Type": "application/json"}


_TYPES: dict[str, type | tuple[type, ...]] = {
    "run_hash": str,
    "op": str,
    "key": str,
    "size": int,
    "if_absent": bool,
    "token": str,
    "timestamp": (int, float),
    "nonce": str,
    "public_key": str,
}


def read_request(body: bytes, signature_hex: str | None) -> SignedRequest:
    """Parse and verify a request as received; :class:`GrantRefused` (``malformed`` or
    ``bad_signature``) for anything else. Freshness and scope are the server's to check."""
    raw = _json_object(body, MAX_REQUEST_BYTES, set(_TYPES), "request body", "request")
    for name, tp in _TYPES.items():
        value = raw[name]
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise GrantRefused("malformed", f"{name} has the wrong type")
    public_hex = raw.pop("public_key")
    _check(bool(_HEX64.fullmatch(public_hex)), "public_key must be 64 lowercase hex characters")
    values = {f.name: raw[f.name] for f in fields(GrantRequest)}
    request = GrantRequest(**{**values, "timestamp": float(values["timestamp"])}).check()
    if signature_hex is None or not re.fullmatch(r"[0-9a-f]{128}", signature_hex):
        raise GrantRefused("bad_signature", f"the {SIGNATURE_HEADER} header must hold a 128-hex signature")
    public_key = bytes.fromhex(public_hex)
    try:
        verify(public_key, bytes.fromhex(signature_hex), DOMAIN + body)
    except BadSignature as exc:
        raise GrantRefused("bad_signature", f"the request's signature does not verify: {exc}") from None
    return SignedRequest(request, peer_id_of(public_key), public_key)


def write_scope(run: str, peer_id: str, key: str) -> layout.ParsedKey:
    """The parsed ``key`` if ``peer_id`` may write it in run ``run`` (its contribution of any
    window, its announcement, its probe), else :class:`GrantRefused` ``forbidden``."""
    try:
        parsed = layout.parse_key(key, run=run)
    except ProtocolError:
        raise GrantRefused("forbidden", f"{key!r} is not an object of run {run} a peer may write") from None
    if parsed.kind not in ("contrib", "peers", "probe") or parsed.peer_id != peer_id:
        raise GrantRefused("forbidden", f"peer {peer_id} may write only its own keys, not {key!r}")
    return parsed


# ---------------------------------------------------------------------- answers
def encode_grant(grant: Presigned) -> bytes:
    return json.dumps(asdict(grant), sort_keys=True).encode()


def decode_grant(body: bytes) -> Presigned:
    """A grant server's 200 answer as a :class:`Presigned`; :class:`GrantRefused` ``malformed``
    when it is not one (a proxy's error page, a server of another version)."""
    raw = _json_object(body, MAX_GRANT_BYTES, {f.name for f in fields(Presigned)}, "the grant server's answer", "grant")
    method, url, expires_at, headers, key_prefix = (
        raw[n] for n in ("method", "url", "expires_at", "headers", "key_prefix")
    )
    ok = (
        method in METHODS
        and isinstance(url, str)
        and url.lower().startswith(("http://", "https://"))
        and isinstance(expires_at, (int, float))
        and not isinstance(expires_at, bool)
        and isinstance(headers, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        and isinstance(key_prefix, str)
    )
    if not ok:
        raise GrantRefused("malformed", "the grant server's answer is not a well-formed grant")
    return Presigned(method, url, float(expires_at), dict(headers), key_prefix)


def encode_refusal(refusal: GrantRefused) -> bytes:
    detail = str(refusal).removeprefix(f"{refusal.reason}: ")
    return json.dumps({"error": refusal.reason, "detail": detail}).encode()


def decode_refusal(status: int, body: bytes, *, retry_after: str | None = None) -> GrantRefused:
    """The refusal a grant server answered with ``status`` (any body: a proxy may answer too)."""
    reason, detail = "", ""
    try:
        raw: Any = _bounded_json(body[:MAX_GRANT_BYTES], MAX_GRANT_BYTES, "the grant server's refusal")
        if isinstance(raw, dict):
            reason, detail = str(raw.get("error", ""))[:64], str(raw.get("detail", ""))[:1000]
    except GrantRefused:
        detail = body[:200].decode("utf-8", "replace")
    if reason not in STATUS:
        reason = next((r for r, s in STATUS.items() if s == status), "unavailable" if status >= 500 else "malformed")
    try:
        wait = float(retry_after) if retry_after else 0.0
    except ValueError:
        wait = 0.0
    wait = wait if math.isfinite(wait) else 0.0
    return GrantRefused(reason, f"HTTP {status}: {detail or 'no detail'}", retry_after_s=min(max(wait, 0.0), 3600.0))


#: What ``GET /v1/info`` answers: the run, the open window (or None) and its upload deadline.
_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "run_hash": (str,),
    "window": (int, type(None)),
    "upload_deadline": (int, float, type(None)),
}


# Before genesis, a validator started with --wait-for-peers says so: how many peers it waits
# for and how many have announced (absent, or null, otherwise; older servers omit them).
_INFO_WAITING: dict[str, tuple[type, ...]] = {"waiting_for_peers": (int, type(None)), "announced": (int, type(None))}


def decode_info(body: bytes) -> dict[str, Any]:
    """A grant server's ``/v1/info`` answer; :class:`GrantRefused` ``malformed`` when it is not one."""
    raw = _bounded_json(body, MAX_GRANT_BYTES, "the grant server's info")
    if not isinstance(raw, dict) or not set(_INFO_TYPES) <= set(raw) <= set(_INFO_TYPES) | set(_INFO_WAITING):
        keys = ", ".join(sorted(_INFO_TYPES))
        raise GrantRefused("malformed", f"a run info is a JSON object with {keys} (and optionally the waiting state)")
    for name, types in (_INFO_TYPES | _INFO_WAITING).items():
        value = raw.setdefault(name, None)
        if isinstance(value, bool) or not isinstance(value, types) or (isinstance(value, int) and value < 0):
            raise GrantRefused("malformed", f"the grant server's info has a {name} of the wrong type")
    if isinstance(raw["upload_deadline"], float) and not math.isfinite(raw["upload_deadline"]):
        raise GrantRefused("malformed", "the grant server's info has an upload_deadline that is not finite")
    return raw


def _json_object(body: bytes, limit: int, keys: set[str], what: str, kind: str) -> dict[str, Any]:
    """``body`` as a JSON object with exactly ``keys``, at most ``limit`` bytes; else
    :class:`GrantRefused` ``malformed`` (``what``/``kind`` name it in the message)."""
    raw = _bounded_json(body, limit, what)
    if not isinstance(raw, dict) or set(raw) != keys:
        raise GrantRefused("malformed", f"a {kind} is a JSON object with exactly {', '.join(sorted(keys))}")
    return raw


def _bounded_json(body: bytes, limit: int, what: str) -> Any:
    """``body`` parsed as JSON when it has at most ``limit`` bytes and nests at most
    :data:`MAX_JSON_DEPTH` levels (checked before parsing); else :class:`GrantRefused` ``malformed``."""
    if len(body) > limit:
        raise GrantRefused("malformed", f"{what} over {limit} bytes")
    if _nesting(body) > MAX_JSON_DEPTH:
        raise GrantRefused("malformed", f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise GrantRefused("malformed", f"{what} is not JSON") from None


def _nesting(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (outside strings), found before any
    parser recurses into it: a body of 4 KiB of ``[`` is refused, not parsed."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest
