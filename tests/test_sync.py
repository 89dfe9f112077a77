"""client.peer.sync against objects the validator's publishing code writes: schema checks on aggregates
at decode time and the window-0 open time from the signed genesis manifest."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from client.peer.sync import Sync
from protocol import layout
from protocol.broadcast import plain
from protocol.config import RunSpec
from protocol.errors import SchemaMismatch
from protocol.identity import Identity
from protocol.model import build_model, fingerprint, param_schema
from protocol.store import open_store
from protocol.store.base import ObjectStore
from protocol.wire import GENESIS
from validator.publish import encode_window_aggregate, publish_checkpoint

TINY = {"preset": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
VALIDATOR = Identity.from_seed(bytes(range(32)))
GENESIS_AT = 1_767_225_600.5


@pytest.fixture
def run() -> Iterator[tuple[RunSpec, ObjectStore, str]]:
    spec = RunSpec.from_dict({"model": TINY, "validator": {"public_keys": [VALIDATOR.public_key_hex]}})
    store = open_store(f"memory://sync-schema-{time.time_ns()}")
    params = {n: p.detach().clone() for n, p in build_model(spec.model).named_parameters()}
    launch = publish_checkpoint(
        store,
        layout.run_id(spec.hash()),
        spec.hash(),
        0,
        aggregate=GENESIS,
        params=params,
        identity=VALIDATOR,
        published_at=GENESIS_AT,
    ).digest  # the base of window 0
    yield spec, store, launch
    store.close()


def publish(spec: RunSpec, store: ObjectStore, launch: str, tensors: dict[str, tuple[tuple[int, ...], int]]) -> None:
    """Aggregate 0 with one value at flat index ``i`` of each named tensor of the given shape."""
    delta = {n: (torch.tensor([i]), torch.tensor([1e-3])) for n, (_, i) in tensors.items()}
    blob = encode_window_aggregate(
        run_hash=spec.hash(),
        window=0,
        base=launch,
        alpha=1.0,
        tensors=plain(delta, {n: s for n, (s, _) in tensors.items()}),
        manifest=[],
        fingerprint_next="0" * 64,
        published_at=GENESIS_AT + 1,
        metadata={},
        identity=VALIDATOR,
    )
    store.put(layout.aggregate_key(layout.run_id(spec.hash()), 0), blob)


def test_window_zero_deadline_comes_from_the_signed_genesis_manifest(run) -> None:  # type: ignore[no-untyped-def]
    spec, store, launch = run
    params: dict[str, torch.Tensor] = {}
    pos = Sync(spec, store).resync(params)
    assert pos.window == 0 and pos.opened_at == GENESIS_AT and pos.fingerprint == fingerprint(params)
    assert pos.base == launch  # the genesis manifest's digest roots the chain


def test_aggregate_covering_a_subset_of_theta_is_accepted(run) -> None:  # type: ignore[no-untyped-def]
    spec, store, launch = run
    name, shape = sorted(param_schema(spec.model).items())[0]
    publish(spec, store, launch, {name: (shape, 0)})
    agg = Sync(spec, store).fetch_aggregate(0)
    assert agg is not None and set(agg.value.tensors) == {name} and agg.value.window == 0


@pytest.mark.parametrize("kind", ["unknown tensor", "wrong shape"])
def test_aggregate_with_unknown_tensor_or_wrong_shape_is_rejected(run, kind: str) -> None:  # type: ignore[no-untyped-def]
    spec, store, launch = run
    name, shape = sorted(param_schema(spec.model).items())[0]
    bad = {"not.a.parameter": ((8,), 0)} if kind == "unknown tensor" else {name: ((shape[0] + 1, *shape[1:]), 0)}
    publish(spec, store, launch, bad)
    with pytest.raises(SchemaMismatch):
        Sync(spec, store).fetch_aggregate(0)
