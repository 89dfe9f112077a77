"""The validator's per-window randomness: committed one window ahead, revealed after uploads close.

Which peers are scored, on which held-out sequences, and how ties are broken must be unknown to
peers until their uploads are in (otherwise an attacker sends a poisoned update exactly when it
will not be scored). The validator derives a secret for window t from its key::

    secret_t = Ed25519 signature of "sparseloco/window-secret|<run hash>|<t>"   (64 bytes)

publishes ``commitment(secret_{t+1}) = sha256(secret_{t+1})`` in the signed metadata of aggregate
t, and reveals ``secret_t`` in aggregate t. The window's seed mixes the secret with the digests of
every contribution that passed the per-contribution checks::

    root = sha256 of the sorted lines "<peer> <digest>"
    seed = sha256(secret_t || root)

so neither the validator (bound by its commitment) nor the peers (who cannot know the secret)
choose it, and anyone can recompute it afterwards (:func:`verify_reveal`). The secret is a pure
function of the validator's key: a restarted validator derives the same one. Window 0 has no
commitment before it (no aggregate precedes it); from window 1 on every reveal is checkable.

Before the reveal the secret also orders work that must not be predictable or ground by choosing
peer ids (which announcements and uploads are read first among equals): :func:`keyed_order`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from protocol.identity import Identity, verify

__all__ = [
    "COMMITMENT",
    "ROOT",
    "SECRET",
    "commitment",
    "contributions_root",
    "keyed_key",
    "keyed_order",
    "verify_reveal",
    "window_secret",
    "window_seed",
]

# Keys of the aggregate's signed metadata.
SECRET = "sample_secret"  # secret_t, hex: the reveal
COMMITMENT = "next_commitment"  # sha256(secret_{t+1}), hex
ROOT = "contributions_root"  # the root the seed of window t was drawn from, hex


def _message(run_hash: str, window: int) -> bytes:
    return f"sparseloco/window-secret|{run_hash}|{window}".encode()


def window_secret(identity: Identity, run_hash: str, window: int) -> bytes:
    """The secret of ``window``: the validator's signature of a fixed message (deterministic)."""
    return identity.sign(_message(run_hash, window))


def commitment(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


def contributions_root(digests: Mapping[str, str]) -> str:
    """sha256 of the sorted ``"<peer> <digest>"`` lines of the window's checked contributions."""
    lines = "\n".join(f"{peer} {digest}" for peer, digest in sorted(digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def window_seed(secret: bytes, root: str) -> bytes:
    """The window's 32-byte seed; every draw of the window derives from it."""
    return hashlib.sha256(secret + bytes.fromhex(root)).digest()


def keyed_key(secret: bytes, label: str, item: str) -> bytes:
    """A sort key for ``item`` nobody without ``secret`` can predict or influence by choosing names."""
    return hashlib.sha256(secret + f"|{label}|{item}".encode()).digest()


def keyed_order(secret: bytes, label: str, items: Iterable[str]) -> list[str]:
    """``items`` sorted by :func:`keyed_key`."""
    return sorted(items, key=lambda item: keyed_key(secret, label, item))


def verify_reveal(
    public_key: bytes, run_hash: str, window: int, revealed_hex: str, previous_commitment: str | None
) -> bytes:
    """Check a revealed secret: a signature of the window's message by ``public_key`` that hashes
    to the commitment published one window earlier (``None``: window 0, nothing to compare).
    Returns the secret; raises :class:`~protocol.errors.BadSignature` or ValueError."""
    secret = bytes.fromhex(revealed_hex)
    verify(public_key, secret, _message(run_hash, window))
    if previous_commitment is not None and commitment(secret) != previous_commitment:
        raise ValueError(f"the secret of window {window} does not match the commitment made before it")
    return secret
