"""Object store on S3-compatible storage (AWS S3, Cloudflare R2, MinIO, SeaweedFS) via boto3.

    store = S3Store("my-bucket", "runs/", endpoint_url="https://<acct>.r2.cloudflarestorage.com",
                    region="auto", access_key="...", secret_key="...")
    store.put("run/contrib/3/abc", blob, if_absent=True)    # IfNoneMatch='*': one winner
    blob = store.get("run/contrib/3/abc", max_bytes=8 << 20)
    part = store.get_range("run/data/shard/9f2c", start=4096, length=512)   # GET, Range: bytes=4096-4607

Credentials come from the arguments, else from boto3's usual chain (``AWS_ACCESS_KEY_ID`` ...,
``AWS_PROFILE``, ``~/.aws``, instance roles); ``anonymous=True`` reads public buckets unsigned.
The endpoint also falls back to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.

Why each setting:
- checksums ``when_required``: boto3 >= 1.36 otherwise sends CRC trailers that R2, MinIO and B2
  reject (boto3#4392).
- two retry layers: botocore's standard mode retries one HTTP request (throttling, 5xx, resets);
  ours retries the whole operation, which botocore cannot: a body cut off mid-download, a
  multipart upload, AWS's 409 on a conditional write racing another one. Both are bounded.
- reads check ``ContentLength`` before touching the body and count while streaming, so an
  oversized object is refused without being downloaded. A ranged read accepts only the range it
  asked for (``206`` with that ``Content-Range``, or a ``200`` whose whole object is the range);
  a server that ignores ``Range`` and sends a whole object is refused on its ``ContentLength``,
  and no body is ever read past one byte more than the range.
- presigned requests (:meth:`S3Store.presign_put` and friends, what a validator hands out as upload
  grants) are always SigV4: it signs the headers in (``Content-Length``, ``If-None-Match``), where
  the older query signing some botocore versions pick for presigning would not.
- ``wire`` (a :class:`~protocol.store.traffic.WireCounter`): every connection of the client counts
  what it sends and receives, headers, listings and botocore's retries included.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import boto3
import botocore
import botocore.exceptions as bexc
from botocore import UNSIGNED
from botocore.config import Config

from protocol.errors import (
    AccessDenied,
    ConfigError,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
)
from protocol.store.base import (
    DEFAULT_MAX_BYTES,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    check_range_answer,
    range_past_end,
)
from protocol.store.presign import Presigned
from protocol.store.traffic import WireCounter, counted_connection

T = TypeVar("T")
log = logging.getLogger(__name__)

MiB = 1 << 20
_MAX_PARTS = 10_000
_MAX_SINGLE_PUT = 5 << 30
_MAX_PRESIGN_S = 7 * 24 * 3600  # SigV4's limit
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}
_DENIED = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidToken",
    "ExpiredToken",
    "AccountProblem",
}
_TOO_LARGE = {"EntityTooLarge"}
_PAST_END = {"InvalidRange", "416"}
_TRANSIENT = {
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "ConditionalRequestConflict",
    "409",
}
_NETWORK_ERRORS = (
    bexc.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, EndpointConnectionError ...
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
)


@dataclass
class S3Stats:
    """Counters for benchmarks and tests (bytes moved in bodies, GETs answered with a body, of
    whole objects and of ranges, each try counted; whole-operation retries)."""

    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    gets: int = 0
    retries: int = 0


def _code(exc: bexc.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: bexc.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: throttling, 5xx, a conflicting in-flight write, network."""
    if isinstance(exc, bexc.ClientError):
        return _code(exc) in _TRANSIENT or _status(exc) >= 500 or _status(exc) == 409
    return isinstance(exc, _NETWORK_ERRORS)


def map_error(exc: Exception, key: str) -> Exception:
    """The store exception for a botocore failure on ``key``."""
    if isinstance(exc, bexc.ClientError):
        code, status = _code(exc), _status(exc)
        message = exc.response.get("Error", {}).get("Message", "") or str(exc)
        if code in _NOT_FOUND or (status == 404 and code != "NoSuchBucket"):
            return ObjectNotFound(f"{key!r} not found")
        if code in _EXISTS or status == 412:
            return ObjectExists(f"{key!r} already exists")
        if code in _DENIED or status == 403:
            return AccessDenied(f"{key!r}: {code}: {message}")
        if code in _TOO_LARGE:
            return PayloadTooLarge(f"{key!r}: {message}")
        if code in _PAST_END or status == 416:
            return RangeNotSatisfiable(f"{key!r}: the range asked lies past the object's end: {message}")
        return StoreError(f"{key!r}: {code or status}: {message}")
    if isinstance(exc, bexc.NoCredentialsError):
        return AccessDenied(NO_CREDENTIALS)
    return StoreError(f"{key!r}: {type(exc).__name__}: {exc}")


def _count_connections(client: Any, counter: WireCounter) -> None:
    """Make every HTTP(S) connection ``client`` opens count its bytes into ``counter``.

    botocore sends through urllib3 pools of its own connection classes, named per scheme in one
    dict its session shares with its pool managers (proxy managers copy it when they are made).
    Before the first request there is no pool yet, so replacing the classes in that dict reaches
    every connection. A botocore without that dict leaves the counter at 0, with a warning."""
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    pools = getattr(http, "_pool_classes_by_scheme", None)
    if not isinstance(pools, dict) or not pools:
        log.warning("botocore %s: S3 traffic is not counted (no pool classes to wrap)", botocore.__version__)
        return
    for scheme, pool in list(pools.items()):
        pools[scheme] = type(
            f"Counted{pool.__name__}", (pool,), {"ConnectionCls": counted_connection(pool.ConnectionCls, counter)}
        )


def single_part_etag(data: bytes | memoryview) -> str:
    """The ETag S3 gives an object stored by one PUT."""
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'  # S3's ETag, not a security check


# What a user reads when the S3 store has no credential: the settings that give one, in the user's
# words (run.toml's [local.store], the SPARSELOCO_* and AWS_* variables), never an argument name.
NO_CREDENTIALS = (
    "no S3 credentials for the store: a participant without a store credential sets store.grant_url "
    "(the validator's grant server) in run.toml's [local.store] table, a --settings file or "
    "SPARSELOCO_STORE_GRANT_URL, and sparseloco-peer join and the sparseloco commands (checkpoints, "
    "export, eval, sample, inspect --run, status) read through its grants; with a credential of your "
    "own (the operator's for `sparseloco-validator init` and `run`: the bucket's write credential, e.g. "
    "a self-hosted store's validator.env), set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
)


def _session(
    access_key: str | None,
    secret_key: str | None,
    session_token: str | None,
    profile: str | None,
    region: str | None,
    *,
    anonymous: bool,
) -> Any:
    """A boto3 session with these credentials; ConfigError for an unknown profile or, unless
    ``anonymous``, no credentials at all."""
    try:
        session = boto3.session.Session(
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            aws_session_token=session_token,
            profile_name=profile,
            region_name=region,
        )
    except bexc.ProfileNotFound as exc:
        raise ConfigError(f"AWS profile not found: {exc}") from exc
    if not anonymous and session.get_credentials() is None:
        raise ConfigError(NO_CREDENTIALS)
    return session


class S3Store(ObjectStore):
    """Objects under ``prefix`` in an S3 ``bucket`` (keys are stored as ``prefix/key``).

    ``max_attempts``: tries per HTTP request (botocore, ``retry_mode`` standard or adaptive);
    ``retries``: extra tries of a whole operation (ours, backoff from ``backoff_s``). Objects of
    ``multipart_threshold`` bytes or more go up in ``part_size`` parts, ``max_concurrency`` at a
    time. ``page_size``: keys per LIST request. ``stats`` counts body bytes and our retries.
    """

    atomic_create = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        anonymous: bool = False,
        addressing_style: str | None = None,
        retry_mode: str = "standard",
        max_attempts: int = 4,
        retries: int = 2,
        backoff_s: float = 0.25,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        multipart_threshold: int = 16 * MiB,
        part_size: int = 8 * MiB,
        max_concurrency: int = 4,
        page_size: int = 1000,
        wire: WireCounter | None = None,
    ) -> None:
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        self.prefix = check_prefix(prefix + "/" if prefix else "")
        self.bucket = bucket
        if part_size < 5 * MiB:
            raise ConfigError("S3 multipart parts must be at least 5 MiB")
        self.multipart_threshold = max(multipart_threshold, part_size)
        self.part_size = part_size
        self.retries = retries
        self.page_size = page_size
        self.backoff_s = backoff_s
        self.stats = S3Stats()
        self._stats_lock = threading.Lock()
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"mode": retry_mode, "total_max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, max_concurrency * 2),
            # Self-hosted servers (MinIO, SeaweedFS) serve the bucket as a path, not a subdomain.
            s3={"addressing_style": addressing_style or ("path" if endpoint_url else "auto")},
            signature_version=UNSIGNED if anonymous else None,
        )
        session = _session(access_key, secret_key, session_token, profile, region, anonymous=anonymous)
        self._client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=session.region_name or "us-east-1",
            config=config,
        )
        self.wire = wire if wire is not None else WireCounter()
        _count_connections(self._client, self.wire)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="s3-part")
        self._closed = False
        self._anonymous = anonymous
        self._signing: tuple[Any, dict[str, Any]] = (
            session,
            {
                "endpoint_url": endpoint_url,
                "region_name": session.region_name or "us-east-1",
                "config": Config(signature_version="s3v4", s3=config.s3),
            },
        )
        self._presign_client: Any = None
        self._presign_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _count(self, field: str, n: int) -> None:
        with self._stats_lock:
            setattr(self.stats, field, getattr(self.stats, field) + n)

    def _retrying(self, key: str, op: Callable[[], T]) -> T:
        """Run ``op``, retrying transient failures with jittered exponential backoff."""
        for attempt in range(self.retries + 1):
            try:
                return op()
            except (bexc.BotoCoreError, bexc.ClientError) as exc:
                if attempt == self.retries or not is_transient(exc):
                    raise map_error(exc, key) from exc
            self._count("retries", 1)
            time.sleep(self.backoff_s * (2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ writes
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        full = self._full(key)
        body = memoryview(data).cast("B")
        # Conditional creates always go up as one PUT: SeaweedFS 4.x ignores IfNoneMatch on
        # CompleteMultipartUpload (measured: two winners in a race), a single PUT honours it
        # everywhere. S3 takes single PUTs up to 5 GiB.
        multipart = len(body) >= self.multipart_threshold and not if_absent
        if if_absent and len(body) > _MAX_SINGLE_PUT:
            raise PayloadTooLarge(f"{key!r}: a conditional create is limited to 5 GiB")
        tried = 0
        resent = False  # did any attempt (ours or botocore's) go out more than once?

        def once() -> None:
            nonlocal tried, resent
            tried += 1
            try:
                if multipart:
                    self._put_multipart(full, body)
                else:
                    kwargs = {"IfNoneMatch": "*"} if if_absent else {}
                    payload = data if isinstance(data, bytes) else body.tobytes()
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=payload, **kwargs)
            except bexc.ClientError as exc:
                meta = exc.response.get("ResponseMetadata", {})
                resent = resent or tried > 1 or int(meta.get("RetryAttempts", 0)) > 0
                raise

        try:
            self._retrying(key, once)
        except ObjectExists:
            # A re-sent create whose first copy landed finds its own object: same bytes, done.
            if not (if_absent and resent and self._same(full, body)):
                raise
        self._count("bytes_uploaded", len(body))

    def _same(self, full: str, body: memoryview) -> bool:
        """Whether ``full`` holds exactly ``body`` as stored by one PUT (compared by ETag)."""
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=full)
        except (bexc.BotoCoreError, bexc.ClientError):
            return False
        etag = str(head.get("ETag", ""))
        return int(head.get("ContentLength", -1)) == len(body) and etag == single_part_etag(body)

    def _put_multipart(self, full: str, body: memoryview) -> None:
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)
        upload_id = upload["UploadId"]
        size = self._part_size_for(len(body))
        try:
            parts = list(
                self._pool.map(
                    lambda item: self._upload_part(full, upload_id, item[0] + 1, item[1], size, body),
                    enumerate(range(0, len(body), size)),
                )
            )
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self._abort(full, upload_id)
            raise

    def _part_size_for(self, total: int) -> int:
        # S3 allows at most 10,000 parts per upload.
        return max(self.part_size, -(-total // _MAX_PARTS))

    def _upload_part(
        self, full: str, upload_id: str, number: int, offset: int, size: int, body: memoryview
    ) -> dict[str, Any]:
        chunk = body[offset : offset + size].tobytes()
        resp = self._client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=chunk)
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _abort(self, full: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except (bexc.BotoCoreError, bexc.ClientError):
            pass  # the bucket's lifecycle rule reaps what we could not abort

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._retrying(key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full))

    # ------------------------------------------------------------------ reads
    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        full = self._full(key)
        return self._retrying(key, lambda: self._get_once(full, key, max_bytes))

    def _get_once(self, full: str, key: str, max_bytes: int) -> bytes:
        resp = self._client.get_object(Bucket=self.bucket, Key=full)
        self._count("gets", 1)
        body = resp["Body"]
        try:
            length = resp.get("ContentLength")
            if length is not None and int(length) > max_bytes:
                raise PayloadTooLarge(f"{key!r} is {length} bytes, cap is {max_bytes}")
            chunks: list[bytes] = []
            received = 0
            for chunk in body.iter_chunks(MiB):
                received += len(chunk)
                if received > max_bytes:  # a server that lied about the length
                    raise PayloadTooLarge(f"{key!r} exceeds the cap of {max_bytes} bytes")
                chunks.append(chunk)
        finally:
            # Closing an unread body drops the connection instead of downloading the rest.
            body.close()
        self._count("bytes_downloaded", received)
        return b"".join(chunks)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One GET with ``Range: bytes=start-(start+length-1)``, retried like :meth:`get`; see
        :meth:`ObjectStore.get_range`."""
        check_range(key, start, length)
        full = self._full(key)
        return self._retrying(key, lambda: self._get_range_once(full, key, start, length))

    def _get_range_once(self, full: str, key: str, start: int, length: int) -> bytes:
        end = start + length
        resp = self._client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}")
        self._count("gets", 1)
        body = resp["Body"]
        received = 0
        try:
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            declared = resp.get("ContentLength")
            check_range_answer(
                key, start, length, status, resp.get("ContentRange"), None if declared is None else int(declared)
            )
            chunks: list[bytes] = []
            while received <= length:  # one byte more than asked shows a body that is too long
                chunk = body.read(min(MiB, length + 1 - received))
                if not chunk:  # botocore raised IncompleteReadError here if the body was cut off
                    break
                received += len(chunk)
                chunks.append(chunk)
        finally:
            body.close()  # never the rest of a body longer than asked
            self._count("bytes_downloaded", received)
        if received > length:
            raise StoreError(f"{key!r}: asked for {length} bytes from {start}, the store sent more")
        if received < length:  # no Content-Length to check the body against
            if status == 206:  # the range the answer named was cut off: try again
                raise bexc.IncompleteReadError(actual_bytes=received, expected_bytes=length)
            raise range_past_end(key, start, length, received)  # a whole object, shorter than the range
        return b"".join(chunks)

    def _head(self, full: str) -> dict[str, Any] | None:
        try:
            head: dict[str, Any] = self._client.head_object(Bucket=self.bucket, Key=full)
        except bexc.ClientError as exc:
            if _code(exc) in _NOT_FOUND or _status(exc) == 404:
                return None
            raise
        return head

    def size(self, key: str) -> int:
        full = self._full(key)
        head = self._retrying(key, lambda: self._head(full))
        if head is None:
            raise ObjectNotFound(f"{key!r} not found")
        return int(head["ContentLength"])

    def list(self, prefix: str) -> list[str]:
        full = self.prefix + check_prefix(prefix)
        return sorted(self._retrying(prefix, lambda: list(self._iter_keys(full))))

    def _iter_keys(self, full_prefix: str) -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=full_prefix, PaginationConfig={"PageSize": self.page_size}
        )
        for page in pages:
            for item in page.get("Contents", []):
                key = str(item["Key"])
                if not key.endswith("/"):  # folder markers some tools create are not objects
                    yield key[len(self.prefix) :]

    # ------------------------------------------------------------------ presigned requests
    def presign_put(self, key: str, size: int, *, if_absent: bool, expires_s: int) -> Presigned:
        """A PUT of exactly ``size`` bytes to ``key`` that needs no credential (see
        :mod:`protocol.store.presign`); create-only when ``if_absent``."""
        if size < 0 or size > _MAX_SINGLE_PUT:
            raise PayloadTooLarge(f"{key!r}: a presigned PUT takes 0..5 GiB, not {size} bytes")
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key), "ContentLength": size}
        headers = {"Content-Length": str(size)}
        if if_absent:
            params["IfNoneMatch"] = "*"
            headers["If-None-Match"] = "*"
        return self._presign("put_object", params, expires_s, "PUT", headers)

    def presign_get(self, key: str, *, expires_s: int) -> Presigned:
        return self._presign("get_object", {"Bucket": self.bucket, "Key": self._full(key)}, expires_s, "GET")

    def presign_head(self, key: str, *, expires_s: int) -> Presigned:
        return self._presign("head_object", {"Bucket": self.bucket, "Key": self._full(key)}, expires_s, "HEAD")

    def presign_list(self, prefix: str, *, token: str, expires_s: int) -> Presigned:
        params: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self.prefix + check_prefix(prefix),
            "MaxKeys": self.page_size,
        }
        if token:
            params["ContinuationToken"] = token
        grant = self._presign("list_objects_v2", params, expires_s, "GET")
        return Presigned(grant.method, grant.url, grant.expires_at, grant.headers, key_prefix=self.prefix)

    def _presign(
        self, operation: str, params: dict[str, Any], expires_s: int, method: str, headers: dict[str, str] | None = None
    ) -> Presigned:
        if self._anonymous:
            raise ConfigError("an anonymous S3 store cannot sign requests for others")
        if not 1 <= expires_s <= _MAX_PRESIGN_S:
            raise ConfigError(f"a presigned request lives 1..{_MAX_PRESIGN_S} s, not {expires_s}")
        issued = time.time()
        url = self._signing_client().generate_presigned_url(operation, Params=params, ExpiresIn=expires_s)
        return Presigned(method, str(url), issued + expires_s, dict(headers or {}))

    def _signing_client(self) -> Any:
        with self._presign_lock:  # grant servers sign from many threads; the client is built once
            if self._presign_client is None:
                session, options = self._signing
                self._presign_client = session.client("s3", **options)
            return self._presign_client

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._client.close()
        if self._presign_client is not None:
            self._presign_client.close()

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.prefix})"
