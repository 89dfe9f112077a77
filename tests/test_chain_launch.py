"""The chain's root and the reader side, on a shared directory that anyone can write into.

* An object at a chain key that does not verify (or does not chain) counts as absent: it does not
  stop the validator, does not make peers treat the window as closed, does not stop a joining
  peer, and the validator publishes over it.
* A contribution key holding bytes its owner did not sign for this window is never blamed on the
  owner (``foreign``, neutral for reputation).
* Launch nonce: window 0 builds on the digest of the genesis manifest, so a relaunch of the same
  RunSpec over a store with leftovers of an earlier launch adopts none of them; a validator whose
  state belongs to another launch than the store's refuses clearly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from client.peer.sync import NotReady, Sync
from protocol import layout
from protocol.chain import read_aggregate, read_launch
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.model import build_model, fingerprint, parameters_of
from protocol.store.local import LocalStore
from tests.validator_fixtures import Swarm, tiny_spec
from validator.node import Validator
from validator.reputation import FOREIGN

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def vkey() -> Identity:
    return Identity.generate()


@pytest.fixture()
def swarm(vkey: Identity, tmp_path: Path) -> Iterator[Swarm]:
    sw = Swarm(tiny_spec(vkey), 3)
    sw.store = LocalStore(tmp_path / "store")  # type: ignore[assignment]  # a shared directory
    sw.announce_all()
    yield sw
    sw.close()


def validator(sw: Swarm, vkey: Identity, state: Path, clock: float | None = None) -> Validator:
    times = iter(range(10**6))
    v = Validator(
        sw.spec,
        LocalStore(sw.store.root),  # type: ignore[attr-defined]
        vkey,
        state,
        clock=(lambda: clock + next(times) * 1e-3) if clock is not None else time.time,
    )
    v.resume()
    return v


def theta0(sw: Swarm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in parameters_of(build_model(sw.spec.model)).items()}


def window(sw: Swarm, v: Validator, peers: list[Identity] | None = None) -> None:
    """Every peer uploads an honest contribution on the validator's current state; it publishes."""
    st = v.state
    assert st is not None
    for p in sw.peers if peers is None else peers:
        sw.upload(p.peer_id, st.window, sw.honest(p, st.params, st.window, st.base))
    assert v.run_window() is not None


def junk(sw: Swarm, key: str, data: bytes = b"\x00" * 200) -> None:
    sw.store.put(key, data)


def bootstrap(sw: Swarm) -> tuple[int, dict[str, torch.Tensor], Sync]:
    sync = Sync(sw.spec, LocalStore(sw.store.root), poll_interval_s=0.01)  # type: ignore[attr-defined]
    params: dict[str, torch.Tensor] = {}
    pos = sync.bootstrap(params)
    return pos.window, params, sync


# ---------------------------------------------------------------------------------------- absent
def test_junk_at_the_next_aggregate_key_is_not_published(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    v = validator(swarm, vkey, tmp_path / "v")
    window(swarm, v)  # aggregate 0
    st = v.state
    assert st is not None and st.window == 1
    junk(swarm, layout.aggregate_key(swarm.run, 1))  # garbage
    v.log.close()

    # a restarted validator: no ConfigError in the adopt path, still at window 1
    v = validator(swarm, vkey, tmp_path / "v")
    assert v.state is not None and v.state.window == 1
    # peers do not treat window 1 as closed, and a joining peer joins
    at, params, sync = bootstrap(swarm)
    assert at == 1 and not sync.aggregate_published(1, v.state.base) and not sync.aggregate_published(1)
    assert not sync.wait_until_published(1, base=v.state.base, stop_at=0.0)
    # the validator publishes over the junk, and peers follow
    window(swarm, v)
    assert read_aggregate(
        swarm.store, swarm.run, swarm.run_hash, 1, allowed_signers=swarm.spec.validator.public_keys, max_bytes=1 << 26
    )
    at, params, _ = bootstrap(swarm)
    assert at == 2 and fingerprint(params) == fingerprint(v.state.params)  # type: ignore[union-attr]
    v.close()


def test_forged_or_foreign_aggregate_and_genesis_are_absent(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    # junk at the genesis key before the validator starts: peers wait, the validator replaces it
    junk(swarm, layout.checkpoint_manifest_key(swarm.run, 0))
    with pytest.raises(NotReady):
        bootstrap(swarm)
    v = validator(swarm, vkey, tmp_path / "v")
    assert v.state is not None and v.state.window == 0
    # an aggregate signed by a stranger (a valid object, not a validator's) at the next key
    mallory = Identity.generate()
    other = Validator(tiny_spec(mallory), LocalStore(tmp_path / "m"), mallory, tmp_path / "ms")
    other.resume()
    window(swarm, other, [])  # mallory's own aggregate 0, in its own store
    swarm.store.put(layout.aggregate_key(swarm.run, 0), other.store.get(layout.aggregate_key(other.run_id, 0)))
    other.close()
    at, _, sync = bootstrap(swarm)
    assert at == 0 and not sync.aggregate_published(0, v.state.base)
    v.log.close()
    v = validator(swarm, vkey, tmp_path / "v")
    assert v.state is not None and v.state.window == 0
    window(swarm, v)
    assert bootstrap(swarm)[0] == 1
    v.close()


# ---------------------------------------------------------------------------------------- blame
def test_overwritten_contribution_keys_are_never_blamed_on_their_owner(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    v = validator(swarm, vkey, tmp_path / "v")
    victim, copied, honest = swarm.peers
    window(swarm, v)  # window 0: everyone honest, so there are signed objects to replay
    old = swarm.store.get(layout.contrib_key(swarm.run, 0, copied.peer_id), max_bytes=1 << 26)
    st = v.state
    assert st is not None
    swarm.upload(victim.peer_id, 1, os.urandom(4000))  # garbage at the victim's key
    swarm.upload(copied.peer_id, 1, old)  # the peer's own window-0 object, replayed
    swarm.upload(honest.peer_id, 1, swarm.honest(honest, st.params, 1, st.base))
    assert v.run_window() is not None
    rows = {r.peer: r for r in v.log.rows(windows=(1, 1))}
    assert rows[victim.peer_id].reason == rows[copied.peer_id].reason == FOREIGN
    assert "window 0" in (rows[copied.peer_id].detail or "")
    assert rows[honest.peer_id].accepted
    before, after = v._standings(1), v._standings(2)  # window 1 changed nothing about them
    assert all(after[p.peer_id] == before[p.peer_id] for p in (victim, copied))
    v.close()


# ---------------------------------------------------------------------------------------- launches
def test_a_relaunch_adopts_nothing_of_the_previous_launch(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    first = validator(swarm, vkey, tmp_path / "first", clock=1_000.0)
    for _ in range(3):  # aggregates 0, 1, 2 and checkpoint 2 (checkpoint_every = 2)
        window(swarm, first)
    old_launch = first.state.launch  # type: ignore[union-attr]
    first.close()
    # The store loses the genesis (expired on a DHT, or removed by an operator); the rest stays.
    os.remove(Path(swarm.store.root) / layout.checkpoint_manifest_key(swarm.run, 0))  # type: ignore[attr-defined]

    second = validator(swarm, vkey, tmp_path / "second", clock=2_000.0)
    st = second.state
    assert st is not None and st.window == 0 and st.launch != old_launch and st.base == st.launch
    launch = read_launch(swarm.store, swarm.run, swarm.run_hash, allowed_signers=swarm.spec.validator.public_keys)
    assert launch.digest == st.launch and launch.value.published_at == 2_000.0
    # peers: not the old checkpoint 2, not the old aggregates — window 0 of the new launch
    at, params, sync = bootstrap(swarm)
    assert at == 0 and fingerprint(params) == fingerprint(theta0(swarm))
    assert not sync.aggregate_published(0, st.base)
    window(swarm, second)  # aggregate 0 of the new launch replaces the old one
    at, params, _ = bootstrap(swarm)
    assert at == 1 and fingerprint(params) == fingerprint(second.state.params)  # type: ignore[union-attr]
    agg = read_aggregate(
        swarm.store, swarm.run, swarm.run_hash, 0, allowed_signers=swarm.spec.validator.public_keys, max_bytes=1 << 26
    )
    assert agg is not None and agg.value.base == st.launch
    second.close()

    # The old state directory continues another launch than the store's: refused clearly.
    with pytest.raises(ConfigError, match="continues launch"):
        validator(swarm, vkey, tmp_path / "first")


def test_a_state_continues_its_own_launch_even_when_the_store_lost_the_genesis(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    v = validator(swarm, vkey, tmp_path / "v", clock=5_000.0)
    window(swarm, v)
    launch = v.state.launch  # type: ignore[union-attr]
    key = layout.checkpoint_manifest_key(swarm.run, 0)
    before = swarm.store.get(key)
    v.close()
    os.remove(Path(swarm.store.root) / key)  # type: ignore[attr-defined]
    again = validator(swarm, vkey, tmp_path / "v", clock=9_000.0)
    assert again.state is not None and again.state.launch == launch and again.state.window == 1
    assert swarm.store.get(key) == before  # written again, byte for byte: the same root
    assert bootstrap(swarm)[0] == 1
    again.close()
