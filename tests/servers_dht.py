"""Real hivemind DHT nodes on 127.0.0.1 for tests: in this process or as separate OS processes.

    with start_dht_nodes(2, validator_keys=keys) as bootstrap:   # in-process nodes, their multiaddrs
        store = DHTStore(bootstrap, identity=me, validator_keys=keys)
    with start_dht_processes(1, bootstrap, key_path=pem, validator_keys=keys) as [proc]:
        proc.call("put run/x 6291456 7")               # -> "OK <sha256> <seconds>"

Every node of a run must be given the run's validator keys (they decide who may write chain keys);
a process writes with the Ed25519 key in ``key_path``.

Every node listens on a free port. Child processes run in their own process group with stdin as a
lifeline (EOF stops them) and are killed as a group if they do not stop, so neither they nor their
p2pd daemons outlive a test.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from protocol.store.dht.store import DHTStore


@contextmanager
def start_dht_nodes(n: int = 2, **store_options: Any) -> Iterator[list[str]]:
    """Start ``n`` connected DHT nodes in this process; yield the multiaddrs of all of them."""
    stores: list[DHTStore] = []
    try:
        for _ in range(n):
            peers = stores[0].visible_maddrs() if stores else None
            stores.append(DHTStore(peers, **store_options))
        yield [maddr for store in stores for maddr in store.visible_maddrs()]
    finally:
        for store in reversed(stores):
            store.close()


class DHTProcess:
    """One DHT node in a separate OS process, scripted through its stdin (see ``protocol.store.dht.serve``)."""

    def __init__(
        self,
        initial_peers: Iterable[str] = (),
        *,
        key_path: str | Path | None = None,
        validator_keys: Iterable[bytes] = (),
        expiration_s: float | None = None,
        timeout: float = 60.0,
    ) -> None:
        cmd = [sys.executable, "-m", "protocol.store.dht.serve", "--control"]
        cmd += [arg for peer in initial_peers for arg in ("--initial-peer", peer)]
        cmd += [arg for key in validator_keys for arg in ("--validator-key", key.hex())]
        if key_path is not None:
            cmd += ["--key", str(key_path)]
        if expiration_s is not None:
            cmd += ["--expiration-s", str(expiration_s)]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own group: p2pd included, so killpg reaches everything
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.maddrs: list[str] = []
        try:
            while (line := self._next_line(timeout)) != "READY":
                if not line.startswith("MADDR "):
                    raise RuntimeError(f"DHT process failed to start: {line}")
                self.maddrs.append(line.split(" ", 1)[1])
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next_line(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"DHT process silent for {timeout} s; log: {self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"DHT process exited ({self.proc.poll()}); log: {self.log_tail()}")
        return line

    def call(self, command: str, timeout: float = 60.0) -> str:
        """Send one command line, return its one-line answer (``OK ...`` / ``ERR ...``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._next_line(timeout)

    def log_tail(self, nbytes: int = 2000) -> str:
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - nbytes))
        return self._log.read().decode(errors="replace")

    def close(self, timeout: float = 15.0) -> None:
        """Graceful stop (stdin EOF), then SIGTERM, then SIGKILL to the whole process group."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # the group: p2pd goes with its parent
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(5.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


@contextmanager
def start_dht_processes(n: int = 1, initial_peers: Iterable[str] = (), **options: Any) -> Iterator[list[DHTProcess]]:
    """Start ``n`` DHT node processes (each joins ``initial_peers`` or the first one); stop them all after."""
    with ExitStack() as stack:
        procs: list[DHTProcess] = []
        peers = list(initial_peers)
        for _ in range(n):
            proc = DHTProcess(peers, **options)
            stack.callback(proc.close)
            procs.append(proc)
            peers = peers or proc.maddrs
        yield procs
