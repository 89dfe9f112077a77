"""A group of OS processes (validator, peers, servers) that starts, streams and stops as one.

Every child runs in its own process group (``start_new_session``), so stopping it also stops
anything it spawned (a hivemind daemon, a data loader worker). Lines each child writes are tagged
with its name, copied to ``<log_dir>/<name>.log`` and handed to the caller through one queue:

    with ProcessGroup(log_dir) as group:
        group.start("validator", ["sparseloco-validator", "run", ...])
        group.start("peer-0", ["sparseloco-peer", "join", ...])
        for name, line in group.lines(timeout=0.2):
            ...
    # leaving the block: SIGTERM to every group, SIGKILL to what is left after a grace period

:func:`install_signal_handlers` turns SIGTERM/SIGHUP into ``KeyboardInterrupt`` so that the
``with`` block unwinds (and cleans up) on Ctrl-C, ``kill`` and a closed terminal alike.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO


@dataclass
class Child:
    """One managed process."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    ended_at: float | None = None
    readers: list[threading.Thread] = field(default_factory=list)
    log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None


class ProcessGroup:
    """Start, watch and stop named child processes; see the module docstring."""

    def __init__(self, log_dir: str | Path, *, grace_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.children: dict[str, Child] = {}
        self._lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self._all_pids: dict[str, int] = {}

    # ------------------------------------------------------------------ start
    def start(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None
    ) -> Child:
        """Start ``argv`` as ``name`` in a new process group; stdout and stderr are streamed."""
        if name in self.children and self.children[name].alive():
            raise RuntimeError(f"process {name!r} is already running")
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        log_path = self.log_dir / f"{name}.log"
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd,
            start_new_session=True,  # own process group: signals reach its children too
        )
        log = open(log_path, "ab", buffering=0)
        child = Child(name, list(argv), popen, log_path, time.time(), log=log)
        lock = threading.Lock()
        for stream in (popen.stdout, popen.stderr):
            assert stream is not None
            t = threading.Thread(target=self._pump, args=(name, stream, log, lock), daemon=True)
            t.start()
            child.readers.append(t)
        self.children[name] = child
        self._write_pids()
        return child

    def _write_pids(self) -> None:
        """``pids.json`` in the log dir: every process ever started here (operators, orphan checks)."""
        pids = {f"{c.name}": c.pid for c in self.children.values()}
        self._all_pids.update({f"{n}@{p}": p for n, p in pids.items()})
        (self.log_dir / "pids.json").write_text(json.dumps(self._all_pids, indent=1))

    def _pump(self, name: str, stream: IO[bytes], log: IO[bytes], lock: threading.Lock) -> None:
        try:
            for raw in iter(stream.readline, b""):
                with lock:
                    log.write(raw)
                self._lines.put((name, raw.decode("utf-8", "replace").rstrip("\n")))
        finally:
            stream.close()

    # ------------------------------------------------------------------ watch
    def lines(self, timeout: float = 0.2) -> Iterator[tuple[str, str]]:
        """Lines available now (waits up to ``timeout`` for the first one)."""
        try:
            yield self._lines.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            try:
                yield self._lines.get_nowait()
            except queue.Empty:
                return

    def running(self, names: Sequence[str] | None = None) -> list[str]:
        """Names (of ``names``, default all) still running; notes the exit time of the others."""
        names = list(self.children) if names is None else list(names)
        out = []
        for n in names:
            child = self.children.get(n)
            if child is None:
                continue
            if child.alive():
                out.append(n)
            elif child.ended_at is None:
                child.ended_at = time.time()
        return out

    def wait(self, name: str, timeout: float | None = None) -> int:
        """Wait for ``name`` to exit; returns its exit status (TimeoutExpired on timeout)."""
        child = self.children[name]
        rc = child.popen.wait(timeout=timeout)
        self._reap(child)
        return rc

    # ------------------------------------------------------------------ stop
    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the whole process group of ``name`` (no-op when it has exited)."""
        child = self.children[name]
        if child.alive():
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, name: str, *, grace_s: float | None = None) -> int:
        """SIGTERM the group of ``name``, SIGKILL it after ``grace_s``; returns the exit status."""
        grace = self.grace_s if grace_s is None else grace_s
        self.signal(name, signal.SIGTERM)
        try:
            return self.wait(name, timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill(name)
            return self.wait(name)

    def kill(self, name: str) -> None:
        """SIGKILL the whole group of ``name`` at once (fault injection: no cleanup runs)."""
        self.signal(name, signal.SIGKILL)
        child = self.children[name]
        child.popen.wait()
        self._reap(child)

    def close(self) -> None:
        """Stop every child: SIGTERM to all groups together, then SIGKILL after the grace period."""
        alive = [c for c in self.children.values() if c.alive()]
        for child in alive:
            self.signal(child.name, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in alive:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal(child.name, signal.SIGKILL)
                child.popen.wait()
        for child in self.children.values():
            # Also SIGKILL anything the child left behind in its group (daemons that ignore TERM).
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._reap(child)

    def _reap(self, child: Child) -> None:
        if child.ended_at is None:
            child.ended_at = time.time()
        for t in child.readers:
            t.join(timeout=2.0)
        if child.log is not None and not any(t.is_alive() for t in child.readers):
            child.log.close()
            child.log = None

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install_signal_handlers() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread. SIGINT too: a
    process started in the background by a shell inherits SIGINT ignored, and Ctrl-C (or a
    supervisor's SIGINT) must still stop the demo and everything it started."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, handler)


def python_console(script: str) -> list[str]:
    """argv that runs a console script of this environment, even when its bin/ is not on PATH."""
    bin_dir = Path(sys.executable).parent
    exe = bin_dir / script
    if exe.exists():
        return [str(exe)]
    module = {"sparseloco-peer": "client.cli", "sparseloco-validator": "validator.cli"}[script]
    return [sys.executable, "-m", module]
