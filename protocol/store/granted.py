"""A store for peers without a credential: every operation is a presigned request a grant server signed.

The run's validator serves grants (:mod:`protocol.store.grants`, ``sparseloco-validator run
--grant-port``); a peer whose local settings name it (``store.grant_url``) opens this store and
needs only its own Ed25519 key::

    store = GrantedStore("https://validator.example.org:8710", identity, spec.hash())
    store.put(contrib_key(run, 3, identity.peer_id), blob, if_absent=True)   # granted PUT, create-only
    store.get(aggregate_key(run, 2), max_bytes=cap)                          # granted GET
    store.get_range(shard_key(run, sha), start=4096, length=512)             # the same GET, one range
    store.list(checkpoints_prefix(run))                                      # granted listing
    store.stats.requests                     # {"GET": n, "HEAD": n, "LIST": n, "PUT": n} sent to the bucket

``put`` asks for a PUT of exactly that key and size (create-only with ``if_absent``, which the S3
server enforces) and sends the bytes with plain HTTP. Reads ask for presigned GETs, HEADs and
listings, which are cached until shortly before they expire, so polling for the next aggregate
costs the grant server nothing; or, with ``reads`` (an anonymous store of a public-read bucket,
``store.public_reads``), they go to the bucket directly. A ranged read sends the key's cached GET
grant with a ``Range`` header (SigV4 query signing signs only the host, so the grant needs no
change) and accepts only a ``206`` of exactly that range, or a ``200`` whose whole object is the
range; a store that ignores ``Range`` and sends a whole object is refused on its
``Content-Length``, its body unread. Nothing can be deleted.

Several grant servers (a run with several validators, each serving grants): ``grant_url`` names
them in order, comma-separated (``store.grant_url = "https://v1:8710,https://v2:8710"``). Every
request goes to the one in use; when it is unreachable (connection refused, a timeout) or answers
5xx, the next one is asked at once, and the one that answered is used from then on (``stats.failovers``
counts the switches). A refusal (4xx) or a rate limit is that server's answer and is not asked again
elsewhere.

Time: every HTTP request waits at most ``timeout_s`` for the network to move (a connection, each
block of a body sent, an answer), and an upload's body must be sent within ``timeout_s`` plus its
size at ``floor_bytes_per_s``: a link that went down, or crawls below that rate, is noticed and
the attempt retried, not waited on for ever. Under a :func:`~protocol.store.base.deadline` both
are clipped to the time left and a transient failure raises at once: the caller retries by its
deadline (:func:`client.uplink.put_by_deadline`), and its count of attempts is the true one.

Failures: a refusal raises :class:`~protocol.errors.AccessDenied` (or ``PayloadTooLarge``) with the
reason the grant server gave; when no grant server answers, and on rate limits, the request is
retried (``retries`` times, exponential backoff from ``backoff_s``, at least what ``Retry-After``
asks) and then raises :class:`~protocol.errors.StoreUnavailable`. A cached read grant the store
refuses (it expired, the validator restarted with new credentials) is replaced once.

``wire`` (a :class:`~protocol.store.traffic.WireCounter`) counts every byte the store's connections
send and receive, to the grant servers and to the store alike, headers and retries included: what
a peer reports as its traffic on the wire.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from protocol.errors import (
    AccessDenied,
    ConfigError,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
    StoreUnavailable,
)
from protocol.identity import Identity
from protocol.store.base import (
    DEFAULT_MAX_BYTES,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    check_range_answer,
    seconds_left,
)
from protocol.store.grants import (
    GRANT_PATH,
    INFO_PATH,
    MAX_GRANT_BYTES,
    STATUS,
    GrantRefused,
    GrantRequest,
    decode_grant,
    decode_info,
    decode_refusal,
    encode_request,
)
from protocol.store.presign import Presigned
from protocol.store.traffic import WireCounter, counting_opener

__all__ = ["REQUEST_KINDS", "GrantNotGiven", "GrantStats", "GrantedStore", "grant_urls", "parse_listing"]

log = logging.getLogger(__name__)
T = TypeVar("T")
CHUNK = 1 << 20
MAX_LISTING_PAGE_BYTES = 8 << 20  # 1000 keys of 1 KiB and their XML
_STALE_MARGIN_S = 10.0  # a cached grant this close to expiry is asked for again
_ASK_STRIPES = 16  # locks that readers asking for the same grant wait on (by hash of op, key, token)
FLOOR_BYTES_PER_S = 32 << 10  # 256 kbit/s: an upload slower than this is taken for a dead link
_MIN_WAIT_S = 0.05  # shortest network wait left under a deadline (a zero timeout means non-blocking)
Page = tuple[list[str], str]  # one listing page: keys, and the continuation token ("" on the last)


REQUEST_KINDS = ("GET", "HEAD", "LIST", "PUT")  # what the bucket bills: one per request sent to it


@dataclass
class GrantStats:
    """Counters for preflight, benchmarks and tests. ``requests``: the requests sent to the
    store (not to the grant server) by kind, every attempt counted, each listing page one ``LIST``:
    what the bucket bills this peer for (reads that go to a public-read bucket directly, ``reads``,
    are that store's and not counted here)."""

    grants: int = 0
    cached: int = 0
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    retries: int = 0
    failovers: int = 0  # switches to another grant server because the one in use did not answer
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REQUEST_KINDS, 0))


class GrantNotGiven(AccessDenied):
    """The grant server refused; ``refusal`` is its reason (a key of :data:`protocol.store.grants.STATUS`:
    ``wrong_run``, ``window_closed``, ``forbidden`` ...)."""

    def __init__(self, message: str, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal
        # Reported as the grant server's reason (``wrong_run``, not ``access_denied``), when it is
        # one the protocol names (the text comes from the server, which may be anyone's);
        # ``forbidden`` is what access denied means.
        self.reason = refusal if refusal in STATUS and refusal != "forbidden" else AccessDenied.reason


class _Retry(Exception):
    """A transient failure of one attempt (the grant server or the store); ``wait_s`` at least."""

    def __init__(self, message: str, wait_s: float = 0.0) -> None:
        super().__init__(message)
        self.wait_s = wait_s


class _Down(_Retry):
    """A grant server did not answer (unreachable, a timeout, 5xx): the next one may."""


class _Regrant(Exception):
    """The store refused a cached grant (``denied``): ask for a new one and try again, once."""

    def __init__(self, denied: AccessDenied) -> None:
        super().__init__(str(denied))
        self.denied = denied


class GrantedStore(ObjectStore):
    """Objects of one run through a grant server; see the module docstring."""

    atomic_create = True

    def __init__(
        self,
        grant_url: str | Sequence[str],
        identity: Identity,
        run_hash: str,
        *,
        reads: ObjectStore | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        floor_bytes_per_s: float = FLOOR_BYTES_PER_S,
        sleep: Callable[[float], None] = time.sleep,
        wire: WireCounter | None = None,
    ) -> None:
        self.grant_urls = grant_urls(grant_url)
        self._at = 0  # the grant server in use: the first, until it does not answer
        self.identity, self.run_hash = identity, run_hash
        self.reads = reads
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.floor_bytes_per_s = floor_bytes_per_s
        self.stats = GrantStats()
        # Every byte of the grant server's and the store's requests, and of the direct reads' too.
        self.wire = wire or (reads.wire if reads is not None else None) or WireCounter()
        self._opener = counting_opener(self.wire)
        self._sleep = sleep
        self._cache: dict[tuple[str, str, str], Presigned] = {}
        self._put_grants: dict[tuple[str, int, bool], Presigned] = {}  # (key, size, if_absent)
        self._lock = threading.Lock()
        # Concurrent reads of one key (the ranges of a large object) wait for one grant, not one each.
        self._asking = [threading.Lock() for _ in range(_ASK_STRIPES)]

    def __repr__(self) -> str:
        return f"GrantedStore({', '.join(self.grant_urls)})"

    @property
    def grant_url(self) -> str:
        """The grant server in use."""
        return self.grant_urls[self._at]

    def _desk(self, once: Callable[[str], T]) -> T:
        """``once(url)`` at the grant server in use; when it does not answer (:class:`_Down`), at
        the next ones in turn. The first that answers is used from then on; when none does, one
        :class:`_Retry` for the whole round."""
        start, n = self._at, len(self.grant_urls)
        down: list[_Down] = []
        for i in range(n):
            at = (start + i) % n
            try:
                answer = once(self.grant_urls[at])
            except _Down as exc:
                down.append(exc)
                continue
            if at != start:
                with self._lock:
                    self._at = at
                self.stats.failovers += 1
                log.warning("grant server %s did not answer; using %s", self.grant_urls[start], self.grant_urls[at])
            return answer
        if n == 1:
            raise down[0]
        raise _Retry("; ".join(str(d) for d in down), max(d.wait_s for d in down))

    # ------------------------------------------------------------------ grants
    def ask(self, request: GrantRequest) -> Presigned:
        """One grant, fresh from the server (retried while it is unreachable); a refusal raises
        :class:`GrantNotGiven` (``PayloadTooLarge`` for ``too_large``). What ``sparseloco-peer
        preflight`` uses to check a grant without using it."""
        return self._attempts(f"grant {request.op} {request.key!r}", lambda: self._ask_once(request), regrant=False)

    def info(self) -> dict[str, Any]:
        """The grant server's ``/v1/info`` (run id and hash, the open window): whether it is up and
        serves this run."""

        def once(url: str) -> dict[str, Any]:
            try:
                with self._opener.open(url + INFO_PATH, timeout=self.timeout_s) as resp:
                    answer = resp.read(MAX_GRANT_BYTES + 1)
            except urllib.error.HTTPError as exc:
                raise _refusal(url, exc) from None
            except (OSError, http.client.HTTPException) as exc:
                raise _Down(f"grant server {url} unreachable: {exc}") from None
            return decode_info(answer)  # bounded in size and depth: the desk may be hostile too

        return self._attempts("grant server info", lambda: self._desk(once), regrant=False)

    def _ask_once(self, request: GrantRequest) -> Presigned:
        body, headers = encode_request(request, self.identity)

        def once(url: str) -> bytes:
            http_request = urllib.request.Request(url + GRANT_PATH, data=body, method="POST", headers=headers)
            try:
                with self._opener.open(http_request, timeout=self.timeout_s) as resp:
                    answer: bytes = resp.read(MAX_GRANT_BYTES + 1)
                    return answer
            except urllib.error.HTTPError as exc:
                raise _refusal(url, exc) from None
            except (OSError, http.client.HTTPException) as exc:
                raise _Down(f"grant server {url} unreachable: {exc}") from None

        answer = self._desk(once)
        self.stats.grants += 1
        return decode_grant(answer)

    def _granted(self, op: str, key: str, token: str = "") -> Presigned:
        """A read grant, from the cache while it is fresh; readers of one key that find none wait
        for the one that asks."""
        fresh = self._fresh(op, key, token)
        if fresh is not None:
            return fresh
        with self._asking[hash((op, key, token)) % _ASK_STRIPES]:
            fresh = self._fresh(op, key, token)
            if fresh is not None:
                return fresh
            if op == "list":
                request = GrantRequest.listing(self.run_hash, key, token)
            else:
                request = GrantRequest.read(self.run_hash, op, key)
            grant = self._ask_once(request)
            with self._lock:
                self._cache[(op, key, token)] = grant
            return grant

    def _fresh(self, op: str, key: str, token: str) -> Presigned | None:
        with self._lock:
            cached = self._cache.get((op, key, token))
            if cached is not None and cached.expires_at - _STALE_MARGIN_S > time.time():
                self.stats.cached += 1
                return cached
        return None

    def _forget(self, op: str, key: str, token: str = "") -> None:
        with self._lock:
            self._cache.pop((op, key, token), None)

    # ------------------------------------------------------------------ retries
    def _attempts(self, what: str, once: Callable[[], T], *, regrant: bool = True) -> T:
        """``once()`` with transient failures retried; store errors and refusals mapped."""
        regranted = False
        attempt = 0
        while True:
            try:
                return once()
            except _Regrant as exc:
                if regranted or not regrant:
                    raise exc.denied from None  # a fresh grant refused too: not an expiry
                regranted = True
            except GrantRefused as exc:
                raise _store_error(what, self.grant_url, exc) from None
            except _Retry as exc:
                if attempt >= self.retries:
                    raise StoreUnavailable(f"{what}: {exc} (after {attempt + 1} attempts)") from None
                if seconds_left() is not None:  # the caller retries by its deadline, counting its attempts
                    raise StoreUnavailable(f"{what}: {exc}") from None
                wait = max(exc.wait_s, self.backoff_s * 2**attempt)
                self.stats.retries += 1
                self._sleep(wait)
                attempt += 1

    # ------------------------------------------------------------------ HTTP to the store
    def _send(
        self,
        grant: Presigned,
        key: str,
        kind: str,
        *,
        body: bytes | None = None,
        extra: dict[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        """Send one presigned request (with the unsigned headers ``extra`` as well), counted as a
        request of ``kind`` (:data:`REQUEST_KINDS`); an open response on 2xx, named errors otherwise."""
        with self._lock:
            self.stats.requests[kind] += 1
        headers = {**(extra or {}), **grant.headers}
        timeout = self._wait_s(self.timeout_s)
        data: _Budgeted | None = None
        if body is not None:
            # urllib would label a body as a form (x-www-form-urlencoded), which some servers parse.
            headers.setdefault("Content-Type", "application/octet-stream")
            headers.setdefault("Content-Length", str(len(body)))  # a file-like body is sent chunked otherwise
            data = _Budgeted(body, self._wait_s(self.timeout_s + len(body) / self.floor_bytes_per_s), key)
        request = urllib.request.Request(grant.url, data=data, method=grant.method, headers=headers)
        try:
            resp: http.client.HTTPResponse = self._opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read(1 << 16).decode("utf-8", "replace")
            exc.close()
            raise _store_status(status, text, key) from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"{key!r}: the store did not answer: {exc}") from None
        return resp

    def _wait_s(self, seconds: float) -> float:
        """``seconds``, clipped to what is left of this thread's deadline (never zero: a zero
        socket timeout would not wait at all)."""
        left = seconds_left()
        return seconds if left is None else max(_MIN_WAIT_S, min(seconds, left))

    # ------------------------------------------------------------------ ObjectStore
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        check_key(key)
        body = bytes(data)

        # A retried upload, in this call or the caller's next, reuses its grant while it is valid:
        # the grant server gives a contribution only a few grants a window.
        cached = (key, len(body), if_absent)

        def once() -> None:
            with self._lock:
                grant = self._put_grants.get(cached)
            if grant is None or grant.expires_at - _STALE_MARGIN_S <= time.time():
                grant = self._ask_once(GrantRequest.put(self.run_hash, key, len(body), if_absent=if_absent))
                with self._lock:
                    self._put_grants = {k: g for k, g in self._put_grants.items() if g.expires_at > time.time()}
                    self._put_grants[cached] = grant
            try:
                self._send(grant, key, "PUT", body=body).close()
            except AccessDenied:
                with self._lock:
                    self._put_grants.pop(cached, None)  # refused by the store: never used again
                raise

        self._attempts(f"put {key!r}", once, regrant=False)
        self.stats.bytes_uploaded += len(body)

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        if self.reads is not None:
            return self.reads.get(key, max_bytes=max_bytes)
        check_key(key)
        return self._attempts(f"get {key!r}", lambda: self._read_once("get", key, max_bytes))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if self.reads is not None:
            return self.reads.get_range(key, start, length)
        check_range(key, start, length)
        return self._attempts(f"get {key!r} [{start}, {start + length})", lambda: self._range_once(key, start, length))

    def size(self, key: str) -> int:
        if self.reads is not None:
            return self.reads.size(key)
        check_key(key)

        def once() -> int:
            with self._read_response("head", key)[1] as resp:
                return _content_length(resp, key)

        return self._attempts(f"size {key!r}", once)

    def list(self, prefix: str) -> list[str]:
        if self.reads is not None:
            return self.reads.list(prefix)
        check_prefix(prefix)
        keys: list[str] = []
        token = ""
        while True:
            page, token = self._attempts(f"list {prefix!r}", lambda: self._list_once(prefix, token))
            keys += page
            if not token:
                return sorted(keys)

    def delete(self, key: str) -> None:
        raise AccessDenied(f"{key!r}: a granted store cannot delete (only the validator's credential can)")

    def close(self) -> None:
        if self.reads is not None:
            self.reads.close()

    # ------------------------------------------------------------------ reads
    def _read_response(
        self, op: str, key: str, token: str = "", extra: dict[str, str] | None = None
    ) -> tuple[Presigned, http.client.HTTPResponse]:
        grant = self._granted(op, key, token)
        try:
            return grant, self._send(grant, key, op.upper(), extra=extra)
        except AccessDenied as exc:
            self._forget(op, key, token)  # expired, or signed by a credential that is gone
            raise _Regrant(exc) from None

    def _read_once(self, op: str, key: str, max_bytes: int) -> bytes:
        with self._read_response(op, key)[1] as resp:
            length = _content_length(resp, key)
            if length > max_bytes:
                raise PayloadTooLarge(f"{key!r} is {length} bytes, cap is {max_bytes}")
            chunks: list[bytes] = []
            received = 0
            while chunk := resp.read(CHUNK):
                received += len(chunk)
                if received > max_bytes:  # a server that lied about the length
                    raise PayloadTooLarge(f"{key!r} exceeds the cap of {max_bytes} bytes")
                chunks.append(chunk)
        if received != length:
            raise _Retry(f"{key!r}: body cut off at {received} of {length} bytes")
        self.stats.bytes_downloaded += received
        return b"".join(chunks)

    def _range_once(self, key: str, start: int, length: int) -> bytes:
        end = start + length
        with self._read_response("get", key, extra={"Range": f"bytes={start}-{end - 1}"})[1] as resp:
            check_range_answer(
                key, start, length, resp.status, resp.headers.get("Content-Range"), _content_length(resp, key)
            )
            chunks: list[bytes] = []
            received = 0
            try:
                while received <= length and (chunk := resp.read(min(CHUNK, length + 1 - received))):
                    received += len(chunk)
                    chunks.append(chunk)
            except (OSError, http.client.HTTPException) as exc:
                raise _Retry(f"{key!r}: range cut off after {received} of {length} bytes: {exc}") from None
        self.stats.bytes_downloaded += received
        if received > length:  # a server that lied about the length
            raise StoreError(f"{key!r}: asked for {length} bytes from {start}, the store sent more")
        if received < length:
            raise _Retry(f"{key!r}: range cut off at {received} of {length} bytes")
        return b"".join(chunks)

    def _list_once(self, prefix: str, token: str) -> Page:
        grant, resp = self._read_response("list", prefix, token)
        with resp:
            body = resp.read(MAX_LISTING_PAGE_BYTES + 1)
        if len(body) > MAX_LISTING_PAGE_BYTES:
            raise StoreError(f"list {prefix!r}: a listing page over {MAX_LISTING_PAGE_BYTES} bytes")
        return parse_listing(body, grant.key_prefix)


class _Budgeted:
    """An upload body that must be sent within ``budget_s`` of its first read: read in blocks by
    ``http.client``, it raises :class:`TimeoutError` (an ``OSError``, so the attempt is retried)
    once the time is up, however slowly each block still moves."""

    def __init__(self, body: bytes, budget_s: float, key: str) -> None:
        self._body, self._budget_s, self._key = memoryview(body), budget_s, key
        self._at = 0
        self._until: float | None = None

    def read(self, n: int = -1) -> bytes:
        now = time.monotonic()
        if self._until is None:
            self._until = now + self._budget_s
        elif now > self._until and self._at < len(self._body):
            raise TimeoutError(
                f"{self._key!r}: {self._at:,} of {len(self._body):,} bytes sent in {self._budget_s:.1f} s: the link is too slow or down"
            )
        end = len(self._body) if n < 0 else min(len(self._body), self._at + n)
        block = bytes(self._body[self._at : end])
        self._at = end
        return block


def grant_urls(setting: str | Sequence[str]) -> tuple[str, ...]:
    """The grant servers ``store.grant_url`` names, in order: one URL, several comma-separated, or
    a sequence of them; each ``http(s)://host[:port][/path]`` (a trailing ``/`` dropped)."""
    parts = setting.split(",") if isinstance(setting, str) else list(setting)
    urls = tuple(str(u).strip().rstrip("/") for u in parts)
    if not urls or any(not u for u in urls):
        raise ConfigError(f"store.grant_url must name one or more grant servers, comma-separated, got {setting!r}")
    for url in urls:
        p = urlsplit(url)
        if p.scheme not in ("http", "https") or not p.netloc or p.query or p.fragment:
            raise ConfigError(f"store.grant_url must be http(s)://host[:port][/path] (comma-separated), got {url!r}")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"store.grant_url names a grant server twice: {setting!r}")
    return urls


def _refusal(url: str, exc: urllib.error.HTTPError) -> Exception:
    """A grant server's HTTP error: :class:`_Down` for a 5xx (another server may answer), a
    :class:`_Retry` for a rate limit, else the :class:`GrantRefused` it says."""
    refusal = decode_refusal(exc.code, exc.read(1 << 16), retry_after=exc.headers.get("Retry-After"))
    exc.close()
    if exc.code >= 500 or refusal.status >= 500:  # server_error, unavailable, busy, a proxy's 502
        return _Down(f"grant server {url}: {refusal}", refusal.retry_after_s)
    if refusal.reason == "rate_limited":
        return _Retry(f"grant server {url}: {refusal}", refusal.retry_after_s)
    return refusal


def parse_listing(body: bytes, key_prefix: str) -> Page:
    """(keys without ``key_prefix``, continuation token or "") of one ``ListObjectsV2`` page."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise StoreError(f"the store's listing is not XML: {exc}") from None
    if not root.tag.endswith("ListBucketResult"):
        raise StoreError(f"the store answered a listing with <{root.tag}>")
    url_encoded = (root.findtext("{*}EncodingType") or "").lower() == "url"
    keys = []
    for item in root.iterfind("{*}Contents"):
        key = item.findtext("{*}Key") or ""
        key = unquote(key) if url_encoded else key
        if key.startswith(key_prefix) and not key.endswith("/"):  # folder markers are not objects
            keys.append(key[len(key_prefix) :])
    truncated = (root.findtext("{*}IsTruncated") or "").lower() == "true"
    token = (root.findtext("{*}NextContinuationToken") or "") if truncated else ""
    if truncated and not token:
        raise StoreError("the store's listing is truncated but names no continuation token")
    return keys, token


def _content_length(resp: http.client.HTTPResponse, key: str) -> int:
    text = resp.headers.get("Content-Length")
    if text is None or not text.isdigit():
        raise StoreError(f"{key!r}: the store's answer has no Content-Length")
    return int(text)


def _store_status(status: int, text: str, key: str) -> Exception:
    """The store error for an S3 answer ``status`` (its XML error body ``text``)."""
    code = _xml_code(text)
    if status == 404:
        return ObjectNotFound(f"{key!r} not found")
    if status == 412:
        return ObjectExists(f"{key!r} already exists")
    if status == 403:
        return AccessDenied(f"{key!r}: the store refused the grant: {code or status}")
    if code == "EntityTooLarge" or status == 413:
        return PayloadTooLarge(f"{key!r}: {code or status}")
    if code == "InvalidRange" or status == 416:
        return RangeNotSatisfiable(f"{key!r}: the range asked lies past the object's end ({code or status})")
    if status >= 500 or status in (408, 409, 429):
        return _Retry(f"{key!r}: the store answered {status} {code}")
    return StoreError(f"{key!r}: the store answered {status} {code}")


def _xml_code(text: str) -> str:
    """The ``<Code>`` of an S3 error body ("" when there is none)."""
    try:
        return ET.fromstring(text).findtext("{*}Code") or ""
    except ET.ParseError:
        return ""


def _store_error(what: str, grant_url: str, refusal: GrantRefused) -> GrantNotGiven | PayloadTooLarge:
    """A grant server's refusal as the ObjectStore error a caller handles."""
    message = f"{what}: the grant server {grant_url} refused ({refusal.status} {refusal})"
    if refusal.reason == "too_large":
        return PayloadTooLarge(message)
    return GrantNotGiven(message, refusal.reason)
