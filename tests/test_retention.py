"""Retention: the validator deletes old objects after each publish and ``sparseloco-validator gc``
does it at once, and neither ever deletes what a reader of the chain needs.

Run: checkpoint_every 2, retention of 3 windows, every 4th checkpoint archived. At window 10 the
horizon is 7, the anchor checkpoint 6: contributions 7..9, aggregates 6..9 and checkpoints 0, 4
(archived), 6, 8, 10 stay; a joiner, a peer that began catching up from checkpoint 6 at window 8,
and a validator that lost its state directory all continue the chain.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from client.peer.sync import Sync
from protocol import layout
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.replay import Chain
from protocol.settings import LocalSettings, ValidatorSettings
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.cli import cli
from validator.node import Validator
from validator.retention import Retention, plan_collection

pytestmark = pytest.mark.timeout(180)

RETAIN = dataclasses.replace(LOCAL, validator=ValidatorSettings(retain_windows=3, retain_checkpoint_every=4))


@pytest.fixture()
def vkey() -> Identity:
    return Identity.generate()


@pytest.fixture()
def swarm(vkey: Identity) -> Iterator[Swarm]:
    sw = Swarm(tiny_spec(vkey), 2)
    sw.announce_all()
    yield sw
    sw.close()


def validator(sw: Swarm, vkey: Identity, state: Path, local: LocalSettings = RETAIN) -> Validator:
    v = Validator(sw.spec, sw.handle(), vkey, state, local=local)
    v.resume()
    return v


def run_windows(sw: Swarm, v: Validator, until: int) -> None:
    """Every peer uploads an honest contribution, the validator publishes; until window ``until``."""
    while v.state is not None and v.state.window < until:
        st = v.state
        for p in sw.peers:
            sw.upload(p.peer_id, st.window, sw.honest(p, st.params, st.window, st.base))
        assert v.run_window() is not None


def windows_of(sw: Swarm, kind: str) -> set[int]:
    found = set()
    for key in sw.store.list(f"{sw.run}/{kind}/"):
        parsed = layout.parse_key(key, run=sw.run)
        assert parsed.window is not None
        found.add(parsed.window)
    return found


def joined(sw: Swarm) -> tuple[int, str]:
    """A late joiner's (window, fingerprint) after bootstrapping from the store."""
    params: dict[str, torch.Tensor] = {}
    pos = Sync(sw.spec, sw.handle()).bootstrap(params)
    return pos.window, pos.fingerprint


def test_the_validator_keeps_what_the_policy_and_joiners_need(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    v = validator(swarm, vkey, tmp_path / "v")
    run_windows(swarm, v, 10)
    assert windows_of(swarm, "contrib") == {7, 8, 9}
    assert windows_of(swarm, "aggregate") == {6, 7, 8, 9}
    assert windows_of(swarm, "checkpoint") == {0, 4, 6, 8, 10}
    assert len(swarm.store.list(layout.peers_prefix(swarm.run))) == 2  # announcements stay
    assert v.state is not None
    assert joined(swarm) == (10, fingerprint(v.state.params))


def test_a_peer_mid_catch_up_keeps_every_aggregate_it_still_replays(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    v = validator(swarm, vkey, tmp_path / "v")
    run_windows(swarm, v, 8)
    sync = Sync(swarm.spec, swarm.handle())
    pos, params = sync.load_checkpoint(6, sync.launch())  # began catching up from checkpoint 6
    run_windows(swarm, v, 10)  # checkpoints 8 and 10 published, retention ran twice
    assert 6 in windows_of(swarm, "aggregate")
    pos = sync.advance(params, pos)
    assert v.state is not None and (pos.window, pos.base) == (10, v.state.base)


def test_a_validator_without_its_state_continues_from_the_newest_checkpoint(
    swarm: Swarm, vkey: Identity, tmp_path: Path
) -> None:
    v = validator(swarm, vkey, tmp_path / "v")
    run_windows(swarm, v, 9)
    assert v.state is not None
    before = v.state.base
    restarted = validator(swarm, vkey, tmp_path / "fresh")  # aggregate 0 is long gone
    assert restarted.state is not None and (restarted.state.window, restarted.state.base) == (9, before)
    run_windows(swarm, restarted, 10)
    assert joined(swarm)[0] == 10


def test_a_forged_checkpoint_is_never_an_anchor(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    v = validator(swarm, vkey, tmp_path / "v", local=LOCAL)  # no retention while the run grows
    run_windows(swarm, v, 10)
    forged = layout.checkpoint_manifest_key(swarm.run, 7)
    swarm.store.put(forged, b"not a manifest")
    plan = plan_collection(
        swarm.store,
        swarm.run,
        swarm.run_hash,
        current=10,
        policy=Retention(3, 0),
        signers=swarm.spec.validator.public_keys,
    )
    assert plan.anchor == 6 and forged not in plan.delete
    assert layout.checkpoint_manifest_key(swarm.run, 2) in plan.delete
    # a checkpoint goes manifest first, then its files
    ckpt2 = [k for k in plan.delete if k.startswith(layout.checkpoint_prefix(swarm.run, 2))]
    assert ckpt2[0].endswith("/manifest") and len(ckpt2) == 2


def test_a_checkpoint_whose_files_are_junk_is_never_an_anchor(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    """Junk at a real checkpoint's weight key (present, but not the bytes its manifest signed) once
    made that checkpoint the anchor, and aggregates before it were deleted: files are checked by
    sha256, and a caller's set of verified files saves reading them again."""
    v = validator(swarm, vkey, tmp_path / "v", local=LOCAL)
    run_windows(swarm, v, 10)
    manifest = Chain(swarm.spec, swarm.handle()).manifest(6).value
    weights = manifest.files[0].key
    good = swarm.store.get(weights)
    swarm.store.delete(weights)
    swarm.store.put(weights, bytes(len(good)))  # the signed size, other bytes
    signers = swarm.spec.validator.public_keys
    policy = Retention(3, 0)
    plan = plan_collection(swarm.store, swarm.run, swarm.run_hash, current=10, policy=policy, signers=signers)
    assert plan.anchor == 4 and layout.aggregate_key(swarm.run, 4) not in plan.delete
    swarm.store.delete(weights)
    swarm.store.put(weights, good)
    seen: set[tuple[str, str]] = set()
    plan = plan_collection(
        swarm.store, swarm.run, swarm.run_hash, current=10, policy=policy, signers=signers, verified=seen
    )
    assert plan.anchor == 6 and (weights, manifest.files[0].sha256) in seen


def test_gc_command_lists_then_deletes_with_totals(swarm: Swarm, vkey: Identity, tmp_path: Path) -> None:
    v = validator(swarm, vkey, tmp_path / "v", local=LOCAL)
    run_windows(swarm, v, 10)
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(swarm.spec.to_toml())
    args = ["gc", "--run", str(run_toml), "--store", f"memory://{swarm.name}", "--retain-windows", "3"]
    runner = CliRunner()
    before = set(swarm.store.list(f"{swarm.run}/"))

    dry = runner.invoke(cli, [*args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    report = json.loads(dry.output)
    assert (report["current"], report["horizon"], report["anchor"], report["dry_run"]) == (10, 7, 6, True)
    assert set(swarm.store.list(f"{swarm.run}/")) == before  # a dry run deletes nothing
    gone = {d["key"] for d in report["delete"]}
    assert report["totals"]["delete"] == {
        "objects": len(gone),
        "bytes": sum(swarm.store.size(k) for k in gone),
    }
    assert report["by_kind"]["checkpoint"]["delete"]["objects"] == 4  # checkpoints 2 and 4, two keys each

    human = runner.invoke(cli, args)
    assert human.exit_code == 0, human.output
    assert "deleted" in human.output and "total" in human.output
    assert set(swarm.store.list(f"{swarm.run}/")) == before - gone
    assert joined(swarm)[0] == 10

    again = runner.invoke(cli, [*args, "--json"])
    assert json.loads(again.output)["delete"] == []


def test_gc_refuses_without_a_policy(swarm: Swarm, tmp_path: Path) -> None:
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(swarm.spec.to_toml())
    out = CliRunner().invoke(cli, ["gc", "--run", str(run_toml), "--store", f"memory://{swarm.name}"])
    assert out.exit_code == 2 and "retention is off" in out.output


def test_a_policy_keeps_at_least_two_windows() -> None:
    with pytest.raises(ConfigError):
        Retention(1, 0)
    with pytest.raises(ConfigError):
        ValidatorSettings(retain_windows=1)
    assert not Retention().enabled
