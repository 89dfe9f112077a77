"""The exception hierarchy of the protocol.

Every error caused by bytes that came from somewhere else (a peer, a store, a file) is a
:class:`ProtocolError` with a short machine-readable ``reason`` (a stable snake_case name that the
validator writes into the contribution log) and a human-readable message. Callers at a window
boundary turn these into recorded outcomes; they never crash a peer or a validator.

Configuration and local identity problems are :class:`ConfigError`; they stop the process.
"""

from __future__ import annotations

import re

# A URL's query string: from the "?" after a scheme and host to the next space, quote or bracket.
_QUERY = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?'\"<>]*)\?[^\s'\"<>]*")


def strip_queries(text: str) -> str:
    """``text`` with the query string of every URL in it replaced by ``?…`` (what a presigned
    request's signature and a listing's parameters travel in); the scheme, host and path stay."""
    return _QUERY.sub(r"\1?…", text)


class SparseLocoError(Exception):
    """Base of every exception this project raises on purpose."""


class ConfigError(SparseLocoError):
    """A RunSpec, CLI option or local file is wrong. Stops the process with a clear message."""


class ReasonedError(SparseLocoError):
    """An error with a stable machine-readable ``reason`` (logged, counted, shown to operators)."""

    reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason}: {super().__str__()}"


class ProtocolError(ReasonedError):
    """Bytes from outside broke a rule of the protocol.

    ``reason`` is a stable identifier (``"bad_signature"``, ``"too_large"`` ...) used in logs and in
    the contribution log; ``str(err)`` is the readable explanation.
    """

    reason: str = "protocol_error"


class MalformedPayload(ProtocolError):
    """Structure does not parse: truncated, extended, bad lengths, bad header fields."""

    reason = "malformed"


class PayloadTooLarge(ProtocolError):
    """A declared or actual size exceeds the configured maximum."""

    reason = "too_large"


class UnsupportedVersion(ProtocolError):
    """Unknown magic, format version or object kind."""

    reason = "unsupported_version"


class BadSignature(ProtocolError):
    """Signature does not verify, or the signer is not who the object claims."""

    reason = "bad_signature"


class UnknownSigner(ProtocolError):
    """Valid signature by a key that is not allowed to sign this object."""

    reason = "unknown_signer"


class WrongRun(ProtocolError):
    """The object names another RunSpec hash (another run or another version of it)."""

    reason = "wrong_run"


class WrongWindow(ProtocolError):
    """The object names another window than the one it was found under or expected for."""

    reason = "wrong_window"


class StaleBase(ProtocolError):
    """A contribution trained from another aggregate than the current one (sync check, replay)."""

    reason = "stale_base"


class SchemaMismatch(ProtocolError):
    """Unknown, missing or duplicate tensors, or a shape/dtype that does not match the model."""

    reason = "schema_mismatch"


class InvalidIndices(ProtocolError):
    """Index stream decodes to out-of-range, unsorted or duplicate positions, or wrong counts."""

    reason = "invalid_indices"


class NonFiniteValues(ProtocolError):
    """NaN or Inf in scales, values or an input tensor to encode."""

    reason = "non_finite"


class DigestMismatch(ProtocolError):
    """Content does not match the hash that names or accompanies it."""

    reason = "digest_mismatch"


class Uncertified(ProtocolError):
    """A checkpoint of a run with several validators that no certificate vouches for: the certified
    aggregate of the window before it is missing, or has another digest or fingerprint than the
    checkpoint's manifest names. One validator's signature on a manifest is not enough there."""

    reason = "uncertified"


class StoreError(SparseLocoError):
    """A storage backend failed (network, permissions, server). Retryable unless stated.

    Its message never carries a URL's query string (:func:`strip_queries`): a presigned request's
    signature, or a listing's parameters, stay out of every log line that quotes the error."""

    reason: str = "store_error"

    def __init__(self, *args: object) -> None:
        super().__init__(*(strip_queries(a) if isinstance(a, str) else a for a in args))


class ObjectNotFound(StoreError):
    """The key does not exist in the store."""

    reason = "not_found"


class ObjectExists(StoreError):
    """A conditional create found the key already present."""

    reason = "exists"


class AccessDenied(StoreError):
    """The credential may not read or write this key."""

    reason = "access_denied"


class StoreUnavailable(StoreError):
    """The store, or the grant server in front of it, cannot be reached now (connection refused,
    timeouts, 5xx, rate limits that outlast the retries). Waiting may help; nothing was refused."""

    reason = "unavailable"


class InvalidKey(StoreError, ValueError):
    """An object key or prefix breaks the key rules (empty, absolute, ``..``, odd characters)."""

    reason = "invalid_key"


class InvalidRange(StoreError, ValueError):
    """A byte range asked of :meth:`~protocol.store.base.ObjectStore.get_range` is not one: a
    negative start, a length under 1 or over the cap (ranges may come from a manifest, like keys)."""

    reason = "invalid_range"


class RangeNotSatisfiable(StoreError):
    """The object is there but shorter than the end of the byte range asked of it (HTTP 416)."""

    reason = "range_not_satisfiable"


class PipelineFailure(ReasonedError):
    """A pipeline stage could not finish a window with the other stages of its replica.

    ``reason``: ``peer_lost`` (a stage died or the link broke), ``timeout`` (no answer within
    ``pipeline.timeout_s``), ``rendezvous`` (the stages never met), ``mismatch`` (another window,
    base or subspace). The replica skips the window; it is an outcome, not a crash.
    """

    reason: str = "pipeline_failed"


class IncompleteObject(ObjectNotFound):
    """A stored object is only partly there: its manifest is, a piece is not (expired, lost with its
    DHT nodes, or never written)."""

    reason = "incomplete"


class DataUnavailable(StoreError):
    """A block of the run's dataset could not be had intact: the store failed, or kept returning
    bytes that do not hash to the digest the signed dataset manifest gives it. Nothing is trained
    or scored on it; the next window tries again. A peer skips the window; the validator never
    stalls on it: a peer whose data it cannot read goes unscored (never blamed), a window without
    its random sequences goes unscored, and θ's loss is left unmeasured (NaN) while the
    validation data is unavailable."""

    reason = "data_unavailable"
