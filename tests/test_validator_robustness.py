"""The validator in an open swarm: free identities, poisoners, copiers and vandals.

Each attack that worked against the window-median checks is reproduced here against the real
Validator (memory store, the small test model): a majority of huge or tiny sybils, same-time
copies, junk under unannounced keys, announcements floods, objects signed by someone else at a
peer's key, bytes changed at a key, a non-finite aggregate. ``scripts/bench_robustness.py``
measures the same attacks over many windows.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from protocol.aggregate import NormLimit, clip_to_limits
from protocol.chain import read_aggregate
from protocol.identity import Identity
from protocol.model import build_model, parameters_of
from protocol.outcomes import PeerOutcome
from protocol.settings import load_settings
from protocol.store.memory import MemoryStore
from protocol.wire import GENESIS
from tests.validator_fixtures import Swarm, tiny_spec
from validator import randomness
from validator.budgets import Budgets
from validator.gather import PeerRegistry
from validator.node import Validator
from validator.reference import NormReference, TensorNorms
from validator.reputation import Standing, is_established, standings, update
from validator.state import ValidatorState, load_state, save_state
from validator.trial import culprits as _culprits

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def vkey() -> Identity:
    return Identity.generate()


def theta0(sw: Swarm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in parameters_of(build_model(sw.spec.model)).items()}


def make_validator(
    sw: Swarm, vkey: Identity, state_dir: object, store: MemoryStore | None = None, **kw: object
) -> Validator:
    v = Validator(sw.spec, store or sw.handle(), vkey, str(state_dir), **kw)  # type: ignore[arg-type]
    v.resume()
    return v


def honest_window(sw: Swarm, v: Validator, peers: list[Identity]) -> None:
    st = v.state
    assert st is not None
    for p in peers:
        sw.upload(p.peer_id, st.window, sw.honest(p, st.params, st.window, st.base))


def scaled(sw: Swarm, signer: Identity, v: Validator, factor: float) -> bytes:
    st = v.state
    assert st is not None
    delta = {n: t * factor for n, t in sw.delta(signer, st.params, st.window).items()}
    return sw.blob(signer, st.window, st.base, sw.encode(delta, st.window))


@pytest.fixture()
def established(vkey: Identity, tmp_path: object) -> Iterator[tuple[Swarm, Validator, list[Identity]]]:
    """Three honest peers with one accepted, scored window behind them (established after one)."""
    sw = Swarm(tiny_spec(vkey, validator={"probation_passes": 1}), 3)
    sw.announce_all()
    v = make_validator(sw, vkey, tmp_path)
    honest_window(sw, v, sw.peers)
    report = v.run_window()
    assert report is not None and report.accepted == 3
    yield sw, v, sw.peers
    v.close()
    sw.close()


# ------------------------------------------------------------------ crash: nothing non-finite is signed
def test_a_majority_of_huge_sybils_cannot_crash_the_validator(vkey: Identity, tmp_path: object) -> None:
    sw = Swarm(tiny_spec(vkey), 8)
    sw.announce_all()
    honest, sybils = sw.peers[:2], sw.peers[2:]
    v = make_validator(sw, vkey, tmp_path)
    for w in range(2):
        honest_window(sw, v, honest)
        for s in sybils:
            sw.upload(s.peer_id, w, scaled(sw, s, v, 1e30))
        report = v.run_window()  # used to raise: a non-finite val_loss in signed metadata
        assert report is not None and report.val_loss == report.val_loss  # finite, not NaN
        rows = {r.peer: r for r in v.log.rows(windows=(w, w))}
        assert not any(rows[s.peer_id].accepted for s in sybils)
        agg = read_aggregate(
            sw.store, sw.run, sw.run_hash, w, allowed_signers=sw.spec.validator.public_keys, max_bytes=1 << 26
        )
        assert agg is not None and all(bool(torch.isfinite(t.values).all()) for t in agg.value.tensors.values())
    assert v.state is not None and all(bool(torch.isfinite(p).all()) for p in v.state.params.values())
    v.close()
    sw.close()


def test_contributions_that_make_the_aggregate_non_finite_are_bisected_away(
    established: tuple[Swarm, Validator, list[Identity]],
) -> None:
    sw, v, peers = established
    st = v.state
    assert st is not None
    good = {
        p.peer_id: sw.held(p, st.window, st.base, sw.encode(sw.delta(p, st.params, st.window), st.window))
        for p in peers
    }
    out = "head.output.weight"
    dense = torch.zeros(sw.schema[out])
    dense.view(-1)[:64] = -3e38  # logits overflow
    poison = sw.held(Identity.generate(), st.window, st.base, sw.encode({out: dense}, st.window))
    contribs = {**good, "zz-poison": poison}
    result = v.decider.aggregator.aggregate(
        st.params, v.committer.feedback, contribs, {p: None for p in contribs}, window=st.window
    )
    assert result.dropped == {"zz-poison"} and result.val_loss is not None
    assert all(bool(torch.isfinite(p).all()) for p in result.params.values())
    assert _culprits(["a", "b", "c", "d"], lambda ps: "c" not in ps) == ["c"]


# ------------------------------------------------------------------ honest peers are not excluded
def test_tiny_sybils_cannot_move_the_reference_or_get_honest_peers_excluded(
    established: tuple[Swarm, Validator, list[Identity]],
) -> None:
    sw, v, honest = established
    sybils = [Identity.generate() for _ in range(6)]  # twice as many as honest peers
    for s in sybils:
        sw.announce(s)
    ref_before = v.state.reference  # type: ignore[union-attr]
    assert not ref_before.empty
    for _ in range(3):
        honest_window(sw, v, honest)
        for s in sybils:
            sw.upload(s.peer_id, v.state.window, scaled(sw, s, v, 1e-3))  # type: ignore[union-attr]
        report = v.run_window()
        assert report is not None and report.accepted == 3, v.log.rows(windows=(report.window, report.window))
        assert report.reasons == {"norm_tiny": 6}
    standing = v._standings(v.state.window)  # type: ignore[union-attr]
    assert all(standing[p.peer_id].excluded_until == 0 for p in honest)
    ref = v.state.reference  # type: ignore[union-attr]
    for name, r in ref.tensors.items():  # moved with the honest updates, within the allowed step
        assert ref_before.tensors[name].norm / 8 <= r.norm <= ref_before.tensors[name].norm * 8


def test_fetch_failures_and_foreign_objects_are_not_held_against_the_peer() -> None:
    from protocol.config import ValidatorConfig

    cfg = ValidatorConfig(exclude_after_failures=1)
    for reason, check in [
        ("store_error", "fetch"),
        ("fetch_timeout", "fetch"),
        ("foreign", "signature"),
        ("bad_signature", "signature"),
        ("malformed", "format"),
        ("probation", "probation"),
        ("norm_tiny", "norm"),
    ]:
        assert update(Standing(), PeerOutcome("p", False, reason, window=0, check=check), cfg) == Standing(), reason
    blamed = update(Standing(), PeerOutcome("p", False, "malformed", window=0, check="schema"), cfg)  # a body it signed
    assert blamed.excluded_until == 1 + cfg.exclude_windows
    # junk from identities without a standing does not grow the table
    junk = [PeerOutcome(f"j{i}", False, "store_error", window=0, check="fetch") for i in range(100)]
    assert standings(junk, cfg) == {}
    passed = Standing()
    for w in range(cfg.probation_passes):
        assert not is_established(passed, cfg)
        passed = update(passed, PeerOutcome("p", True, None, 0.01, window=w), cfg)
    assert passed.passes == cfg.probation_passes and is_established(passed, cfg)


def test_a_foreign_object_at_a_peers_key_is_not_that_peers_bad_signature(
    established: tuple[Swarm, Validator, list[Identity]],
) -> None:
    sw, v, honest = established
    st = v.state
    assert st is not None
    victim, vandal = honest[0], Identity.generate()
    honest_window(sw, v, honest[1:])
    sw.upload(victim.peer_id, st.window, sw.honest(vandal, st.params, st.window, st.base))
    report = v.run_window()
    assert report is not None and report.reasons == {"foreign": 1}
    assert v._standings(st.window + 1)[victim.peer_id].failures == 0


# ------------------------------------------------------------------ copies: bound to content
def test_a_same_poll_resigned_copy_never_gets_the_original_rejected(
    established: tuple[Swarm, Validator, list[Identity]],
) -> None:
    sw, v, honest = established
    st = v.state
    assert st is not None
    copier = Identity.generate()
    sw.announce(copier)
    enc = sw.encode(sw.delta(honest[0], st.params, st.window), st.window)
    for p in honest[1:]:
        sw.upload(p.peer_id, st.window, sw.honest(p, st.params, st.window, st.base))
    sw.upload(honest[0].peer_id, st.window, sw.blob(honest[0], st.window, st.base, enc))
    sw.upload(copier.peer_id, st.window, sw.blob(copier, st.window, st.base, enc))  # same poll
    report = v.run_window()
    assert report is not None
    rows = {r.peer: r for r in v.log.rows(windows=(st.window, st.window))}
    original = rows[honest[0].peer_id]
    assert original.accepted and "order unknown" in (original.detail or "")  # a tie: the original stays
    assert rows[copier.peer_id].reason in (None, "probation")  # and the copy is not called the original
    assert v._standings(st.window + 1)[honest[0].peer_id].failures == 0


def test_bytes_changed_at_a_key_after_they_were_read_are_a_violation(
    established: tuple[Swarm, Validator, list[Identity]],
) -> None:
    sw, v, honest = established
    st = v.state
    assert st is not None
    first = scaled(sw, honest[0], v, 0.5)  # what was read first (before a restart)
    v.log.note_received(
        st.window, honest[0].peer_id, received_at=1.0, nbytes=len(first), digest=hashlib.sha256(first).hexdigest()
    )
    honest_window(sw, v, honest)  # the peer signed other bytes at its key since (a swap)
    report = v.run_window()
    assert report is not None and report.reasons == {"mutated": 1}


# ------------------------------------------------------------------ budgets
class CountingStore(MemoryStore):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.read: list[str] = []

    def get(self, key: str, *, max_bytes: int = 1 << 30) -> bytes:
        self.read.append(key)
        return super().get(key, max_bytes=max_bytes)


def test_unannounced_junk_is_counted_never_read_and_reads_stay_within_budget(vkey: Identity, tmp_path: object) -> None:
    sw = Swarm(tiny_spec(vkey), 6)
    sw.announce_all()
    store = CountingStore(sw.name)
    v = make_validator(sw, vkey, tmp_path, store=store, budgets=Budgets(max_fetches=4))
    honest_window(sw, v, sw.peers)
    strangers = [Identity.generate().peer_id for _ in range(50)]
    for s in strangers:
        sw.upload(s, 0, os.urandom(4096))
    report = v.run_window()
    assert report is not None and report.reasons["unannounced"] == 50
    assert not any(s in key for key in store.read for s in strangers)
    rows = v.log.rows(windows=(0, 0))
    assert {r.peer for r in rows} == {p.peer_id for p in sw.peers}  # no rows for junk keys
    assert sum(r.reason == "over_budget" for r in rows) == 2 and report.accepted == 4
    assert v.log.window(0).unannounced == 50  # type: ignore[union-attr]
    v.close()
    sw.close()


def test_the_budgets_of_the_local_settings_bound_the_reads(vkey: Identity, tmp_path: Path) -> None:
    """A budget set in a settings file or the environment is the validator's budget."""
    (tmp_path / "mine.toml").write_text("[budgets]\nmax_fetches = 5\nfetch_timeout_s = 12.5\n")
    local = load_settings(None, settings_path=tmp_path / "mine.toml", env={"SPARSELOCO_BUDGETS_MAX_FETCHES": "4"})
    sw = Swarm(tiny_spec(vkey), 6)
    sw.announce_all()
    v = make_validator(sw, vkey, tmp_path / "v", local=local)
    assert v.budgets is local.budgets and (v.budgets.max_fetches, v.budgets.fetch_timeout_s) == (4, 12.5)
    honest_window(sw, v, sw.peers)
    report = v.run_window()
    assert report is not None and report.accepted == 4
    assert sum(r.reason == "over_budget" for r in v.log.rows(windows=(0, 0))) == 2
    v.close()
    sw.close()


def test_announcement_intake_is_bounded_per_poll_and_in_total(vkey: Identity) -> None:
    sw = Swarm(tiny_spec(vkey), 0)
    for _ in range(40):
        sw.announce(Identity.generate())
    reg = PeerRegistry(sw.handle(), sw.run, sw.run_hash, secret=b"k", max_per_poll=10, max_tracked=25)
    assert len(reg.refresh()) == 10 and reg.ignored == 30
    reg.refresh()
    assert len(reg.refresh()) == 25  # the cap
    now = reg.clock()
    reg.first_seen = {p: now - 1000.0 for p in reg.first_seen}
    assert reg.make_room(keep=set(list(reg.first_seen)[:5]), idle_s=600.0) == 20 and len(reg.announcements) == 5
    sw.close()


def test_announce_only_identities_hold_a_window_open_only_briefly(vkey: Identity, tmp_path: object) -> None:
    deadline = 8.0
    sw = Swarm(tiny_spec(vkey, windows={"upload_deadline_s": deadline}), 2)
    sw.announce_all()
    v = make_validator(sw, vkey, tmp_path, budgets=Budgets(newcomer_wait=0.1))
    honest_window(sw, v, sw.peers)
    assert v.run_window() is not None
    for _ in range(20):
        sw.announce(Identity.generate())  # announce, never upload
    honest_window(sw, v, sw.peers)
    report = v.run_window()
    assert report is not None and report.accepted == 2
    assert report.seconds["gather"] < deadline / 2, report.seconds
    v.close()
    sw.close()


class _Polls(MemoryStore):
    """The validator's handle on the store, telling the test each time a window's uploads are listed."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.listed = threading.Semaphore(0)

    def list(self, prefix: str) -> list[str]:
        out = super().list(prefix)
        if "/contrib/" in prefix:
            self.listed.release()
        return out


class _Clock:
    """Wall time plus an offset the test moves (the validator's clock)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def test_an_announce_only_identity_does_not_hold_window_0_open(vkey: Identity, tmp_path: object) -> None:
    """Every peer is a newcomer in window 0; once the honest uploads are in, a free announcement
    that never uploads holds the window only for ``newcomer_wait`` of the deadline."""
    deadline = 8.0
    sw = Swarm(tiny_spec(vkey, windows={"upload_deadline_s": deadline}), 2)
    sw.announce_all()
    sw.announce(Identity.generate())  # announce, never upload
    v = make_validator(sw, vkey, tmp_path, budgets=Budgets(newcomer_wait=0.1))
    honest_window(sw, v, sw.peers)
    report = v.run_window()
    assert report is not None and report.window == 0 and report.accepted + report.reasons.get("probation", 0) == 2
    assert report.seconds["gather"] < deadline / 2, report.seconds
    v.close()
    sw.close()


def test_peers_slow_on_their_first_window_are_all_waited_for(vkey: Identity, tmp_path: object) -> None:
    """Window 0 counts the newcomers' share of the deadline from its first upload: peers that all
    start late (past ``newcomer_wait`` of the deadline) and upload one after another are all in."""
    deadline = 60.0
    sw = Swarm(tiny_spec(vkey, windows={"upload_deadline_s": deadline}), 3)
    sw.announce_all()
    clock, store = _Clock(), _Polls(sw.name)
    v = make_validator(sw, vkey, tmp_path, store=store, clock=clock, budgets=Budgets(newcomer_wait=0.25))
    st = v.state
    assert st is not None
    blobs = [(p.peer_id, sw.honest(p, st.params, 0, st.base)) for p in sw.peers]
    clock.offset = 0.5 * deadline  # the window opened half a deadline ago: past newcomer_wait

    def slow_peers() -> None:
        for peer, blob in blobs:
            assert store.listed.acquire(timeout=deadline)  # the validator polled without it
            sw.upload(peer, 0, blob)

    feeder = threading.Thread(target=slow_peers)
    feeder.start()
    report = v.run_window()
    feeder.join()
    rows = v.log.rows(windows=(0, 0))
    assert report is not None and {r.peer for r in rows} == {p.peer_id for p in sw.peers}
    assert all(r.reason != "late" for r in rows), rows
    assert report.seconds["gather"] < deadline / 4  # closed once all were in, not at the deadline
    v.close()
    sw.close()


# ------------------------------------------------------------------ probation and capacity
def test_new_identities_count_only_when_scored_and_cannot_crowd_out_known_peers(
    vkey: Identity, tmp_path: object
) -> None:
    validator = {"max_contributors": 3, "eval_peers_per_window": 3, "eval_probation_peers": 1, "probation_passes": 1}
    spec = tiny_spec(vkey, validator=validator)  # the known peers are established after one window
    sw = Swarm(spec, 9)
    known, newcomers = sw.peers[:3], sw.peers[3:]
    for p in known:
        sw.announce(p)
    v = make_validator(sw, vkey, tmp_path)
    honest_window(sw, v, known)
    assert v.run_window() is not None
    for p in newcomers:
        sw.announce(p)
    honest_window(sw, v, sw.peers)  # everybody sends a real update
    report = v.run_window()
    assert report is not None
    rows = {r.peer: r for r in v.log.rows(windows=(1, 1))}
    assert all(rows[p.peer_id].accepted for p in known)  # capacity: established first
    counted = [p for p in newcomers if rows[p.peer_id].accepted]
    assert not counted  # max_contributors is full of known peers
    unscored = [p for p in newcomers if rows[p.peer_id].loss_own_after is None]
    assert all(rows[p.peer_id].reason == "probation" for p in unscored)
    assert len(unscored) >= len(newcomers) - 1  # one probation slot of three
    v.close()
    sw.close()


# ------------------------------------------------------------------ randomness: committed, then revealed
def test_the_scoring_secret_is_committed_a_window_ahead_and_revealed_after(
    established: tuple[Swarm, Validator, list[Identity]], vkey: Identity
) -> None:
    sw, v, honest = established
    honest_window(sw, v, honest)
    assert v.run_window() is not None
    aggs = [
        read_aggregate(sw.store, sw.run, sw.run_hash, w, allowed_signers=[vkey.public_key_hex], max_bytes=1 << 26)
        for w in (0, 1)
    ]
    m0, m1 = (a.value.metadata for a in aggs if a is not None)
    secret = randomness.verify_reveal(
        vkey.public_key, sw.run_hash, 1, str(m1[randomness.SECRET]), str(m0[randomness.COMMITMENT])
    )
    digests = {r.peer: r.digest for r in v.log.rows(windows=(1, 1)) if r.digest}
    assert randomness.contributions_root(digests) == m1[randomness.ROOT]  # anyone can redo the draw
    assert len(randomness.window_seed(secret, str(m1[randomness.ROOT]))) == 32
    with pytest.raises(ValueError):
        randomness.verify_reveal(
            vkey.public_key, sw.run_hash, 1, str(m1[randomness.SECRET]), str(m1[randomness.COMMITMENT])
        )


# ------------------------------------------------------------------ the influence bound per row
def test_a_row_cap_bounds_what_one_contributor_does_to_one_row() -> None:
    idx = torch.arange(0, 8, dtype=torch.int64)  # row 0 of a [4, 8] matrix
    one_row = {"w": (idx, torch.full((8,), 1.0))}  # norm √8 in one row
    spread = {"w": (torch.arange(0, 32, 8, dtype=torch.int64), torch.full((4,), 1.0))}  # one value per row
    limit = {"w": NormLimit(norm=10.0, row=1.0, row_len=8)}
    a, b = clip_to_limits([one_row, spread], limit)
    assert float(a["w"][1].norm()) == pytest.approx(1.0)  # the row is capped
    assert torch.equal(b["w"][1], spread["w"][1])  # rows within the cap are untouched
    (c,) = clip_to_limits([spread], {"w": NormLimit(norm=1.0)})  # norm 2 -> 1
    assert float(c["w"][1].norm()) == pytest.approx(1.0)


def test_the_reference_survives_a_restart(tmp_path: object, vkey: Identity) -> None:
    """The reference, its baseline and every standing (with its tenure) come back as they were."""
    ref = NormReference({"w": TensorNorms(1.5, 0.25)}, baseline={"w": TensorNorms(1.0, 0.2)})
    standing = {"p": Standing(0.3, 1, 0, 7, 3, tenure=4)}
    launch = "cd" * 32
    state = ValidatorState(
        "ab" * 32,
        3,
        GENESIS,
        1.0,
        {"w": torch.zeros(2)},
        launch,
        0.5,
        previous_base="ef" * 32,
        reference=ref,
        standings=standing,
    )
    save_state(str(tmp_path), state)
    loaded = load_state(str(tmp_path), "ab" * 32)
    assert loaded is not None and loaded.reference == ref and loaded.previous_base == "ef" * 32
    assert loaded.reference.baseline["w"] == TensorNorms(1.0, 0.2) and loaded.standings == standing
    # a reference written before baselines were kept starts its baseline at itself
    assert NormReference.from_json('{"w":[1.5,0.25]}') == NormReference({"w": TensorNorms(1.5, 0.25)})


def test_genesis_window_accepts_only_scored_newcomers(vkey: Identity, tmp_path: object) -> None:
    spec = tiny_spec(vkey, validator={"eval_peers_per_window": 2, "eval_probation_peers": 2})
    sw = Swarm(spec, 4)
    sw.announce_all()
    v = make_validator(sw, vkey, tmp_path)
    honest_window(sw, v, sw.peers)
    report = v.run_window()
    assert report is not None and report.accepted == 2 and report.reasons == {"probation": 2}
    assert v.state is not None and not v.state.reference.empty  # the first reference is learned
    v.close()
    sw.close()
