"""Damage in the store: nothing is deleted or trusted because it is present, nothing stalls the run.

Run: checkpoint_every 2. After window 10 the two newest checkpoints (8 and 10) hold junk of their
signed size at their weight keys, junk lies at the checkpoint manifest key of window 9 and at the
aggregate key of window 11, and an announced peer's upload to window 10 is junk nobody signed.
A validator with a retention of 3 windows then publishes window 10: the anchor is checkpoint 6
(the newest one whose files verify by sha256), so the aggregates 6..10 that a joiner replays stay,
the damaged objects are reported (once each) and kept, the junk upload is nobody's fault, and a new
peer, falling back past both damaged checkpoints, reaches the validator's θ. A store whose
checkpoint puts keep failing does not hold the run, a store whose aggregate puts keep failing makes
the validator give up after its stated number of attempts, and a dataset whose every block is
damaged leaves the run going with its losses unmeasured.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_run_data import BASE, SHARD_TOKENS, VKEY, write_corpus

from client.peer.sync import Sync
from protocol import layout
from protocol.data.run_data import read_dataset_manifest
from protocol.events import CheckpointSkipped, Event, ModelEvaluated, StoreObjectRejected, WindowRetry
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.replay import Chain
from protocol.settings import LocalSettings, StoreSettings, ValidatorSettings
from protocol.store.memory import FaultInjector, MemoryStore
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.init import init_run
from validator.node import Validator
from validator.reasons import FOREIGN
from validator.retry import WindowFailed, bound_s

pytestmark = pytest.mark.timeout(300)

RETAIN = dataclasses.replace(LOCAL, validator=ValidatorSettings(retain_windows=3))


@pytest.fixture()
def vkey() -> Identity:
    return Identity.generate()


@pytest.fixture()
def swarm(vkey: Identity) -> Iterator[Swarm]:
    sw = Swarm(tiny_spec(vkey), 2)
    sw.announce_all()
    yield sw
    sw.close()


def validator(sw: Swarm, vkey: Identity, state: Path, local: LocalSettings, events: list[Event]) -> Validator:
    v = Validator(sw.spec, sw.handle(), vkey, state, local=local, emit=events.append)
    v.resume()
    return v


def run_windows(sw: Swarm, v: Validator, until: int, *, skip: frozenset[str] = frozenset()) -> None:
    """Every peer not in ``skip`` uploads an honest contribution, the validator publishes."""
    while v.state is not None and v.state.window < until:
        st = v.state
        for p in sw.peers:
            if p.peer_id not in skip:
                sw.upload(p.peer_id, st.window, sw.honest(p, st.params, st.window, st.base))
        assert v.run_window() is not None


def faults(v: Validator) -> FaultInjector:
    """The fault rules of the validator's own store handle (rules belong to a handle)."""
    assert isinstance(v.store, MemoryStore)
    return v.store.faults


def windows_of(sw: Swarm, kind: str) -> set[int]:
    return {w for k in sw.store.list(f"{sw.run}/{kind}/") if (w := layout.parse_key(k, run=sw.run).window) is not None}


def junk_weights(sw: Swarm, window: int) -> str:
    """The weight file of checkpoint ``window`` replaced by zeros of its signed size; its key."""
    key = Chain(sw.spec, sw.handle()).manifest(window).value.files[0].key
    size = len(sw.store.get(key))
    sw.store.delete(key)
    sw.store.put(key, bytes(size))
    return key


def test_damaged_checkpoints_and_junk_at_chain_keys_delete_nothing_a_joiner_needs(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    events: list[Event] = []
    v = validator(swarm, vkey, tmp_path / "v", LOCAL, events)  # no retention while the run grows
    run_windows(swarm, v, 10)
    damaged8, _ = junk_weights(swarm, 8), junk_weights(swarm, 10)
    swarm.store.put(layout.checkpoint_manifest_key(swarm.run, 9), b"junk where no checkpoint belongs")
    swarm.store.put(layout.aggregate_key(swarm.run, 11), b"junk at the next aggregate's key")
    victim = swarm.peers[0]
    swarm.upload(victim.peer_id, 10, b"junk that nobody signed")

    v = validator(swarm, vkey, tmp_path / "v", RETAIN, events)
    run_windows(swarm, v, 11, skip=frozenset({victim.peer_id}))

    assert windows_of(swarm, "aggregate") >= {6, 7, 8, 9, 10}  # since checkpoint 6, the newest that verifies
    assert windows_of(swarm, "aggregate").isdisjoint(range(6))
    assert windows_of(swarm, "checkpoint") == {0, 6, 8, 9, 10}  # damaged and junk ones are kept, not trusted
    rejected = [e for e in events if isinstance(e, StoreObjectRejected)]
    assert {e.key for e in rejected if e.reason == "digest_mismatch"} == {damaged8}  # 10 is past the horizon
    assert len(rejected) == len({(e.key, e.reason) for e in rejected})  # reported once, not every window
    row = next(r for r in v.log.rows(windows=(10, 10)) if r.peer == victim.peer_id)
    assert row.reason == FOREIGN  # junk at a peer's key is not the peer's doing

    params: dict[str, torch.Tensor] = {}
    pos = Sync(swarm.spec, swarm.handle()).bootstrap(params)  # 10 and 8 do not verify: from 6, replaying 6..10
    assert v.state is not None and (pos.window, fingerprint(params)) == (11, fingerprint(v.state.params))
    run_windows(swarm, v, 12)  # the junk at aggregate 11's key is replaced by the real one
    assert Chain(swarm.spec, swarm.handle()).next_aggregate(11, v.state.previous_base) is not None


def test_a_checkpoint_the_store_refuses_is_skipped_and_the_run_goes_on(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    events: list[Event] = []
    v = validator(swarm, vkey, tmp_path / "v", LOCAL, events)
    faults(v).fail(f"{swarm.run}/checkpoint/00000002/", ops=("put",))  # every put, for as long as it lasts
    run_windows(swarm, v, 4)
    skipped = [e for e in events if isinstance(e, CheckpointSkipped)]
    assert [e.window for e in skipped] == [2] and skipped[0].reason == "store_error"
    assert not any(isinstance(e, WindowRetry) for e in events)
    assert windows_of(swarm, "checkpoint") == {0, 4} and windows_of(swarm, "aggregate") == {0, 1, 2, 3}
    params: dict[str, torch.Tensor] = {}
    assert v.state is not None and Sync(swarm.spec, swarm.handle()).bootstrap(params).window == 4


def test_a_window_whose_aggregate_cannot_be_put_is_given_up_after_the_stated_bound(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    events: list[Event] = []
    local = dataclasses.replace(LOCAL, validator=ValidatorSettings(window_retries=4))
    v = validator(swarm, vkey, tmp_path / "v", local, events)
    run_windows(swarm, v, 1)
    fault = faults(v).fail(layout.aggregate_key(swarm.run, 1), ops=("put",))
    with pytest.raises(WindowFailed) as failed:
        v.run(windows=1)
    retries = [e for e in events if isinstance(e, WindowRetry)]
    assert [(e.window, e.attempt, e.limit) for e in retries] == [(1, 1, 4), (1, 2, 4), (1, 3, 4)]
    assert [e.wait_s for e in retries] == [0.02, 0.04, 0.08]  # doubling from poll_interval_s
    assert failed.value.attempts == 4 and failed.value.waited_s == pytest.approx(bound_s(4, 0.02))
    assert v.state is not None and v.state.window == 1  # nothing half-done: the window is redone
    faults(v).rules.remove(fault)
    assert [r.window for r in v.run(windows=1)] == [1]


def test_a_dataset_damaged_everywhere_never_stalls_the_run_loop(tmp_path: Path) -> None:
    """Every block of every shard, training and validation, reads back damaged: the loop publishes
    its windows without a retry, and the periodic evaluation is skipped, not retried."""
    name = f"damage-{uuid.uuid4().hex[:8]}"
    url = f"memory://{name}"
    result = init_run(
        [str(write_corpus(tmp_path))],
        base=BASE.replace(windows={"upload_deadline_s": 1.0, "gather_grace_s": 0.05}),
        local={"store": {"url": url}},
        store=StoreSettings(url=url),
        identity=VKEY,
        out=tmp_path / "run.toml",
        shard_tokens=SHARD_TOKENS,
    )
    try:
        spec, store = result.spec, MemoryStore(name)
        for shard in read_dataset_manifest(store, spec).shards:
            store.faults.corrupt(layout.shard_key(result.run_id, shard.sha256))
        local = LocalSettings.from_dict(
            {"poll_interval_s": 0.02, "data": {"cache_dir": str(tmp_path / "cache")}, "validator": {"eval_every": 1}}
        )
        events: list[Event] = []
        v = Validator(spec, store, VKEY, tmp_path / "validator", local=local, emit=events.append)
        published = v.run(windows=2)
        assert [p.window for p in published] == [0, 1] and all(math.isnan(p.val_loss) for p in published)
        assert not any(isinstance(e, (WindowRetry, ModelEvaluated)) for e in events)
        v.close()
    finally:
        MemoryStore.forget(name)
