"""Ed25519 identities: peer ids, signatures, key files."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from protocol.errors import BadSignature, ConfigError
from protocol.identity import Identity, is_peer_id, peer_id_of, public_key_from_hex, verify


def test_sign_and_verify_roundtrip() -> None:
    ident = Identity.generate()
    sig = ident.sign(b"window 3")
    assert len(sig) == 64 and len(ident.public_key) == 32
    verify(ident.public_key, sig, b"window 3")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda pub, sig, data: (pub, sig, data + b"!"),
        lambda pub, sig, data: (pub, bytes([sig[0] ^ 1]) + sig[1:], data),
        lambda pub, sig, data: (Identity.generate().public_key, sig, data),
        lambda pub, sig, data: (pub, sig[:-1], data),
        lambda pub, sig, data: (pub[:31], sig, data),
        lambda pub, sig, data: (b"\xff" * 32, sig, data),  # not a curve point
    ],
)
def test_verify_rejects_tampering(mutate) -> None:
    ident = Identity.generate()
    data = b"payload"
    with pytest.raises(BadSignature):
        verify(*mutate(ident.public_key, ident.sign(data), data))


def test_peer_id_is_short_safe_and_derived_from_the_key() -> None:
    a, b = Identity.generate(), Identity.generate()
    assert is_peer_id(a.peer_id) and len(a.peer_id) == 32
    assert a.peer_id == peer_id_of(a.public_key) != b.peer_id
    assert a.peer_id.isalnum() and a.peer_id == a.peer_id.lower()
    assert not is_peer_id(a.peer_id.upper()) and not is_peer_id(a.peer_id[:-1]) and not is_peer_id("../" * 11)
    with pytest.raises(BadSignature):
        peer_id_of(b"short")


def test_from_seed_is_deterministic_and_repr_hides_the_key() -> None:
    a, b = Identity.from_seed(b"s" * 32), Identity.from_seed(b"s" * 32)
    assert a.public_key == b.public_key and a.sign(b"x") == b.sign(b"x")
    assert repr(a) == f"Identity(peer_id={a.peer_id!r})"
    with pytest.raises(ConfigError):
        Identity.from_seed(b"short")


def test_save_writes_mode_0600_and_load_restores_the_same_key(tmp_path) -> None:
    ident = Identity.generate()
    path = tmp_path / "keys" / "peer.pem"
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    loaded = Identity.load(path)
    assert loaded.public_key == ident.public_key
    verify(ident.public_key, loaded.sign(b"m"), b"m")
    assert [p.name for p in path.parent.iterdir()] == ["peer.pem"]  # no temp file left


def test_save_never_clobbers_unless_asked(tmp_path) -> None:
    path = tmp_path / "k.pem"
    first, second = Identity.generate(), Identity.generate()
    first.save(path)
    with pytest.raises(FileExistsError):
        second.save(path)
    assert Identity.load(path).public_key == first.public_key
    second.save(path, overwrite=True)
    assert Identity.load(path).public_key == second.public_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_or_create_creates_once_then_reuses(tmp_path) -> None:
    path = tmp_path / "k.pem"
    a = Identity.load_or_create(path)
    b = Identity.load_or_create(path)
    assert a.peer_id == b.peer_id


def test_load_warns_about_a_key_readable_by_others(tmp_path, caplog) -> None:
    path = tmp_path / "k.pem"
    Identity.generate().save(path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="protocol.identity"):
        Identity.load(path)
    assert "accessible by other users" in caplog.text
    caplog.clear()
    os.chmod(path, 0o600)
    with caplog.at_level(logging.WARNING, logger="protocol.identity"):
        Identity.load(path)
    assert caplog.text == ""


def test_load_rejects_missing_garbage_and_foreign_keys(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        Identity.load(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="not an unencrypted PEM"):
        Identity.load(junk)
    ecdsa = tmp_path / "ec.pem"
    ecdsa.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(ConfigError, match="not an Ed25519 key"):
        Identity.load(ecdsa)


def test_public_key_from_hex() -> None:
    ident = Identity.generate()
    assert public_key_from_hex(ident.public_key_hex) == ident.public_key
    for bad in ("zz" * 32, "ab" * 31, ""):
        with pytest.raises(ConfigError):
            public_key_from_hex(bad)
