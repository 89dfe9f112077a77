"""Presigned requests: one store operation that anyone holding the URL may perform until it expires.

A validator that holds the bucket's write credential hands peers presigned requests instead of
credentials (:mod:`protocol.store.grants`): the peer sends ``method`` to ``url`` with exactly ``headers``
and needs nothing else. With SigV4 every header named in ``headers`` is signed in, so a PUT signed
for ``Content-Length: 1000`` and ``If-None-Match: *`` is refused by the server for any other body
size, and without the create-only condition::

    grant = s3.presign_put("run/contrib/00000003/<peer>", size=48213, if_absent=True, expires_s=540)
    urllib.request.Request(grant.url, data=blob, method=grant.method, headers=grant.headers)

Listings are presigned ``list_objects_v2`` requests; the keys they return start with the store's
own prefix inside its bucket, ``key_prefix``, which the reader strips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["METHODS", "Presigned", "Presigner"]

METHODS = ("PUT", "GET", "HEAD")


@dataclass(frozen=True)
class Presigned:
    """``method`` ``url`` with ``headers`` (every one of them signed in), valid until ``expires_at``
    (unix seconds). ``key_prefix``: for listings, the part of every listed key that is the store's
    prefix, not part of the ObjectStore key."""

    method: str
    url: str
    expires_at: float
    headers: dict[str, str] = field(default_factory=dict)
    key_prefix: str = ""


@runtime_checkable
class Presigner(Protocol):
    """A store that can sign requests for others (:class:`protocol.store.s3.S3Store`)."""

    def presign_put(self, key: str, size: int, *, if_absent: bool, expires_s: int) -> Presigned:
        """A PUT of exactly ``size`` bytes to ``key`` (create-only when ``if_absent``)."""

    def presign_get(self, key: str, *, expires_s: int) -> Presigned:
        """A GET of ``key``."""

    def presign_head(self, key: str, *, expires_s: int) -> Presigned:
        """A HEAD of ``key`` (its size, or 404)."""

    def presign_list(self, prefix: str, *, token: str, expires_s: int) -> Presigned:
        """One page of the keys under ``prefix`` (``token``: the previous page's continuation)."""
