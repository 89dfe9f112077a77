"""``sparseloco-validator audit``: a run's published aggregates recomputed from its store, without a key.

Small runs are built in process (validators in threads over one in-memory store), then copied and
damaged on purpose: a contribution replaced, a certificate re-signed with leaked keys around a Δ̄
the contributions do not give. The audit must find each, name it and exit 1; an honest copy passes.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from protocol import broadcast, layout
from protocol.aggregate import apply_outer
from protocol.caps import proposal_bytes, published_bytes
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.quorum import Quorum
from protocol.replay import Chain, Position, initial_params, replayed
from protocol.store.memory import MemoryStore
from protocol.wire import SparseDelta, encode_aggregate
from protocol.wire.delta import round_values
from protocol.wire.quorum import (
    Endorsement,
    decode_certificate,
    decode_proposal,
    encode_certificate,
    encode_endorsement,
    encode_proposal,
)
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.audit import MISMATCH, OK, UNCHECKED, Auditor, WindowAudit
from validator.cli import cli
from validator.node import Validator
from validator.retention import Retention, collect, plan_collection

WINDOWS = 3


@dataclass
class Run:
    """A run's spec, its validator keys and the name of the in-memory store that holds it."""

    spec: RunSpec
    keys: list[Identity]
    name: str

    @property
    def run(self) -> str:
        return layout.run_id(self.spec.hash())


def _build(n_validators: int, **sections: dict[str, object]) -> Run:
    keys = [Identity.generate() for _ in range(n_validators)]
    several = {"public_keys": [k.public_key_hex for k in keys], "handover_s": 2.0} if n_validators > 1 else {}
    spec = tiny_spec(keys[0], validator=several, **sections)
    sw = Swarm(spec, 3)
    sw.announce_all()
    with tempfile.TemporaryDirectory() as states:
        vs = [Validator(spec, sw.handle(), k, f"{states}/v{i}", local=LOCAL) for i, k in enumerate(keys)]
        genesis = Quorum.of(spec).leader(0, 0)  # the launch is its; the others find it in the store
        for v in sorted(vs, key=lambda v: v.identity.peer_id != genesis):
            v.resume()
        for w in range(WINDOWS):
            st = vs[0].state
            assert st is not None and st.window == w
            for p in sw.peers:
                sw.upload(p.peer_id, w, sw.honest(p, st.params, w, st.base))
            threads = [threading.Thread(target=v.run, kwargs={"windows": 1}) for v in vs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert all(v.state is not None and v.state.window == w + 1 for v in vs)
        for v in vs:
            v.pool.shutdown(wait=True)
            v.log.close()
    return Run(spec, keys, sw.name)


def _copy(r: Run) -> Run:
    """Another store holding the same objects (a copy of the run to damage)."""
    src, name = MemoryStore(r.name), f"audit-copy-{uuid.uuid4().hex[:8]}"
    dst = MemoryStore(name)
    for key in src.list(""):
        dst.put(key, src.get(key, max_bytes=1 << 30))
    return Run(r.spec, r.keys, name)


@pytest.fixture(scope="module")
def several() -> Iterator[Run]:
    """4 validators (quorum 3), 3 windows of 3 contributions, Δ̄ re-compressed from 2 of them with
    an error-feedback buffer the validators keep."""
    r = _build(4, outer={"recompress_from": 2, "recompress_beta": 0.9})
    yield r
    MemoryStore.forget(r.name)


@pytest.fixture(scope="module")
def single() -> Iterator[Run]:
    r = _build(1)
    yield r
    MemoryStore.forget(r.name)


def _cli(r: Run, tmp_path: Path, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(r.spec.to_toml())
    res = CliRunner().invoke(cli, ["audit", "--run", str(spec_path), "--store", f"memory://{r.name}", *args])
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return res.exit_code, lines, res.stdout


def _audit(r: Run, start: int | None = None) -> list[WindowAudit]:
    auditor = Auditor(r.spec, MemoryStore(r.name))
    try:
        return auditor.audit(start).rows
    finally:
        auditor.close()


def test_an_honest_run_of_several_validators_passes_every_window(several: Run, tmp_path: Path) -> None:
    code, lines, _ = _cli(several, tmp_path, "--json")
    rows, summary = lines[:-1], lines[-1]
    assert code == 0
    assert [row["window"] for row in rows] == list(range(WINDOWS))
    assert all(row["verdict"] == OK for row in rows), rows
    assert all(row["contributions"] == 3 and len(row["signers"]) >= 3 for row in rows)
    assert summary["ok"] == WINDOWS and summary["mismatch"] == 0
    assert any("norm reference" in n for n in summary["notes"])


def test_an_honest_copy_passes_and_the_table_names_what_is_skipped(several: Run, tmp_path: Path) -> None:
    copy = _copy(several)
    try:
        code, _, out = _cli(copy, tmp_path)
        assert code == 0
        assert f"{WINDOWS} windows: {WINDOWS} ok, 0 mismatch, 0 unchecked" in out
        assert "not checked:" in out
    finally:
        MemoryStore.forget(copy.name)


def test_a_replaced_contribution_is_a_digest_mismatch(several: Run, tmp_path: Path) -> None:
    copy = _copy(several)
    try:
        store = MemoryStore(copy.name)
        chain = Chain(copy.spec, store)
        agg = chain.aggregate(1)
        assert agg is not None
        victim = agg.value.manifest[0].peer_id
        other = agg.value.manifest[1].peer_id
        key = layout.contrib_key(copy.run, 1, victim)
        store.put(key, store.get(layout.contrib_key(copy.run, 1, other), max_bytes=1 << 30))  # valid bytes, wrong ones
        code, lines, _ = _cli(copy, tmp_path, "--json")
        rows = {row["window"]: row for row in lines[:-1]}
        assert code == 1
        assert rows[0]["verdict"] == OK
        # θ is still carried past it, but the buffer after window 1 could not be recomputed
        assert rows[2]["verdict"] == UNCHECKED and "buffer unknown" in str(rows[2]["detail"])
        assert rows[1]["verdict"] == MISMATCH
        assert "contribution" in str(rows[1]["detail"]) and "the manifest names" in str(rows[1]["detail"])
        assert victim[:8] in str(rows[1]["detail"])
    finally:
        MemoryStore.forget(copy.name)


def _forge_certificate(r: Run, window: int) -> None:
    """Aggregate ``window`` re-signed by its leader's (leaked) key with Δ̄ × 4 and a matching
    fingerprint, its proposal replaced, and a certificate endorsed by every key."""
    store, h = MemoryStore(r.name), r.spec.hash()
    keys = [k.public_key_hex for k in r.keys]
    cert = decode_certificate(
        store.get(layout.aggregate_key(r.run, window), max_bytes=published_bytes(r.spec)),
        run_hash=h,
        max_bytes=published_bytes(r.spec),
        allowed_signers=keys,
        quorum=3,
        window=window,
    )
    honest = cert.value.aggregate
    leader = next(k for k in r.keys if k.peer_id == honest.sender)
    chain = Chain(r.spec, store)
    params = initial_params(r.spec.model)
    launch = chain.launch()
    replayed(chain, params, Position(0, launch.digest, launch.value.fingerprint), until=window)
    tensors = {
        n: replace(t, values=round_values(t.values * 4.0))
        if isinstance(t, SparseDelta)
        else replace(t, base=t.base * 4.0)
        for n, t in honest.value.tensors.items()
    }
    apply_outer(params, broadcast.applied(tensors), honest.value.alpha)
    forged = replace(honest.value, tensors=tensors, fingerprint=fingerprint(params))
    blob = encode_aggregate(forged, leader)
    proposal_key = layout.proposal_key(r.run, window, leader.peer_id)
    p = decode_proposal(
        store.get(proposal_key, max_bytes=proposal_bytes(r.spec)),
        run_hash=h,
        max_bytes=proposal_bytes(r.spec),
        allowed_signers=keys,
        window=window,
    )
    store.put(proposal_key, encode_proposal(p.value.view, p.value.caps, blob, window, h, leader, p.value.reference))
    digest = hashlib.sha256(blob).hexdigest()
    endorsements = [encode_endorsement(Endorsement(h, window, p.value.view, leader.peer_id, digest), k) for k in r.keys]
    store.put(layout.aggregate_key(r.run, window), encode_certificate(blob, endorsements, window, h, leader))


def test_a_re_signed_certificate_with_a_false_delta_is_a_mismatch(several: Run, tmp_path: Path) -> None:
    copy = _copy(several)
    last = WINDOWS - 1
    try:
        _forge_certificate(copy, last)
        assert Chain(copy.spec, MemoryStore(copy.name)).aggregate(last) is not None  # peers would take it
        code, lines, _ = _cli(copy, tmp_path, "--json")
        rows = {row["window"]: row for row in lines[:-1]}
        assert code == 1
        assert rows[last]["verdict"] == MISMATCH
        assert str(rows[last]["detail"]).startswith("delta")
        assert all(rows[w]["verdict"] == OK for w in range(last))
        assert lines[-1]["mismatch"] == 1
    finally:
        MemoryStore.forget(copy.name)


def test_an_under_signed_certificate_stops_the_audit_as_a_mismatch(several: Run) -> None:
    copy = _copy(several)
    try:
        store, h = MemoryStore(copy.name), copy.spec.hash()
        agg = Chain(copy.spec, store).aggregate(1)
        assert agg is not None
        blob = encode_aggregate(agg.value, next(k for k in copy.keys if k.peer_id == agg.sender))
        digest = hashlib.sha256(blob).hexdigest()
        two = [encode_endorsement(Endorsement(h, 1, 0, agg.sender, digest), k) for k in copy.keys[:2]]
        store.put(layout.aggregate_key(copy.run, 1), encode_certificate(blob, two, 1, h, copy.keys[0]))
        rows = _audit(copy)
        assert [(r.window, r.verdict) for r in rows] == [(0, OK), (1, MISMATCH)]  # θ cannot go past it
        assert "no_quorum" in rows[1].detail
    finally:
        MemoryStore.forget(copy.name)


def test_a_missing_proposal_and_junk_at_an_aggregate_key_are_mismatches(several: Run) -> None:
    copy = _copy(several)
    try:
        store = MemoryStore(copy.name)
        agg = Chain(copy.spec, store).aggregate(0)
        assert agg is not None
        store.delete(layout.proposal_key(copy.run, 0, agg.sender))
        store.put(layout.aggregate_key(copy.run, 1), b"\x00junk" * 100)
        rows = _audit(copy)
        assert [(r.window, r.verdict) for r in rows] == [(0, MISMATCH), (1, MISMATCH)]
        assert rows[0].detail.startswith("no proposal by its signer")
        assert "does not verify" in rows[1].detail
    finally:
        MemoryStore.forget(copy.name)


def test_from_a_checkpoint_a_re_compressed_window_is_unchecked(several: Run) -> None:
    rows = _audit(several, start=2)  # checkpoint_every = 2: θ from checkpoint 2, the buffer unknown
    assert [(r.window, r.verdict) for r in rows] == [(2, UNCHECKED)]
    assert "buffer unknown" in rows[0].detail


def test_a_window_range_from_genesis_carries_the_buffer_through_the_windows_before_it(
    several: Run, tmp_path: Path
) -> None:
    code, lines, _ = _cli(several, tmp_path, "--json", "--from", "1", "--to", "1")
    assert code == 0
    assert [(row["window"], row["verdict"]) for row in lines[:-1]] == [(1, OK)]
    assert lines[-1]["start"] == 1


def test_a_single_validator_run_is_audited_from_a_checkpoint(single: Run) -> None:
    rows = _audit(single, start=2)  # nothing to keep between windows: the checkpoint is enough
    assert [(r.window, r.verdict) for r in rows] == [(2, OK)]


def test_contributions_deleted_by_retention_leave_a_window_unchecked(several: Run) -> None:
    copy = _copy(several)
    try:
        store = MemoryStore(copy.name)
        keys = copy.spec.validator.public_keys
        plan = plan_collection(store, copy.run, copy.spec.hash(), current=WINDOWS, policy=Retention(2, 0), signers=keys)
        collect(store, plan)  # the contributions of window 0 go; every aggregate stays
        assert not store.list(layout.contrib_prefix(copy.run, 0)) and store.list(layout.contrib_prefix(copy.run, 1))
        rows = _audit(copy)
        assert rows[0].verdict == UNCHECKED and "contributions gone" in rows[0].detail
        # without window 0's contributions its buffer is unknown, so the re-compressed Δ̄ after it too
        assert [(r.verdict, r.detail) for r in rows[1:]] == [(UNCHECKED, "re-compressed, buffer unknown")] * (
            WINDOWS - 1
        )
    finally:
        MemoryStore.forget(copy.name)


def test_a_single_validator_run_passes_and_says_what_it_did_not_check(single: Run, tmp_path: Path) -> None:
    code, lines, _ = _cli(single, tmp_path, "--json")
    rows, summary = lines[:-1], lines[-1]
    assert code == 0
    assert [row["verdict"] for row in rows] == [OK] * WINDOWS
    assert all("not recomputed" in str(row["detail"]) for row in rows)
    assert any("single validator" in n for n in summary["notes"])


def test_a_single_validator_run_with_a_replaced_contribution_fails(single: Run, tmp_path: Path) -> None:
    copy = _copy(single)
    try:
        store = MemoryStore(copy.name)
        agg = Chain(copy.spec, store).aggregate(0)
        assert agg is not None
        victim = agg.value.manifest[0].peer_id
        store.put(layout.contrib_key(copy.run, 0, victim), b"junk")
        code, lines, _ = _cli(copy, tmp_path, "--json")
        assert code == 1
        assert lines[0]["verdict"] == MISMATCH and victim[:8] in str(lines[0]["detail"])
    finally:
        MemoryStore.forget(copy.name)


def test_a_run_toml_without_a_launch_in_the_store_is_a_configuration_error(single: Run, tmp_path: Path) -> None:
    empty = Run(single.spec, single.keys, f"audit-empty-{uuid.uuid4().hex[:8]}")
    code, _, _ = _cli(empty, tmp_path)
    assert code == 2
