"""Several validators agree on each window: in-process validators over one memory store.

Four validator keys, a quorum of three. Each test runs the validators as threads of this process
(the same ``Validator`` class the ``sparseloco-validator run`` processes run) and checks what the
store and their logs hold afterwards: what was certified, by whom, what was objected to, and that
no two aggregates of one window were ever certified. tests/test_demo_validators.py runs the same
with real processes.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protocol import layout
from protocol.caps import published_bytes
from protocol.errors import MalformedPayload, ObjectNotFound
from protocol.events import AgreementStep, Event, WindowPublished
from protocol.identity import Identity
from protocol.model import build_model, parameters_of
from protocol.quorum import Quorum
from protocol.replay import Chain
from protocol.wire.quorum import decode_certificate, decode_proposal, encode_proposal
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.log import ContributionLog
from validator.node import Validator
from validator.signed import KEEP_WINDOWS, SIGNED_FILE, SigningRecord

pytestmark = pytest.mark.timeout(240)

N, M = 4, 3


class Validators:
    """N validators of one run over one memory store, with 3 honest peers uploading window 0."""

    def __init__(self, tmp: Path, handover_s: float = 2.0) -> None:
        self.keys = [Identity.generate() for _ in range(N)]
        self.spec = tiny_spec(
            self.keys[0], validator={"public_keys": [k.public_key_hex for k in self.keys], "handover_s": handover_s}
        )
        self.quorum = Quorum.of(self.spec)
        self.by_id = {k.peer_id: k for k in self.keys}
        self.tmp = tmp
        self.swarm = Swarm(self.spec, 3)
        self.swarm.announce_all()
        self.events: dict[str, list[Event]] = {k.peer_id: [] for k in self.keys}
        self.validators: dict[str, Validator] = {}
        self.results: dict[str, list[WindowPublished]] = {}
        self.threads: dict[str, threading.Thread] = {}

    def state_dir(self, vid: str) -> Path:
        return self.tmp / vid

    def open(self, vid: str, fault: str = "") -> Validator:
        v = Validator(
            self.spec,
            self.swarm.handle(),
            self.by_id[vid],
            self.state_dir(vid),
            local=LOCAL,
            emit=self.events[vid].append,
            fault=fault,
        )
        v.resume()
        self.validators[vid] = v
        return v

    def open_all(self, ids: list[str] | None = None, liar: str = "") -> None:
        genesis = self.quorum.leader(0, 0)  # the launch is the first validator's; the others find it
        for vid in sorted(ids or self.quorum.ids, key=lambda v: v != genesis):
            self.open(vid, fault="liar" if vid == liar else "")

    def upload_window0(self) -> None:
        params = {n: p.detach().clone() for n, p in parameters_of(build_model(self.spec.model)).items()}
        base = next(iter(self.validators.values())).state.base  # type: ignore[union-attr]
        for p in self.swarm.peers:
            self.swarm.upload(p.peer_id, 0, self.swarm.honest(p, params, 0, base))

    def start(self, vid: str, windows: int = 1) -> None:
        v = self.validators[vid]
        t = threading.Thread(target=lambda: self.results.__setitem__(vid, v.run(windows=windows)), daemon=True)
        self.threads[vid] = t
        t.start()

    def join(self, ids: list[str] | None = None, timeout: float = 180.0) -> None:
        for vid in ids or list(self.threads):
            self.threads[vid].join(timeout)
            assert not self.threads[vid].is_alive(), f"validator {vid} did not finish"

    def stop(self, vid: str) -> None:
        self.validators[vid].stop.set()
        self.threads[vid].join(60)

    def close(self) -> None:
        for vid in list(self.threads):
            self.validators[vid].stop.set()
            self.threads[vid].join(60)
        for v in self.validators.values():
            v.close()
        self.swarm.close()

    def certificate(self, window: int = 0):  # type: ignore[no-untyped-def]
        data = self.swarm.store.get(layout.aggregate_key(self.swarm.run, window), max_bytes=published_bytes(self.spec))
        return decode_certificate(
            data,
            run_hash=self.swarm.run_hash,
            max_bytes=published_bytes(self.spec),
            allowed_signers=self.spec.validator.public_keys,
            quorum=M,
            window=window,
        ).value

    def steps(self, vid: str, step: str) -> list[AgreementStep]:
        return [e for e in self.events[vid] if isinstance(e, AgreementStep) and e.step == step]

    def endorsements(self, window: int = 0) -> list[str]:
        return self.swarm.store.list(layout.endorsement_prefix(self.swarm.run, window))


@pytest.fixture()
def vs(tmp_path: Path) -> Iterator[Validators]:
    v = Validators(tmp_path)
    yield v
    v.close()


def wait_for(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll ``condition`` (an event in the store or the logs) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_quorum_certifies_the_leaders_proposal_and_every_validator_follows_it(vs: Validators) -> None:
    vs.open_all()
    vs.upload_window0()
    for vid in vs.quorum.ids:
        vs.start(vid)
    vs.join()
    cert = vs.certificate()
    leader = vs.quorum.leader(0, 0)
    assert cert.aggregate.sender == leader and len(cert.signers) >= M
    assert set(cert.signers) <= set(vs.quorum.ids)
    # every validator stands at the certified digest, with θ_{t+1} it decided or recomputed
    assert {v.state.base for v in vs.validators.values()} == {cert.aggregate.digest}  # type: ignore[union-attr]
    fps = {
        hashlib.sha256(b"".join(p.numpy().tobytes() for p in v.state.params.values())).hexdigest()
        for v in vs.validators.values()
    }  # type: ignore[union-attr]
    assert len(fps) == 1
    # a peer reads the certificate through the chain, with the run's keys and quorum
    found = Chain(vs.spec, vs.swarm.handle()).next_aggregate(0, cert.aggregate.value.base)
    assert found is not None and found.digest == cert.aggregate.digest
    reports = {vid: r[0] for vid, r in vs.results.items()}
    assert {r.leader for r in reports.values()} == {leader} and {r.view for r in reports.values()} == {0}
    # each validator's log holds the agreement it saw
    with ContributionLog(vs.state_dir(leader) / "contributions.sqlite") as log:
        steps = log.agreement()
    events = {(a.validator, a.event) for a in steps}
    assert (leader, "proposed") in events and (leader, "endorsed") in events
    certified = [a for a in steps if a.event == "certified"]
    assert len(certified) == 1 and set((certified[0].detail or "").split(",")) == set(cert.signers)


def test_a_lying_leader_is_objected_to_and_the_next_view_is_certified(vs: Validators) -> None:
    liar = vs.quorum.leader(0, 0)
    vs.open_all(liar=liar)
    vs.upload_window0()
    for vid in vs.quorum.ids:
        vs.start(vid)
    vs.join()
    cert = vs.certificate()
    assert cert.aggregate.sender == vs.quorum.leader(0, 1)  # the next in the rotation proposed it
    assert int(cert.aggregate.value.metadata["view"]) == 1
    lie = decode_proposal(
        vs.swarm.store.get(layout.proposal_key(vs.swarm.run, 0, liar), max_bytes=1 << 26),
        run_hash=vs.swarm.run_hash,
        max_bytes=1 << 26,
        allowed_signers=vs.spec.validator.public_keys,
    )
    assert lie.value.aggregate.digest != cert.aggregate.digest
    honest = [vid for vid in vs.quorum.ids if vid != liar]
    for vid in honest:  # every honest validator objected, and sees the others' objections too
        objected = {e.validator for e in vs.steps(vid, "objected") if e.digest == lie.value.aggregate.digest}
        assert objected == set(honest), (vid, objected)
        assert all("delta" in e.detail for e in vs.steps(vid, "objected"))
    assert {v.state.base for v in vs.validators.values()} == {cert.aggregate.digest}  # type: ignore[union-attr]


def test_a_dead_leader_is_replaced_after_the_handover_timeout(vs: Validators) -> None:
    dead = vs.quorum.leader(0, 0)
    alive = [vid for vid in vs.quorum.ids if vid != dead]
    vs.open_all()  # the dead one created the launch and then never ran a window
    vs.upload_window0()
    for vid in alive:
        vs.start(vid)
    vs.join(alive)
    cert = vs.certificate()
    assert cert.aggregate.sender == vs.quorum.leader(0, 1) and set(cert.signers) == set(alive)
    nxt = vs.quorum.leader(0, 1)
    assert [e.view for e in vs.steps(nxt, "handover")] == [1]


def test_fewer_than_a_quorum_stall_without_forking_and_resume_when_one_returns(vs: Validators) -> None:
    leader = vs.quorum.leader(0, 0)
    late = vs.quorum.leader(0, 2)
    first = [vid for vid in vs.quorum.ids if vid not in (late, vs.quorum.leader(0, 3))]
    assert leader in first and len(first) == 2
    vs.open_all()
    vs.upload_window0()
    for vid in first:
        vs.start(vid)
    wait_for(lambda: len(vs.endorsements()) >= 2)  # both signed the leader's proposal: 2 of 3
    wait_for(lambda: all(vs.validators[v].agreement is not None for v in first))
    with pytest.raises(ObjectNotFound):
        vs.swarm.store.get(layout.aggregate_key(vs.swarm.run, 0), max_bytes=1 << 26)
    assert all(t.is_alive() for t in vs.threads.values())  # waiting, not failed
    vs.start(late)  # a third validator is back: it judges the proposal, endorses it, certifies
    vs.join()
    cert = vs.certificate()
    assert cert.aggregate.sender == leader and set(cert.signers) == {*first, late}
    proposals = vs.swarm.store.list(layout.proposal_prefix(vs.swarm.run, 0))
    assert len(proposals) == 1  # nobody proposed a second aggregate while it stalled


def test_a_validator_that_signed_another_digest_never_endorses_this_one(vs: Validators) -> None:
    stubborn = vs.quorum.leader(0, 1)
    vs.open_all()
    SigningRecord(vs.state_dir(stubborn)).claim(0, "ab" * 32)  # it signed something else before a restart
    vs.open(stubborn)  # reopened: the record is read back
    vs.upload_window0()
    for vid in vs.quorum.ids:
        vs.start(vid)
    others = [vid for vid in vs.quorum.ids if vid != stubborn]
    vs.join(others)
    cert = vs.certificate()
    assert stubborn not in cert.signers and set(cert.signers) == set(others)
    vs.join([stubborn])  # it still follows the certified chain
    assert vs.validators[stubborn].state.base == cert.aggregate.digest  # type: ignore[union-attr]
    assert json.loads((vs.state_dir(stubborn) / SIGNED_FILE).read_text()) == {"0": "ab" * 32}


def test_a_follower_objects_to_a_contribution_that_is_not_the_one_named(vs: Validators) -> None:
    leader = vs.quorum.leader(0, 0)
    vs.open_all()
    vs.upload_window0()
    vs.start(leader)
    key = layout.proposal_key(vs.swarm.run, 0, leader)
    wait_for(lambda: vs.swarm.store.exists(key))
    vs.stop(leader)
    follower = vs.validators[vs.quorum.leader(0, 1)]
    st = follower.state
    assert st is not None and follower.agreement is not None
    cap = 1 << 26
    proposal = decode_proposal(
        vs.swarm.store.get(key, max_bytes=cap),
        run_hash=vs.swarm.run_hash,
        max_bytes=cap,
        allowed_signers=vs.spec.validator.public_keys,
    )

    def judge(p):  # type: ignore[no-untyped-def]
        return follower.agreement.follower.judge(  # type: ignore[union-attr]
            p,
            base=st.base,
            previous_base=st.previous_base,
            params=st.params,
            feedback=follower.feedback,
            reference=st.reference,
        )

    assert judge(proposal).endorsed and judge(proposal).params is not None
    # the same aggregate proposed by a validator that does not lead view 0
    other = vs.by_id[vs.quorum.leader(0, 2)]
    reference = proposal.value.reference
    relabelled = decode_proposal(
        encode_proposal(0, proposal.value.caps, _inner(vs, key), 0, vs.swarm.run_hash, vs.by_id[leader], reference),
        run_hash=vs.swarm.run_hash,
        max_bytes=cap,
        allowed_signers=vs.spec.validator.public_keys,
    )
    assert judge(relabelled).endorsed  # the same proposal signed again: fine
    unstated = decode_proposal(  # without the reference its aggregate names
        encode_proposal(0, proposal.value.caps, _inner(vs, key), 0, vs.swarm.run_hash, vs.by_id[leader]),
        run_hash=vs.swarm.run_hash,
        max_bytes=cap,
        allowed_signers=vs.spec.validator.public_keys,
    )
    assert [r.check for r in judge(unstated).reasons] == ["reference"]
    with pytest.raises(MalformedPayload):  # an aggregate signed by the leader inside another key's proposal
        decode_proposal(
            encode_proposal(0, proposal.value.caps, _inner(vs, key), 0, vs.swarm.run_hash, other),
            run_hash=vs.swarm.run_hash,
            max_bytes=cap,
            allowed_signers=vs.spec.validator.public_keys,
        )
    # a contribution replaced at its key after the leader read it
    victim = proposal.value.aggregate.value.manifest[0].peer_id
    vs.swarm.upload(victim, 0, b"not the contribution the manifest names")
    verdict = judge(proposal)
    assert not verdict.endorsed and [(r.check, r.peer) for r in verdict.reasons] == [("contribution", victim)]


def _inner(vs: Validators, key: str) -> bytes:
    blob = vs.swarm.store.get(key, max_bytes=1 << 26)
    p = decode_proposal(
        blob, run_hash=vs.swarm.run_hash, max_bytes=1 << 26, allowed_signers=vs.spec.validator.public_keys
    )
    size = p.value.aggregate.size
    return blob[len(blob) - 64 - size : len(blob) - 64]


def test_the_signing_record_holds_one_digest_per_window_across_restarts(tmp_path: Path) -> None:
    rec = SigningRecord(tmp_path)
    assert rec.claim(3, "aa" * 32) and rec.claim(3, "aa" * 32)
    assert not rec.claim(3, "bb" * 32)
    again = SigningRecord(tmp_path)  # a restart reads it back
    assert again.signed(3) == "aa" * 32 and not again.claim(3, "bb" * 32)
    assert again.claim(3 + KEEP_WINDOWS, "cc" * 32)  # far enough ahead: window 3 is dropped
    assert SigningRecord(tmp_path).signed(3) is None
    (tmp_path / SIGNED_FILE).write_text("{not json")
    with pytest.raises(RuntimeError):
        SigningRecord(tmp_path)
