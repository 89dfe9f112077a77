#!/usr/bin/env python
"""A contribution's upload over a slow link that drops: the deadline-bound put against the old fixed retries.

    python scripts/bench_uplink.py                  # table
    python scripts/bench_uplink.py --json           # one JSON object
    python scripts/bench_uplink.py --drop-s 10 --mbit 8

A granted store (:class:`~protocol.store.granted.GrantedStore`, the volunteer's store; its grant
server replaced by grants for a local server) PUTs to an HTTP server on loopback that reads bodies
at ``--mbit`` Mbit/s and honours ``If-None-Match: *``, as S3 does. Scenarios:

* ``steady``: the link works;
* ``drop_refused``: for ``--drop-s`` s every connection is cut at once (an interface down: each
  attempt fails fast), then the link is back;
* ``drop_stalled``: for ``--drop-s`` s connections are accepted and never read (packets vanish:
  each attempt waits for its timeout), then back;
* ``lost_answer``: the first PUT is stored but its connection is cut before the answer;
* ``too_slow``: the uplink measured by the steady put, a contribution of ``--big-mb`` MB and
  ``--window-s`` s left;
* ``dead_until_deadline``: stalled for longer than the window (``--window-s``).

``new``: :func:`client.uplink.put_by_deadline` with the window's deadline ``--window-s`` s away;
``old``: the peer's former put (``put_with_retry``: 3 tries, 0.2·2^n s apart), given up on after
``--old-cap-s`` s. Columns: outcome, attempts (the peer's), seconds, seconds past the deadline,
objects stored under the key, the peer's reason.
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.peer.uploads import put_with_retry  # noqa: E402
from client.uplink import LinkRate, put_by_deadline  # noqa: E402
from protocol.errors import StoreError  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.store.granted import GrantedStore  # noqa: E402
from protocol.store.grants import GrantRequest  # noqa: E402
from protocol.store.presign import Presigned  # noqa: E402

KEY = "run/contrib/00000007/peer"
CHUNK = 16 << 10


@dataclass
class Link:
    """The server's view of the link."""

    bytes_per_s: float
    down_until: float = 0.0  # monotonic
    stall: bool = False  # while down: hold connections unread (else cut them at once)
    lose_answers: int = 0
    objects: dict[str, bytes] = field(default_factory=dict)
    puts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def serve(link: Link) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _down(self) -> bool:
            wait = link.down_until - time.monotonic()
            if wait <= 0:
                return False
            if link.stall:
                time.sleep(wait)  # nothing read, nothing answered: the client's timeout fires
            self.close_connection = True
            return True

        def do_PUT(self) -> None:
            with link.lock:
                link.puts += 1
            if self._down():
                return
            size = int(self.headers["Content-Length"])
            body = bytearray()
            while len(body) < size:
                chunk = self.rfile.read(min(CHUNK, size - len(body)))
                if not chunk:
                    return
                body += chunk
                time.sleep(len(chunk) / link.bytes_per_s)
            key = self.path.lstrip("/")
            with link.lock:
                if self.headers.get("If-None-Match") == "*" and key in link.objects:
                    self._answer(412)
                    return
                link.objects[key] = bytes(body)
                if link.lose_answers:
                    link.lose_answers -= 1
                    self.close_connection = True  # stored; the answer never leaves
                    return
            self._answer(200)

        def do_GET(self) -> None:
            if self._down():
                return
            data = link.objects.get(self.path.lstrip("/"))
            if data is None:
                self._answer(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_HEAD(self) -> None:
            data = link.objects.get(self.path.lstrip("/"))
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class LocalGrants(GrantedStore):
    """A granted store whose grants name the local server (the grant server is not measured)."""

    def __init__(self, base: str, **options: Any) -> None:
        super().__init__(
            "http://127.0.0.1:9", Identity.from_seed(b"bench-uplink peer key 32 bytes.."), "0" * 64, **options
        )
        self.base = base

    def _ask_once(self, request: GrantRequest) -> Presigned:
        method = {"put": "PUT", "get": "GET", "head": "HEAD"}[request.op]
        headers = {"Content-Length": str(request.size)} if method == "PUT" else {}
        if request.if_absent:
            headers["If-None-Match"] = "*"
        return Presigned(method, f"{self.base}/{request.key}", time.time() + 600, headers)


def run(scenario: str, way: str, args: argparse.Namespace, rate: LinkRate) -> dict[str, Any]:
    link = Link(args.mbit * 1e6 / 8)
    server = serve(link)
    store = LocalGrants(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=args.timeout_s)
    blob = bytes(int(args.mb * 1e6))
    window = args.window_s
    if scenario in ("drop_refused", "drop_stalled"):
        link.down_until, link.stall = time.monotonic() + args.drop_s, scenario == "drop_stalled"
    elif scenario == "dead_until_deadline":
        link.down_until, link.stall = time.monotonic() + 10 * window, True
    elif scenario == "lost_answer":
        link.lose_answers = 1
    elif scenario == "too_slow":
        blob = bytes(int(args.big_mb * 1e6))
    t0 = time.time()
    deadline = t0 + window
    row: dict[str, Any] = {"scenario": scenario, "way": way, "bytes": len(blob)}
    if way == "new":
        sent = put_by_deadline(store, KEY, blob, deadline_at=lambda: deadline, rate=rate)
        row.update(outcome=sent.outcome, attempts=sent.attempts, down_s=round(sent.down_s, 1), reason=sent.reason)
    else:
        done: dict[str, Any] = {}

        def old() -> None:
            try:
                created = put_with_retry(store, KEY, blob, once=True)
                done.update(outcome="uploaded", reason=None if created else "already present")
            except StoreError as exc:
                done.update(outcome="failed", reason=f"{exc.reason}: {exc}")

        worker = threading.Thread(target=old, daemon=True)
        worker.start()
        worker.join(timeout=args.old_cap_s)
        if not done:
            done.update(outcome="still trying", reason=f"given up on after {args.old_cap_s:.0f} s")
        row.update(done, attempts=None, down_s=None)
    end = time.time()
    row.update(
        seconds=round(end - t0, 1),
        past_deadline_s=round(max(0.0, end - deadline), 1),
        objects=int(KEY in link.objects),
        http_puts=link.puts,
    )
    server.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mbit", type=float, default=2.0, help="the uplink, Mbit/s")
    parser.add_argument("--mb", type=float, default=1.0, help="the object put, MB")
    parser.add_argument("--big-mb", type=float, default=23.4, help="the contribution of too_slow, MB")
    parser.add_argument("--drop-s", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=60.0, help="time to the upload deadline")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the granted store's network timeout")
    parser.add_argument("--old-cap-s", type=float, default=150.0)
    parser.add_argument(
        "--scenarios", default="steady,drop_refused,drop_stalled,lost_answer,too_slow,dead_until_deadline"
    )
    args = parser.parse_args()
    rows = []
    rate = LinkRate()  # measured by the new way's steady put, used by its too_slow
    for scenario in args.scenarios.split(","):
        for way in ("new", "old"):
            if scenario == "too_slow" and way == "old":
                continue  # the old put has no notion of a rate: it would send the 94 s and be late
            rows.append(run(scenario, way, args, rate))
            if not args.json:
                print(json.dumps(rows[-1]), file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}))
        return
    table = Table(title=f"put of {args.mb} MB at {args.mbit} Mbit/s, deadline {args.window_s:.0f} s away")
    for column in (
        "scenario",
        "way",
        "outcome",
        "attempts",
        "seconds",
        "past deadline s",
        "down s",
        "objects",
        "reason",
    ):
        table.add_column(column)
    show: Callable[[Any], str] = lambda v: "" if v is None else str(v)  # noqa: E731
    for r in rows:
        reason = show(r["reason"])
        table.add_row(
            r["scenario"],
            r["way"],
            r["outcome"],
            show(r["attempts"]),
            show(r["seconds"]),
            show(r["past_deadline_s"]),
            show(r["down_s"]),
            show(r["objects"]),
            reason if len(reason) < 90 else reason[:87] + "...",
        )
    Console(width=200).print(table)
    print(json.dumps({"settings": settings, "rows": rows}))


if __name__ == "__main__":
    main()
