"""protocol.chain: a checkpoint is trusted only through its signed manifest, on both sides."""

from __future__ import annotations

import time

import pytest
import torch

from protocol import layout
from protocol.chain import WEIGHTS_FILE, read_checkpoint
from protocol.errors import (
    DigestMismatch,
    MalformedPayload,
    ObjectNotFound,
    SchemaMismatch,
    StoreUnavailable,
    UnknownSigner,
)
from protocol.identity import Identity
from protocol.store import open_store
from protocol.store.fetch import Progress
from protocol.wire import CheckpointManifest, encode_checkpoint
from validator.publish import publish_checkpoint

VALIDATOR = Identity.from_seed(bytes(range(32)))
RUN_HASH = "c" * 64
RUN = layout.run_id(RUN_HASH)
LAUNCH = "f" * 64  # digest of the genesis manifest the checkpoint descends from
PARAMS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
SCHEMA = {n: tuple(t.shape) for n, t in PARAMS.items()}


@pytest.fixture()
def store():  # type: ignore[no-untyped-def]
    s = open_store(f"memory://chain-{time.time_ns()}")
    publish_checkpoint(
        s, RUN, RUN_HASH, 2, aggregate="d" * 64, params=PARAMS, identity=VALIDATOR, published_at=1.0, launch=LAUNCH
    )
    yield s
    s.close()


def read(store, **kw):  # type: ignore[no-untyped-def]
    return read_checkpoint(store, RUN, RUN_HASH, 2, allowed_signers=[VALIDATOR.public_key], **kw)


def test_round_trip_with_schema(store) -> None:  # type: ignore[no-untyped-def]
    manifest, params = read(store, schema=SCHEMA)
    assert manifest.window == 2 and set(params) == set(PARAMS)
    assert all(torch.equal(params[n], PARAMS[n]) for n in PARAMS)


def test_refusals(store) -> None:  # type: ignore[no-untyped-def]
    key = layout.checkpoint_key(RUN, 2, WEIGHTS_FILE)
    with pytest.raises(SchemaMismatch):
        read(store, schema={**SCHEMA, "c": (1,)})
    with pytest.raises(UnknownSigner):
        read_checkpoint(store, RUN, RUN_HASH, 2, allowed_signers=[Identity.from_seed(b"x" * 32).public_key])
    with pytest.raises(ObjectNotFound):
        read_checkpoint(store, RUN, RUN_HASH, 3, allowed_signers=[VALIDATOR.public_key])
    blob = bytearray(store.get(key))
    blob[-1] ^= 1  # same size, other bytes
    store.put(key, bytes(blob))
    with pytest.raises(DigestMismatch, match=f"{WEIGHTS_FILE}' hashes to"):  # names the file
        read(store)
    store.put(key, bytes(blob) + b"\0")  # one byte longer
    with pytest.raises(DigestMismatch, match=f"{WEIGHTS_FILE}' is larger"):
        read(store)


def test_manifest_without_files_is_malformed(store) -> None:  # type: ignore[no-untyped-def]
    empty = CheckpointManifest(RUN_HASH, 2, "d" * 64, "e" * 64, (), 1.0, launch=LAUNCH)
    store.put(layout.checkpoint_manifest_key(RUN, 2), encode_checkpoint(empty, VALIDATOR))
    with pytest.raises(MalformedPayload, match="lists no files"):
        read(store)


def test_a_large_checkpoint_is_read_in_ranges_with_its_progress() -> None:
    big = {"w": torch.randn(5 << 20)}  # 20 MiB of float32: three 8 MiB ranges
    s = open_store(f"memory://chain-{time.time_ns()}")
    publish_checkpoint(
        s, RUN, RUN_HASH, 2, aggregate="d" * 64, params=big, identity=VALIDATOR, published_at=1.0, launch=LAUNCH
    )
    key = layout.checkpoint_key(RUN, 2, WEIGHTS_FILE)
    s.faults.fail(key, ops=("get",), nth=2, error=StoreUnavailable)  # the second range drops once
    seen: dict[str, list[tuple[int, int]]] = {}

    def watch(label: str) -> Progress:
        return lambda done, total: seen.setdefault(label, []).append((done, total))

    before = s.counts["get"]
    _, params = read(s, watch=watch)
    assert torch.equal(params["w"], big["w"])
    size = s.size(key)
    assert list(seen) == ["checkpoint 2"] and seen["checkpoint 2"][-1] == (size, size)
    assert len(seen["checkpoint 2"]) == 3 and s.counts["get"] - before == 1 + 3 + 1  # manifest, ranges, the retry
