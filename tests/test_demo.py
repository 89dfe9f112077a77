"""``sparseloco demo`` as a user runs it: a subprocess, its JSON last line, and Ctrl-C with no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from client.demo.processes import ProcessGroup
from client.demo.swarm import PRESET
from protocol.config import RunSpec
from protocol.events import WindowPublished, read_events
from protocol.settings import local_table, local_table_toml

REQUIRED = {
    "windows_completed",
    "val_loss_per_window",
    "accepted_per_window",
    "rejected_per_window",
    "fingerprints_equal",
    "upload_bytes_per_peer_per_window",
    "data_bytes_per_peer_per_window",
    "download_bytes_per_peer_per_window",
    "wire_up_bytes_per_peer_per_window",
    "wire_down_bytes_per_peer_per_window",
    "data_cache_hit_rate",
    "compute_fraction",
    "seconds",
}


def small_preset(tmp_path: Path) -> Path:
    spec = RunSpec.load(PRESET).replace(
        model={"dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
        data={"seq_len": 64, "batch_size": 4},
        inner={"steps": 8, "warmup_steps": 4, "total_steps": 100},
        validator={"eval_sequences": 8},
    )
    path = tmp_path / "small.toml"
    path.write_text(spec.to_toml() + local_table_toml(local_table(PRESET)))  # the preset's [local] too
    return path


def demo_argv(tmp_path: Path, *extra: str) -> list[str]:
    exe = Path(sys.executable).parent / "sparseloco"
    return [str(exe), "demo", "--preset", str(small_preset(tmp_path)), "--dir", str(tmp_path / "run"), *extra]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; its parent (the demo) has exited, so init reaps it soon.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def still_alive(pids: Iterable[int], timeout_s: float = 10.0) -> list[int]:
    """The processes of ``pids`` alive after waiting up to ``timeout_s`` for them to end: a
    SIGKILLed process dies asynchronously, later still on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)  # no event announces the death of a process that is not our child


@pytest.mark.integration
def test_demo_json_last_line(tmp_path: Path) -> None:
    out = subprocess.run(
        demo_argv(tmp_path, "--peers", "2", "--windows", "2", "--json"), capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert REQUIRED <= set(summary)
    assert summary["windows_completed"] == 2 and summary["fingerprints_equal"] is True
    assert summary["accepted_per_window"] == [2, 2] and summary["rejected_per_window"] == [0, 0]
    # Both windows are in the Top-k warm-up: 512 and 400 of every 4096 values kept (≈ 11 %).
    assert 0 < summary["upload_bytes_per_peer_per_window"] < summary["dense_fp32_bytes"] / 30
    assert 0.0 < summary["compute_fraction"] <= summary["compute_fraction_running"] < 1.0
    assert summary["data_bytes_per_peer_per_window"] > 0 and 0.0 <= summary["data_cache_hit_rate"] <= 1.0
    assert summary["download_bytes_per_peer_per_window"] >= summary["data_bytes_per_peer_per_window"]
    assert Path(summary["contribution_log"]).is_file()
    pids = json.loads((tmp_path / "run" / "logs" / "pids.json").read_text())
    assert len(pids) == 4 and not still_alive(pids.values())  # init, the validator, 2 peers


def published(validator_log: Path) -> bool:
    """The validator has published a window (its ``--status-json`` events, as the demo logs them)."""
    if not validator_log.exists():
        return False
    with validator_log.open(errors="replace") as lines:
        return any(isinstance(e, WindowPublished) for e in read_events(lines))


def wait_published(proc: subprocess.Popen[bytes], validator_log: Path, timeout_s: float) -> None:
    """Until the validator has published a window; fails if the demo exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not published(validator_log):
        assert time.monotonic() < deadline, f"no window published in {timeout_s:.0f} s"
        try:
            rc = proc.wait(timeout=0.5)  # doubles as the pause between looks at the log
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"the demo exited with status {rc} before a window was published")


@pytest.mark.integration
def test_demo_interrupt_leaves_no_orphans(tmp_path: Path) -> None:
    """Ctrl-C once the first window is published: the demo exits 130 and leaves no process behind.
    The demo is asked for far more windows than it could run before the interrupt, whatever the
    machine's speed."""
    with (tmp_path / "demo.err").open("w") as err:
        proc = subprocess.Popen(
            demo_argv(tmp_path, "--peers", "2", "--windows", "100000"), stdout=subprocess.DEVNULL, stderr=err
        )
    pids_file = tmp_path / "run" / "logs" / "pids.json"
    try:
        wait_published(proc, tmp_path / "run" / "logs" / "validator.log", timeout_s=300)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)  # on a loaded machine the children take a while to stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, (tmp_path / "demo.err").read_text()[-2000:]
    pids = json.loads(pids_file.read_text())
    assert len(pids) == 4  # init, the validator, 2 peers
    left = still_alive(pids.values())
    assert not [n for n, p in pids.items() if p in left]


def test_process_group_stops_children_and_grandchildren(tmp_path: Path) -> None:
    """A child that spawned its own child: closing the group leaves neither behind."""
    script = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    with ProcessGroup(tmp_path / "logs", grace_s=2.0) as group:
        child = group.start("sleeper", [sys.executable, "-c", script])
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while time.monotonic() < deadline and "up" not in lines:
            lines += [line for _, line in group.lines(timeout=0.2)]
        assert "up" in lines
        grandchildren = [int(p) for p in Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()]
        assert grandchildren
    assert not still_alive([child.pid, *grandchildren])
    assert (tmp_path / "logs" / "sleeper.log").read_text().strip() == "up"
