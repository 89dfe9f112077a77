"""The images, built and run: the containerised stack trains two windows and the peers agree.

Where a Docker engine answers, ``scripts/build_images.sh`` builds the offline path (a Debian base
from mmdebstrap, the wheelhouse, both images FROM that base; each step reused when it is already
done), and the stack of compose.yaml runs with ``docker run`` on a user-defined network of its
own: SeaweedFS from the validator image, ``sparseloco-validator init`` of a small run, the
validator with its grant server, and two peers that hold only run.toml. The peers train two
windows; both must report the same fingerprint after each, the one the validator published.

Skipped, with the reason, where no engine answers (``docker info``), where the images are not
built yet (a cold build takes 10 to 13 min on 2 cores: ``scripts/build_images.sh`` once, or
``SPARSELOCO_BUILD_IMAGES=1`` to let the test build them) or where the base image is missing and
cannot be built (no mmdebstrap). Where they exist the test still runs the build script, which
rebuilds what the sources changed (seconds). Nothing is built before the engine has answered.
Containers, volumes and the network carry a random suffix and are removed afterwards, also when
the test fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.demo.swarm import SMALL_RUN
from protocol.config import RunSpec
from protocol.events import Applied, WindowPublished, parse_line
from protocol.settings import local_table_toml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "build_images.sh"
BASE = os.environ.get("BASE_IMAGE", "sparseloco-base:bookworm")
PEER = os.environ.get("PEER_IMAGE", "sparseloco-peer")
VALIDATOR = os.environ.get("VALIDATOR_IMAGE", "sparseloco-validator")
WINDOWS = 2
BUILD_TIMEOUT_S = 1800.0  # a cold build: base, wheelhouse and two images (~10 min on 2 cores)
RUN_TIMEOUT_S = 300.0  # the stack, from SeaweedFS's start to the peers' exit

# the build fixture counts against the test timeout: a cold build and the run, with room to spare
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S + 300)]


def _docker(*args: str, timeout: float = 120.0, check: bool = True, stdin: str | None = None) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {shlex.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def _engine_answers() -> str | None:
    """None when ``docker info`` succeeds; otherwise why the test cannot run."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 20 s"
    if done.returncode != 0:
        return f"no Docker engine answers (docker info: {done.stderr.strip()[-200:]})"
    return None


def _image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=60).returncode == 0


def _build(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """scripts/build_images.sh in a session of its own: if the test stops early (a timeout, Ctrl-C),
    the script and what it started (docker build, pip, mmdebstrap) get SIGINT, the script's own
    clean-up path, and no build goes on behind the test."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except BaseException:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def images() -> dict[str, float]:
    """The offline path of scripts/build_images.sh: its seconds, cold or warm."""
    reason = _engine_answers()
    if reason:
        pytest.skip(reason)
    missing = [tag for tag in (BASE, PEER, VALIDATOR) if not _image_exists(tag)]
    if missing and os.environ.get("SPARSELOCO_BUILD_IMAGES") != "1":
        # a cold build takes 10 to 13 min on 2 cores, more than the suite can spend on it
        pytest.skip(
            f"{', '.join(missing)} not built: run scripts/build_images.sh once (10 to 13 min cold), "
            "or set SPARSELOCO_BUILD_IMAGES=1 to let this test build them"
        )
    if not _image_exists(BASE) and shutil.which("mmdebstrap") is None:
        pytest.skip(f"the base image {BASE} is missing and mmdebstrap is not installed to build it")
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    start = time.monotonic()
    done = _build(env)
    if done.returncode == 3:  # a missing prerequisite, said on stderr
        pytest.skip(f"the images cannot be built here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"build_images.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return {"build_s": time.monotonic() - start}


@dataclass
class Stack:
    """Containers, volumes and one network, all named with the same random suffix."""

    suffix: str = field(default_factory=lambda: secrets.token_hex(4))
    containers: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    network: str = ""

    def name(self, what: str) -> str:
        return f"sparseloco-test-{self.suffix}-{what}"

    def volume(self, what: str) -> str:
        name = self.name(what)
        _docker("volume", "create", name)
        self.volumes.append(name)
        return name

    def run(
        self,
        what: str,
        image: str,
        *argv: str,
        alias: str = "",
        env: dict[str, str] | None = None,
        mounts: dict[str, str] | None = None,
        detach: bool = True,
        stdin: str | None = None,
    ) -> str:
        """``docker run`` on the stack's network, ``mounts`` {volume: path}: the container's name
        (detached), or its stdout (``detach=False``, waits for it and fails on a nonzero exit)."""
        name = self.name(what)
        args = ["run", "--name", name, "--network", self.network] + (["-d"] if detach else ["-i"])
        args += ["--network-alias", alias] if alias else []
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        for volume, path in (mounts or {}).items():
            args += ["-v", f"{volume}:{path}"]
        self.containers.append(name)
        out = _docker(*args, image, *argv, stdin=stdin, timeout=RUN_TIMEOUT_S)
        return name if detach else out

    def remove(self) -> None:
        for name in self.containers:
            _docker("rm", "-f", "-v", name, check=False)
        for name in self.volumes:
            _docker("volume", "rm", "-f", name, check=False)
        if self.network:
            _docker("network", "rm", self.network, check=False)


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack()
    s.network = s.name("net")
    try:
        _docker("network", "create", s.network)
        yield s
    finally:
        s.remove()


def _wait_exit(stack: Stack, container: str, deadline: float) -> list[str]:
    """Block until ``container`` exits (``docker wait``); its stdout lines. Fails on a nonzero exit."""
    try:
        code = _docker("wait", container, timeout=max(1.0, deadline - time.monotonic())).strip()
    except subprocess.TimeoutExpired:
        logs = {c: _logs(c)[-1500:] for c in stack.containers}
        pytest.fail(f"{container} still runs after {RUN_TIMEOUT_S} s:\n" + json.dumps(logs, indent=1))
    out = _docker("logs", container, timeout=60)
    assert code == "0", f"{container} exited with {code}:\n{_logs(container)[-3000:]}"
    return out.splitlines()


def _logs(container: str) -> str:
    done = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def _events(lines: list[str]) -> list[Any]:
    out = []
    for line in lines:
        event = parse_line(line)
        if event is not None:
            out.append(event)
    return out


def _seaweed_command() -> list[str]:
    """compose.yaml's SeaweedFS command (it writes the identities file with the one credential,
    then runs weed), with Compose's ``$$`` escapes undone."""
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["seaweedfs"]
    return [str(word).replace("$$", "$") for word in service["command"]]


# Until an object goes into the bucket and comes back: SeaweedFS answers S3 with the credential.
S3_READY = """
import os, sys, time
from protocol.errors import StoreError
from protocol.store.s3 import S3Store
deadline = time.monotonic() + float(sys.argv[1])
store = S3Store("sparseloco", "ready", endpoint_url="http://seaweedfs:8333", region="us-east-1",
                access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                max_attempts=1, retries=0)
while True:
    try:
        store.put("probe", b"ready")
        if store.get("probe") == b"ready":
            store.delete("probe")
            break
    except StoreError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
"""


def _small_run() -> str:
    """The base RunSpec of ``init``: the small run of the integration tests, polling every 0.5 s."""
    spec = RunSpec().replace(**SMALL_RUN)
    return spec.to_toml() + local_table_toml({"poll_interval_s": 0.5})


def test_the_containerised_stack_trains_and_the_peers_agree(images: dict[str, float], stack: Stack) -> None:
    start = time.monotonic()
    deadline = start + RUN_TIMEOUT_S
    credential = {"AWS_ACCESS_KEY_ID": "validator", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20)}
    threads = {"OMP_NUM_THREADS": "1"}

    # SeaweedFS from the validator image (the s3-demo extra), as compose.yaml runs it
    seaweed = stack.run(
        "seaweedfs", VALIDATOR, *_seaweed_command(), alias="seaweedfs", env=credential,
        mounts={stack.volume("seaweed"): "/state"},
    )  # fmt: skip
    probe = [a for k, v in credential.items() for a in ("-e", f"{k}={v}")]
    _docker("exec", *probe, seaweed, "python", "-c", S3_READY, str(RUN_TIMEOUT_S), timeout=RUN_TIMEOUT_S)

    # init: the corpus into the store and run.toml into the volume the peers mount
    run_volume, validator_state = stack.volume("run"), stack.volume("validator")
    init = "cat >/shared/base.toml && exec sparseloco-validator init " + shlex.join(
        [
            "--corpus", "builtin:stdlib", "--spec", "/shared/base.toml", "--out", "/shared/run.toml",
            "--store", "s3://sparseloco/demo?endpoint=http://seaweedfs:8333&region=us-east-1",
            "--grant-url", "http://validator:8710", "--key", "/state/validator.pem",
        ]
    )  # fmt: skip
    stack.run(
        "init", VALIDATOR, "sh", "-c", init, env=credential, detach=False, stdin=_small_run(),
        mounts={validator_state: "/state", run_volume: "/shared"},
    )  # fmt: skip

    validator = stack.run(
        "validator", VALIDATOR, "sparseloco-validator", "run", "--run", "/shared/run.toml",
        "--key", "/state/validator.pem", "--state", "/state/validator", "--grant-port", "8710",
        "--wait-for-peers", "2", "--windows", str(WINDOWS), "--threads", "1", "--status-json",
        alias="validator", env={**credential, **threads},
        mounts={validator_state: "/state", run_volume: "/shared"},
    )  # fmt: skip
    peers = [
        stack.run(
            f"peer-{i}",
            PEER,
            "sparseloco-peer",
            "join",
            "--run",
            "/shared/run.toml",
            "--state",
            "/state",
            "--windows",
            str(WINDOWS),
            "--threads",
            "1",
            "--status-json",
            env=threads,
            mounts={stack.volume(f"peer-{i}"): "/state", run_volume: "/shared:ro"},
        )  # fmt: skip
        for i in range(2)
    ]

    applied: dict[str, dict[int, str]] = {}
    for peer in peers:
        events = _events(_wait_exit(stack, peer, deadline))
        applied[peer] = {e.window: e.fingerprint for e in events if isinstance(e, Applied)}
    published = {
        e.window: e.fingerprint
        for e in _events(_wait_exit(stack, validator, deadline))
        if isinstance(e, WindowPublished)
    }
    first, second = applied.values()
    assert set(published) >= set(range(WINDOWS)), published
    assert len(first) >= WINDOWS and first == second, applied
    assert all(published[w] == fp for w, fp in first.items()), (published, applied)
    timings = {**images, "stack_s": round(time.monotonic() - start, 1), "windows": WINDOWS}
    print(json.dumps(timings))
