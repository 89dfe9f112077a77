#!/usr/bin/env python
"""The grant desk under floods: an announced peer's grants while attackers flood the server.

    python scripts/bench_grants.py                  # table: the previous server and this one
    python scripts/bench_grants.py --json           # one JSON object
    python scripts/bench_grants.py --baseline HEAD~3 --seconds 6 --scenarios none,fresh_keys

Each (server, scenario) runs in a fresh server process on loopback (so that its peak RSS, VmHWM,
is its own; it includes the libraries the validator's modules import); the clients run in this process, bound to addresses of 127.0.0.0/8:

* ``none``: the peer alone;
* ``fresh_keys``: ``--attackers`` threads ask for read grants, each request from a key never seen
  before, all from one /24 (127.0.1.x);
* ``many_networks``: the same from a different /24 for every request (127.0.2-251.x);
* ``json_bomb``: 4 KiB bodies of ``[`` from 127.0.1.x;
* ``slowloris``: ``--slowloris`` connections from three /24s, each sending its request a byte at a
  time (one byte every 0.5 s); ``outlived`` counts those still open ``timeout + 1`` s after they
connected, of those that connected (within ``timeout``).

The peer (127.0.0.1, announced to the desk's roster) asks for read grants, ``--peer-rate`` a
second: latency p50/p99 and the share answered 200. ``served/s``: answers of any kind the server sent
per second; ``attack granted``: grants the attackers got; ``stderr bytes``: what the server
process wrote to stderr (tracebacks, log lines: none should reach it). The baseline is the server and desk of
``--baseline`` (a git revision; default ``1251d00``, the last with the standard-library
``http.server`` endpoint), loaded from git, with its default policy.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import http.client
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import layout  # noqa: E402
from protocol.config import RunSpec  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.store.grants import GRANT_PATH, SIGNATURE_HEADER, GrantRequest, encode_request  # noqa: E402

VALIDATOR = Identity.from_seed(b"bench-grants validator key 32 b.")
PEER = Identity.from_seed(b"bench-grants honest peer key 32.")
SPEC = RunSpec().replace(
    windows={"upload_deadline_s": 600.0},
    validator={"public_keys": [VALIDATOR.public_key_hex], "max_contribution_bytes": 10_000},
)
RUN_HASH = SPEC.hash()
RUN = layout.run_id(RUN_HASH)
SCENARIOS = ("none", "fresh_keys", "many_networks", "json_bomb", "slowloris")
TIMEOUT_S = 10.0  # both servers' request timeout
STDLIB_SERVER = "1251d00"  # the last revision whose grant endpoint ran on the standard library's http.server


# ---------------------------------------------------------------------- the server process
def _old_modules(rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """validator/grants.py and validator/grant_server.py of ``rev``, loaded from git."""
    loaded = []
    for name in ("grants", "grant_server"):
        source = subprocess.run(
            ["git", "show", f"{rev}:validator/{name}.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        module = types.ModuleType(f"_baseline_{name}")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{rev}:validator/{name}.py", "exec"), module.__dict__)
        loaded.append(module)
    return loaded[0], loaded[1]


def _serve(kind: str, rev: str, pipe: Any) -> None:
    from protocol.store.s3 import S3Store

    stderr = tempfile.TemporaryFile()  # what the server writes to stderr, counted
    os.dup2(stderr.fileno(), 2)

    events: Counter[str] = Counter()

    def emit(event: Any) -> None:
        events[f"{event.kind}:{getattr(event, 'reason', '')}".rstrip(":")] += 1

    store = S3Store(
        "bench", "runs", endpoint_url="http://127.0.0.1:9", region="us-east-1", access_key="k", secret_key="s"
    )
    if kind == "new":
        from validator.grant_server import GrantServer
        from validator.grants import FixedRoster, GrantDesk, OpenWindow

        desk: Any = GrantDesk(
            SPEC, store, lambda: OpenWindow(3, time.time()), emit=emit, roster=FixedRoster(PEER.peer_id)
        )
        server: Any = GrantServer(desk, "127.0.0.1", 0, timeout_s=TIMEOUT_S).start()
    else:
        grants, grant_server = _old_modules(rev)
        desk = grants.GrantDesk(SPEC, store, lambda: grants.OpenWindow(3, time.time()), emit=emit)
        server = grant_server.GrantServer(desk, "127.0.0.1", 0, timeout_s=TIMEOUT_S).start()
    pipe.send(int(server.url.rsplit(":", 1)[1]))
    pipe.recv()  # done
    tables = desk.tables() if hasattr(desk, "tables") else {}
    server.close()
    sys.stderr.flush()
    written = os.fstat(stderr.fileno()).st_size
    pipe.send({"events": dict(events), "peak_rss_mib": _vm_hwm_mib(), "tables": tables, "stderr_bytes": written})


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


# ---------------------------------------------------------------------- clients
def _post(port: int, body: bytes, headers: dict[str, str], source: str) -> int:
    """The answer's status, 0 when there was none (refused, reset, timed out)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S, source_address=(source, 0))
    try:
        conn.request("POST", GRANT_PATH, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def _read_request(who: Identity) -> tuple[bytes, dict[str, str]]:
    return encode_request(GrantRequest.read(RUN_HASH, "get", layout.aggregate_key(RUN, 2)), who)


class _Keys:
    """Keys never used before (one attacking thread's)."""

    def __init__(self, worker: int) -> None:
        self.worker, self._n = worker, 0

    def fresh(self) -> Identity:
        self._n += 1
        return Identity.from_seed(hashlib.sha256(f"bench-grants fresh key {self.worker}/{self._n}".encode()).digest())


def _attack(kind: str, port: int, stop: threading.Event, worker: int, statuses: Counter[int]) -> None:
    keys = _Keys(worker)
    i = 0
    while not stop.is_set():
        i += 1
        if kind == "fresh_keys":
            status = _post(port, *_read_request(keys.fresh()), source=f"127.0.1.{1 + worker}")
        elif kind == "many_networks":
            status = _post(
                port, *_read_request(keys.fresh()), source=f"127.0.{2 + (i * 7 + worker) % 250}.{1 + worker}"
            )
        else:  # json_bomb
            status = _post(port, b"[" * 4096, {SIGNATURE_HEADER: "00" * 64}, source=f"127.0.1.{1 + worker}")
        statuses[status] += 1


def _slowloris(port: int, n: int, stop: threading.Event, outlived: list[tuple[int, int]]) -> None:
    """``n`` connections (opened at once: a server's accept queue may be short) that send their
    request a byte every 0.5 s; ``outlived``: (still open, connected) ``timeout + 1`` s later."""
    request = b"POST /v1/grant HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n" + b"{" * 300

    def connect(i: int) -> socket.socket | None:
        sock = socket.socket()
        sock.bind((f"127.0.{3 + i % 3}.{1 + i // 3}", 0))
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(("127.0.0.1", port))
            return sock
        except OSError:
            sock.close()
            return None

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        socks = [sock for sock in pool.map(connect, range(n)) if sock is not None]
    started, pos = time.monotonic(), 0
    while not stop.is_set() and pos < len(request):
        for sock in socks:
            try:
                sock.send(request[pos : pos + 1])
            except OSError:
                pass
        pos += 1
        if not outlived and time.monotonic() - started > TIMEOUT_S + 1:
            outlived.append((sum(_open(sock) for sock in socks), len(socks)))
        stop.wait(0.5)
    for sock in socks:
        sock.close()


def _open(sock: socket.socket) -> bool:
    """The server has not closed ``sock``."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def run_one(server: str, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(server, args.baseline, child), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError(f"the {server} server did not start")
    port = parent.recv()
    stop = threading.Event()
    attack: Counter[int] = Counter()
    outlived: list[tuple[int, int]] = []
    threads: list[threading.Thread] = []
    if scenario in ("fresh_keys", "many_networks", "json_bomb"):
        threads = [
            threading.Thread(target=_attack, args=(scenario, port, stop, w, attack)) for w in range(args.attackers)
        ]
    elif scenario == "slowloris":
        threads = [threading.Thread(target=_slowloris, args=(port, args.slowloris, stop, outlived))]
    for t in threads:
        t.start()
    latencies, ok = [], 0
    started = time.monotonic()
    pace = threading.Event()  # never set: paces the peer at --peer-rate requests a second

    def going() -> bool:
        if scenario == "slowloris":  # until the trickling connections are counted
            return not outlived and time.monotonic() - started < 120
        return time.monotonic() - started < args.seconds

    while going():
        t0 = time.monotonic()
        status = _post(port, *_read_request(PEER), source="127.0.0.1")
        latencies.append(time.monotonic() - t0)
        ok += status == 200
        pace.wait(max(0.0, t0 + 1 / args.peer_rate - time.monotonic()))
    elapsed = time.monotonic() - started
    stop.set()
    for t in threads:
        t.join()
    parent.send("done")
    report = parent.recv()
    proc.join(timeout=30)
    latencies.sort()
    answered = sum(n for s, n in attack.items() if s) + len(latencies)
    return {
        "server": server,
        "scenario": scenario,
        "legit_requests": len(latencies),
        "legit_success": round(ok / max(1, len(latencies)), 4),
        "legit_p50_ms": round(1000 * latencies[len(latencies) // 2], 2) if latencies else None,
        "legit_p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2)
        if latencies
        else None,
        "attack_requests": sum(attack.values()),
        "attack_granted": attack.get(200, 0),
        "attack_unanswered": attack.get(0, 0),
        "served_per_s": round(answered / elapsed, 1),
        "slowloris_outlived": outlived[0][0] if outlived else None,
        "slowloris_connected": outlived[0][1] if outlived else None,
        **report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--baseline",
        default=STDLIB_SERVER,
        help=f"git revision of the previous server (default {STDLIB_SERVER}, the standard-library one)",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each flood")
    parser.add_argument("--peer-rate", type=float, default=10.0, help="the peer's requests a second")
    parser.add_argument("--attackers", type=int, default=6, help="attacking threads of a request flood")
    parser.add_argument("--slowloris", type=int, default=150, help="trickling connections")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--servers", default="old,new")
    args = parser.parse_args()
    results = [
        run_one(server, scenario, args) for scenario in args.scenarios.split(",") for server in args.servers.split(",")
    ]
    out = {"baseline": args.baseline, "seconds": args.seconds, "attackers": args.attackers, "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    table = Table(title=f"The grant desk under floods (old = {args.baseline}, new = this tree)")
    for col in ("scenario", "server", "peer p50 ms", "peer p99 ms", "peer ok", "served/s", "attack sent",
                "attack granted", "slowloris outlived", "stderr bytes", "peak RSS MiB"):  # fmt: skip
        table.add_column(col, justify="right" if col not in ("scenario", "server") else "left")
    for r in results:
        table.add_row(
            r["scenario"],
            r["server"],
            str(r["legit_p50_ms"]),
            str(r["legit_p99_ms"]),
            f"{100 * r['legit_success']:.1f}%",
            str(r["served_per_s"]),
            str(r["attack_requests"]),
            str(r["attack_granted"]),
            "" if r["slowloris_outlived"] is None else f"{r['slowloris_outlived']}/{r['slowloris_connected']}",
            str(r["stderr_bytes"]),
            str(r["peak_rss_mib"]),
        )
    Console(width=160).print(table)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
