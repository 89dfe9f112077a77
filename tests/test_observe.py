"""What operators and volunteers see of a running node: metrics, JSON logs, published outcomes.

The unit tests feed :mod:`protocol.metrics` and :mod:`protocol.logformat` typed events and read
back the Prometheus exposition text and the JSON lines; the outcomes object is checked against
its aggregate's digest. The integration test scrapes the ``--metrics-port`` endpoints of a real
validator and peer process of a small swarm and checks that the peer learned its real score.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.errors import DigestMismatch, MalformedPayload
from protocol.events import (
    AgreementStep,
    Applied,
    PeerWindow,
    StoreErrors,
    WindowOpened,
    WindowPublished,
    WindowWaiting,
)
from protocol.identity import Identity
from protocol.logformat import JsonFormatter, JsonLogLines
from protocol.metrics import Metrics
from protocol.outcomes import PeerOutcome, decode_outcomes, encode_outcomes, outcomes_digest


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of Prometheus exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return samples(resp.read().decode())


def test_peer_metrics_follow_events_over_http() -> None:
    metrics = Metrics(role="peer")
    with metrics.serve(0, "127.0.0.1") as server:
        metrics(
            PeerWindow(
                window=3,
                outcome="uploaded",
                loss=2.5,
                tokens=1000,
                inner_s=2.0,
                upload_bytes=70,
                data_bytes=9,
                wire_up_bytes=900,
                wire_down_bytes=40,
            )
        )
        phase = scrape(server.port)
        assert phase[("sparseloco_phase", (("phase", "waiting_for_aggregate"),))] == 1
        metrics(
            Applied(
                window=3,
                fingerprint="f",
                included=False,
                weight=None,
                contributors=2,
                accepted=False,
                reason="norm_too_large",
                score=-0.25,
                reputation=-0.1,
            )
        )
        got = scrape(server.port)
    assert got[("sparseloco_window", ())] == 4
    assert got[("sparseloco_inner_loss", ())] == 2.5
    assert got[("sparseloco_tokens_per_second", ())] == 500
    assert got[("sparseloco_upload_bytes_total", ())] == 70
    assert got[("sparseloco_data_bytes_total", ())] == 9
    assert got[("sparseloco_wire_bytes_total", (("direction", "up"),))] == 900
    assert got[("sparseloco_wire_bytes_total", (("direction", "down"),))] == 40
    assert got[("sparseloco_score", ())] == -0.25
    assert got[("sparseloco_reputation", ())] == -0.1
    assert got[("sparseloco_contributions_total", (("outcome", "rejected"),))] == 1
    assert got[("sparseloco_check_failures_total", (("reason", "norm_too_large"),))] == 1
    assert got[("sparseloco_phase", (("phase", "training"),))] == 1
    assert got[("sparseloco_phase", (("phase", "waiting_for_aggregate"),))] == 0
    assert got[("sparseloco_phase_seconds", (("phase", "inner"),))] == 2.0


def test_validator_metrics() -> None:
    metrics = Metrics(role="validator")
    metrics(WindowOpened(window=5, base="b", opened_at=0.0))
    metrics(WindowWaiting(window=5, waiting_for=["a", "b"], uploaded=1, closes_in_s=3.0))
    metrics(
        WindowPublished(
            window=5,
            accepted=2,
            rejected=1,
            val_loss=3.5,
            digest="d",
            fingerprint="f",
            published_at=1.0,
            reasons={"stale_base": 1},
            seconds={"gather": 1.5},
            uploaded=3,
            download_bytes=300,
        )
    )
    from prometheus_client import generate_latest

    got = samples(generate_latest(metrics.registry).decode())
    assert got[("sparseloco_peers_expected", ())] == 3
    assert got[("sparseloco_peers_uploaded", ())] == 3
    assert got[("sparseloco_contributions_total", (("outcome", "accepted"),))] == 2
    assert got[("sparseloco_check_failures_total", (("reason", "stale_base"),))] == 1
    assert got[("sparseloco_phase_seconds", (("phase", "gather"),))] == 1.5
    metrics(StoreErrors(window=5, failed={"list_contributions": 4, "read_contribution": 2}, reasons={"unavailable": 6}))
    metrics(StoreErrors(window=6, failed={"list_contributions": 1}))
    got = samples(generate_latest(metrics.registry).decode())
    assert got[("sparseloco_store_errors_total", (("kind", "list_contributions"),))] == 5
    assert got[("sparseloco_store_errors_total", (("kind", "read_contribution"),))] == 2
    assert got[("sparseloco_download_bytes_total", ())] == 300
    assert got[("sparseloco_val_loss", ())] == 3.5
    names = {name for name, _ in got}
    peer_only = {"sparseloco_inner_loss", "sparseloco_tokens_per_second", "sparseloco_score", "sparseloco_reputation"}
    assert not names & (peer_only | {"sparseloco_upload_bytes_total", "sparseloco_wire_bytes_total"})  # not at 0
    peer_names = {name for name, _ in samples(generate_latest(Metrics(role="peer").registry).decode())}
    assert peer_only <= peer_names and not peer_names & {"sparseloco_val_loss", "sparseloco_peers_expected"}


def test_json_log_lines_have_the_fixed_fields() -> None:
    stream = io.StringIO()
    JsonLogLines(stream, role="peer")(PeerWindow(window=2, outcome="skipped", reason="late"))
    record = logging.LogRecord("validator.node", logging.WARNING, __file__, 1, "slow %s", ("store",), None)
    lines = [json.loads(stream.getvalue()), json.loads(JsonFormatter().format(record))]
    for line in lines:
        assert {"time", "level", "logger", "event", "message"} <= set(line)
        assert line["time"].endswith("Z")
    assert lines[0]["event"] == "window" and lines[0]["window"] == 2 and "[" not in lines[0]["message"]
    assert lines[1] == {**lines[1], "level": "warning", "event": "log", "message": "slow store"}


def test_a_failed_window_line_says_why_not_only_the_reason() -> None:
    """The human line of a failed window carries the error's text, escaped for the panel."""
    from protocol.events import describe

    failed = PeerWindow(window=37, outcome="failed", reason="unavailable", detail="get 'r/[x]': connection refused")
    line = describe(failed)
    assert line.endswith("(unavailable: get 'r/\\[x]': connection refused)"), line
    skipped = PeerWindow(window=3, outcome="skipped", reason="window closed before training started")
    assert describe(skipped).endswith("(window closed before training started)")


def test_a_stopped_line_says_what_the_peer_did() -> None:
    from protocol.events import Stopped, describe

    line = describe(Stopped(reason="interrupted", window=244, windows_trained=243, inner_s=589.4, withdrawn=True))
    assert line == (
        "peer stopped (interrupted) at window 244: 243 window(s) trained since it started, 589 s of inner steps;"
        " withdrawn: the validator no longer waits for it"
    )
    assert describe(Stopped(role="validator", reason="done", window=5)) == "validator stopped (done) at window 5"


def test_outcomes_are_bound_to_their_digest() -> None:
    peer = Identity.generate().peer_id
    blob = encode_outcomes("ab" * 32, 7, [PeerOutcome(peer, False, "copied", 0.5, -0.2)])
    table = decode_outcomes(blob, digest=outcomes_digest(blob), run_hash="ab" * 32, window=7)
    assert table.get(peer) == PeerOutcome(peer, False, "copied", 0.5, -0.2)
    with pytest.raises(DigestMismatch):
        decode_outcomes(blob.replace(b"copied", b"copier"), digest=outcomes_digest(blob), run_hash="ab" * 32, window=7)
    with pytest.raises(MalformedPayload):
        decode_outcomes(blob, digest=outcomes_digest(blob), run_hash="ab" * 32, window=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_swarm_metrics_endpoints_and_real_scores(tmp_path: Path) -> None:
    """A validator and a peer with --metrics-port: scraped while they run; the peer's Applied
    events carry the validator's verdict on its contribution, not the manifest weight."""
    from client.demo.swarm import VALIDATOR, LocalSwarm
    from tests.test_integration_swarm import TIMEOUT_S, small

    vport, pport = free_port(), free_port()
    with LocalSwarm(
        tmp_path / "run",
        peers=2,
        windows=3,
        store="file",
        overrides=small(),
        # both peers in from window 0: a slow start of the scraped peer must not find the run over
        validator_args=["--metrics-port", str(vport), "--metrics-host", "127.0.0.1", "--wait-for-peers", "2"],
    ) as swarm:
        swarm.start_validator()  # genesis once both peers have announced
        swarm.start_peer(0, "--metrics-port", str(pport), "--metrics-host", "127.0.0.1")
        swarm.start_peer(1)
        p0 = swarm.peers["peer-0"]

        def judged() -> bool:
            return any(isinstance(e, Applied) and e.accepted is not None for e in p0.events)

        swarm.follow(judged, timeout_s=TIMEOUT_S)
        swarm.pause(VALIDATOR)  # the peer now waits for the next aggregate: it stays up to be scraped
        try:
            peer = scrape(pport)
        finally:
            swarm.resume(VALIDATOR)
        # The validator reports window 0 published after the peers can read its aggregate.
        swarm.follow(lambda: 0 in swarm.published, timeout_s=TIMEOUT_S)
        validator = scrape(vport)
        accepted_in_0 = swarm.published[0].accepted  # a loaded machine may start peer-1 a window late
        verdict = next(e for e in p0.events if isinstance(e, Applied) and e.accepted is not None)
        swarm.follow(swarm.finished, timeout_s=TIMEOUT_S)
        swarm.wait_exit(timeout_s=60.0)
    # the validator's own verdict (a tiny model's honest update may be judged ineffective: either way
    # the peer sees it, with its score), not the manifest weight
    assert verdict.accepted is not None and verdict.score is not None and verdict.reputation is not None
    outcome = "accepted" if verdict.accepted else "rejected"
    assert peer[("sparseloco_window", ())] >= 1
    assert peer[("sparseloco_upload_bytes_total", ())] > 0
    assert peer[("sparseloco_tokens_per_second", ())] > 0
    assert peer[("sparseloco_contributions_total", (("outcome", outcome),))] >= 1
    assert ("sparseloco_score", ()) in peer and ("sparseloco_reputation", ()) in peer
    decided = {
        o: validator.get(("sparseloco_contributions_total", (("outcome", o),)), 0.0) for o in ("accepted", "rejected")
    }
    assert decided["accepted"] >= accepted_in_0 and sum(decided.values()) >= 1
    assert validator[("sparseloco_peers_uploaded", ())] >= 1
    assert validator[("sparseloco_download_bytes_total", ())] > 0
    assert ("sparseloco_phase_seconds", (("phase", "gather"),)) in validator


# ---------------------------------------------------------------------- outcomes, status, inspect over a store
def test_validator_publishes_outcomes_that_status_and_inspect_read(tmp_path: Path) -> None:
    """One window with honest peers and one stale upload: the aggregate names the outcomes' digest,
    status shows the head, every uploader (the rejected one with its reason) and whether a local
    windows.jsonl matches the chain; inspect over the store with the run's keys passes every object."""
    import hashlib

    from client.inspect import inspect_store
    from client.status import run_status
    from protocol import layout
    from protocol.chain import read_aggregate
    from protocol.model import build_model, parameters_of
    from protocol.outcomes import OUTCOMES, read_outcomes
    from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
    from validator.node import Validator

    vkey = Identity.generate()
    sw = Swarm(tiny_spec(vkey), 3)
    try:
        sw.announce_all()
        v = Validator(sw.spec, sw.handle(), vkey, tmp_path / "v", local=LOCAL)
        v.resume()
        params = {n: p.detach().clone() for n, p in parameters_of(build_model(sw.spec.model)).items()}
        for p in sw.peers[:2]:
            sw.upload(p.peer_id, 0, sw.honest(p, params, 0, v.state.base))
        stale = sw.peers[2]
        sw.upload(stale.peer_id, 0, sw.honest(stale, params, 0, hashlib.sha256(b"another base").hexdigest()))
        assert v.run_window() is not None

        agg = read_aggregate(
            sw.store, sw.run, sw.run_hash, 0, allowed_signers=sw.spec.validator.public_keys, max_bytes=1 << 26
        )
        assert agg is not None and isinstance(agg.value.metadata[OUTCOMES], str)
        table = read_outcomes(sw.store, sw.run, agg)
        assert table is not None and set(table.rows) == {p.peer_id for p in sw.peers}
        assert table.rows[stale.peer_id].accepted is False and table.rows[stale.peer_id].reason == "stale_base"

        state = tmp_path / "peer"
        state.mkdir()
        record = {"window": 0, "aggregate": agg.digest, "fingerprint": agg.value.fingerprint}
        (state / "windows.jsonl").write_text(json.dumps(record) + "\n")
        status = run_status(sw.spec, sw.store, store_url="memory://", state_dir=state, peer_id=sw.peers[0].peer_id)
        assert status.head is not None and status.head.window == 0 and status.head.digest == agg.digest
        assert status.outcomes == "published"
        assert {r.peer: r.accepted for r in status.peers} == {p.peer_id: p != stale for p in sw.peers}
        assert status.local is not None and status.local.matches is True
        json.dumps(status.to_json(), allow_nan=False)
        (state / "windows.jsonl").write_text(json.dumps({**record, "fingerprint": "0" * 64}) + "\n")
        diverged = run_status(sw.spec, sw.store, store_url="memory://", state_dir=state, peer_id=None)
        assert diverged.local is not None and diverged.local.matches is False

        keys = [k.hex() for k in map(bytes.fromhex, sw.spec.validator.public_keys)]
        results = list(
            inspect_store(sw.store, f"{sw.run}/", label="memory://", run_hash=sw.run_hash, allowed_signers=keys)
        )
        kinds = {layout.parse_key(r.path.removeprefix("memory://")).kind for r in results}
        assert {"aggregate", "contrib", "peers", "outcomes", "checkpoint"} <= kinds
        assert all(r.ok for r in results), [r.line for r in results if not r.ok]
        assert any(r.line.startswith("OK outcomes window=0 peers=3 accepted=2") for r in results)
    finally:
        sw.close()


def test_split_store_url() -> None:
    from client.inspect import split_store_url

    run = "ab12cd34ef56ab78"
    assert split_store_url(f"s3://b/runs/{run}/aggregate/00000003?region=x") == (
        "s3://b/runs?region=x",
        f"{run}/aggregate/00000003",
    )
    assert split_store_url(f"file:///srv/store/{run}/contrib/") == ("file:///srv/store", f"{run}/contrib/")
    assert split_store_url("file:///srv/store", run) == ("file:///srv/store", f"{run}/")
    assert split_store_url(f"file:///srv/store/{run}", run) == ("file:///srv/store", f"{run}")
    assert split_store_url(f"dht://{run}/checkpoint/00000000/manifest")[1] == f"{run}/checkpoint/00000000/manifest"


# ---------------------------------------------------------------------- commands that never train load no torch
_PROBE = """
import sys
from importlib import import_module
module, func, *args = sys.argv[1:]
sys.argv = [module, *args]
try:
    getattr(import_module(module), func)()
except SystemExit:
    pass
print("TORCH_LOADED" if "torch" in sys.modules else "TORCH_FREE", file=sys.stderr)
"""


def test_commands_that_do_not_train_never_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    from checkpoint_fixtures import make_run

    from validator.log import ContributionLog

    run = make_run(tmp_path, windows=(0,))
    with ContributionLog(tmp_path / "log.sqlite"):
        pass
    commands = [
        ["validator.cli", "main", "keygen", "--key", str(tmp_path / "v.pem")],
        ["validator.cli", "main", "logs", "--db", str(tmp_path / "log.sqlite")],
        ["validator.cli", "main", "run", "--help"],
        ["client.tools", "main", "run-id", str(run.run_toml)],
        ["client.tools", "main", "--help"],
        ["client.cli", "main", "id", "--state", str(tmp_path / "peer")],
        ["client.cli", "main", "--help"],
        ["client.cli", "main", "join", "--help"],
    ]
    for argv in commands:
        proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
        assert proc.stderr.strip().endswith("TORCH_FREE"), (argv, proc.stdout[-500:], proc.stderr[-2000:])


def test_both_commands_timestamp_human_lines_and_write_json_lines(tmp_path: Path) -> None:
    """A run.toml without a dataset: each command reports the configuration error as a timestamped
    human line, or as a JSON object with the fixed fields under --log-format json."""
    import re
    import subprocess
    import sys

    from checkpoint_fixtures import make_run

    run = make_run(tmp_path, windows=(0,))
    base = {
        "validator": ["validator.cli", "main", "run", "--run", str(run.run_toml), "--key", str(tmp_path / "v.pem")],
        "peer": ["client.cli", "main", "join", "--run", str(run.run_toml), "--state", str(tmp_path / "p")],
    }
    (tmp_path / "v.pem").write_bytes(b"")  # never read: the run.toml is refused first
    stamp = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")
    for role, argv in base.items():
        for fmt in ("human", "json"):
            cmd = [sys.executable, "-c", _RUN, *argv, "--log-format", fmt]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2, (role, fmt, proc.stdout, proc.stderr)
            lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
            assert lines and any("dataset" in line for line in lines), (role, fmt, lines)
            for line in lines:
                if fmt == "human":
                    assert stamp.match(line), (role, line)
                else:
                    record = json.loads(line)
                    assert {"time", "level", "logger", "event", "message"} <= set(record), line


_RUN = """
import sys
from importlib import import_module
module, func, *args = sys.argv[1:]
sys.argv = [module, *args]
getattr(import_module(module), func)()
"""


def test_agreement_metrics_appear_with_several_validators() -> None:
    from prometheus_client import generate_latest

    def published(window: int, **several: Any) -> WindowPublished:
        return WindowPublished(
            window=window,
            accepted=1,
            rejected=0,
            val_loss=3.0,
            digest="d",
            fingerprint="f",
            published_at=1.0,
            **several,
        )

    one = Metrics(role="validator")
    one(published(4))  # one validator: no agreement metric at all
    assert "agreement" not in generate_latest(one.registry).decode()
    assert "certified" not in generate_latest(one.registry).decode()

    metrics = Metrics(role="validator")
    steps = ["proposed", "objected", "objected", "handover", "proposed", "endorsed", "endorsed", "endorsed"]
    for i, step in enumerate(steps):
        metrics(AgreementStep(window=5, validator=f"v{i % 4}", step=step, view=int(i >= 3)))
    metrics(AgreementStep(window=5, validator="v1", step="certified", view=1, detail="v1,v2,v3"))
    metrics(published(5, leader="v2", view=1, signers=["v1", "v2", "v3"]))
    got = samples(generate_latest(metrics.registry).decode())
    counted = {labels[0][1]: v for (name, labels), v in got.items() if name == "sparseloco_agreement_steps_total"}
    assert counted == {"proposed": 2, "objected": 2, "handover": 1, "endorsed": 3, "certified": 1}
    assert got[("sparseloco_certified_view", ())] == 1 and got[("sparseloco_certified_signers", ())] == 3
    metrics(published(6, leader="v3", view=0, signers=["v1", "v3"]))
    got = samples(generate_latest(metrics.registry).decode())
    assert got[("sparseloco_certified_view", ())] == 0 and got[("sparseloco_certified_signers", ())] == 2


def test_a_peers_human_lines_are_not_wrapped_when_written_to_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal (a log file, a pipe) every event is one line, however long."""
    from client.progress import PeerDisplay
    from protocol.events import PeerWindow

    display = PeerDisplay()  # stderr is captured: not a terminal, no panel
    detail = "x" * 300
    display.emit(PeerWindow(window=7, outcome="failed", reason="unavailable", detail=detail))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "window 7" in err[0], err
