"""Ed25519 identities: keys, peer ids, signatures.

Every participant (peer or validator) has one Ed25519 key. Its public key travels in every signed
object; the *peer id* is a short name derived from it (20 bytes of sha256, lowercase base32, 32
characters) that is safe in file names and object-store keys.

    ident = Identity.load_or_create("~/.sparseloco/key.pem")   # file written with mode 0600
    sig = ident.sign(b"hello")
    verify(ident.public_key, sig, b"hello")                    # raises BadSignature on failure
    peer_id_of(ident.public_key) == ident.peer_id

Key files are unencrypted PKCS#8 PEM (readable by ``openssl pkey``). A key file that other users
can read is loaded with a warning; one that is not a valid Ed25519 key is a :class:`ConfigError`.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import BadSignature, ConfigError
from protocol.files import atomic_write

log = logging.getLogger(__name__)

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_BYTES = 20
PEER_ID_CHARS = 32  # base32 of 20 bytes, no padding
_PEER_ID_RE = re.compile(r"^[a-z2-7]{32}$")


def peer_id_of(public_key: bytes) -> str:
    """The peer id of a raw 32-byte Ed25519 public key: base32(sha256(pub)[:20]), lowercase."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise BadSignature(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    digest = hashlib.sha256(bytes(public_key)).digest()[:PEER_ID_BYTES]
    return base64.b32encode(digest).decode("ascii").lower()


def is_peer_id(text: str) -> bool:
    """True when ``text`` has the exact form of a peer id (it may still belong to nobody)."""
    return bool(_PEER_ID_RE.match(text))


def public_key_from_hex(text: str) -> bytes:
    """Parse a 64-hex-character public key (as written in ``RunSpec.validator.public_keys``)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise ConfigError(f"public key is not hex: {text!r}") from exc
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(f"public key must be {PUBLIC_KEY_BYTES} bytes ({2 * PUBLIC_KEY_BYTES} hex chars)")
    return raw


def verify(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Check an Ed25519 signature; raise :class:`BadSignature` when it does not verify."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise BadSignature("public key or signature has the wrong length")
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes(public_key))
        key.verify(bytes(signature), bytes(data))
    except InvalidSignature as exc:
        raise BadSignature("signature does not verify") from exc
    except ValueError as exc:  # not a valid curve point
        raise BadSignature(f"invalid public key: {exc}") from exc


class Identity:
    """An Ed25519 private key with its public key and peer id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_of(self.public_key)

    def __repr__(self) -> str:  # never print key material
        return f"Identity(peer_id={self.peer_id!r})"

    @property
    def public_key_hex(self) -> str:
        return self.public_key.hex()

    # ------------------------------------------------------------------ construction
    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic key from 32 secret bytes (tests and reproducible demos only)."""
        if len(seed) != 32:
            raise ConfigError("an Ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Load a PEM key file. Warns when the file is readable by group or others."""
        p = Path(path).expanduser()
        try:
            mode = p.stat().st_mode
            pem = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read key file {p}: {exc.strerror or exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("key file %s is accessible by other users (mode %o); run chmod 600", p, mode & 0o777)
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{p} is not an unencrypted PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{p} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load the key at ``path``, or generate one and save it there (mode 0600)."""
        p = Path(path).expanduser()
        if p.exists():
            return cls.load(p)
        ident = cls.generate()
        try:
            ident.save(p)
        except FileExistsError:  # another process created it first: use theirs
            return cls.load(p)
        return ident

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the key as PEM with mode 0600, atomically (temp file + rename).

        Raises ``FileExistsError`` when the file exists and ``overwrite`` is false, so that a
        key is never replaced by accident.
        """
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # 0600 from the start: the key is never on disk with wider permissions.
        atomic_write(p, pem, mode=0o600, exclusive=not overwrite)

    # ------------------------------------------------------------------ signing
    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) over ``data``."""
        return self._key.sign(bytes(data))
