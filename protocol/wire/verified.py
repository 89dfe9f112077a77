"""What decoding proves about an object, and the signer and window checks every kind shares.

Every ``decode_*`` returns the parsed object together with what its envelope proved::

    agg = decode_aggregate(blob, run_hash=h, max_bytes=cap, allowed_signers=keys)   # Verified[Aggregate]
    agg.value.manifest, agg.value.tensors      # the object, as its signer wrote it
    agg.digest                                 # sha256 of the bytes: how other objects name it
    agg.sender, agg.public_key, agg.size       # who signed it, with which key; how many bytes

The objects themselves (:class:`~protocol.wire.Contribution`, :class:`~protocol.wire.Aggregate` …)
are what an encoder is given: they hold no digest or signer, which exist only once signed bytes do.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.errors import BadSignature, UnknownSigner, WrongWindow
from protocol.identity import peer_id_of, public_key_from_hex
from protocol.wire.frame import Envelope

T = TypeVar("T", covariant=True)
V = TypeVar("V")


@dataclass(frozen=True)
class Verified(Generic[T]):
    """A decoded ``value`` with the key that signed its bytes, their sha256 ``digest`` and ``size``."""

    value: T
    public_key: bytes
    digest: str
    size: int

    @property
    def sender(self) -> str:
        """Peer id of the signer."""
        return peer_id_of(self.public_key)


def verified(value: V, env: Envelope) -> Verified[V]:
    """``value`` parsed from ``env``, with what the envelope's signature proved."""
    return Verified(value, env.public_key, env.digest, env.size)


def check_window_sender(env: Envelope, window: int | None, sender: str | None) -> None:
    """WrongWindow / BadSignature unless ``env`` is for ``window`` and signed by peer ``sender``
    (``None`` skips either check)."""
    if window is not None and env.window != window:
        raise WrongWindow(f"object is for window {env.window}, expected {window}")
    if sender is not None and peer_id_of(env.public_key) != sender:
        raise BadSignature(f"signed by {peer_id_of(env.public_key)}, expected {sender}")


def check_signer(env: Envelope, allowed: Collection[bytes | str] | None) -> None:
    """UnknownSigner unless ``env`` is signed by one of ``allowed`` (raw or hex public keys;
    ``None`` skips the check)."""
    if allowed is None:
        return
    keys = {k if isinstance(k, bytes) else public_key_from_hex(k) for k in allowed}
    if env.public_key not in keys:
        raise UnknownSigner(f"signer {peer_id_of(env.public_key)} is not an allowed validator key")
