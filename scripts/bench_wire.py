#!/usr/bin/env python
"""Counted socket bytes against a network interface's counters, over a real veth link.

    sudo python scripts/bench_wire.py                  # table: 1, 10, 100 MiB up and down
    sudo python scripts/bench_wire.py --json           # one JSON object
    sudo python scripts/bench_wire.py --sizes-mib 1,4 --offload off

Two network namespaces joined by a veth pair (needs root and ``ip``): an HTTP server
(:mod:`http.server`) in one, a client in the other that moves each size up (a PUT) and down (a GET)
through :func:`protocol.store.traffic.counting_opener`, one fresh connection each. Around every
transfer the client reads its veth's ``/sys/class/net/<dev>/statistics`` (tx/rx bytes and
packets), as a test bed that gives each peer its own namespace does. Per transfer and direction
(``tx``: what the client sent, ``rx``: what it received):

* ``wire``: the counter (:class:`~protocol.store.traffic.WireCounter`);
* ``iface``: the interface's bytes, ``packets`` its packets;
* ``payload``: :func:`~protocol.store.traffic.framing_estimate` of them (bytes − 66 per packet);
* ``payload_diff`` = (payload − wire) / wire and ``raw_diff`` = (iface − wire) / wire;
* ``retransmitted``: TCP segments sent again in that direction (``RetransSegs`` of the sending
  namespace): bytes on the link the application sent once, which no socket counter sees.

The direction that carries the body is the one a 5 % agreement is asked of; the other carries
the request or response headers and the ACKs of the body, so its raw bytes are mostly framing.
The namespaces are deleted whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol.store.traffic import FRAME_BYTES, framing_estimate  # noqa: E402

SERVER_IP, CLIENT_IP = "10.231.7.1", "10.231.7.2"
PORT = 18080
MiB = 1 << 20

# The server: GET /<n> answers n bytes, PUT reads the body it is sent; one connection a request.
_SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCK = bytes(1 << 20)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        n = int(self.path.strip("/"))
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        while n:
            k = min(n, len(BLOCK))
            self.wfile.write(BLOCK[:k])
            n -= k

    def do_PUT(self):
        n = int(self.headers["Content-Length"])
        while n:
            n -= len(self.rfile.read(min(n, 1 << 20)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

server = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler)
print("ready", flush=True)
server.serve_forever()
"""

# The client: each transfer through a counting opener, the veth's counters read around it.
_CLIENT = r"""
import json, sys, urllib.request
from protocol.store.traffic import WireCounter, counting_opener

dev, url, sizes, server_pid = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")], sys.argv[4]

def retransmitted(snmp):
    # Tcp: RetransSegs of one namespace (/proc/<pid>/net is the namespace of that process)
    head, values = [line.split() for line in open(snmp) if line.startswith("Tcp:")][:2]
    return int(values[head.index("RetransSegs")])

def stats():
    base = f"/sys/class/net/{dev}/statistics/"
    out = {k: int(open(base + k).read()) for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")}
    out["tx_retrans"] = retransmitted("/proc/self/net/snmp")
    out["rx_retrans"] = retransmitted(f"/proc/{server_pid}/net/snmp")
    return out

rows = []
for size in sizes:
    for direction in ("up", "down"):
        wire = WireCounter()
        opener = counting_opener(wire)
        before = stats()
        if direction == "up":
            request = urllib.request.Request(url + "/put", data=bytes(size), method="PUT")
            request.add_header("Content-Type", "application/octet-stream")
            with opener.open(request, timeout=60) as resp:
                resp.read()
        else:
            with opener.open(f"{url}/{size}", timeout=60) as resp:
                while resp.read(1 << 20):
                    pass
        after = stats()
        rows.append({"size": size, "direction": direction, "wire_sent": wire.sent, "wire_received": wire.received,
                     **{k: after[k] - before[k] for k in before}})
print(json.dumps(rows))
"""


def netns_available() -> str | None:
    """Why the measurement cannot run here (None when it can): root, ``ip``, network namespaces."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and a veth pair)"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    probe = f"wbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def linked_namespaces(*, offload: bool = True) -> Iterator[tuple[str, str, str]]:
    """(server namespace, client namespace, the client's veth): two namespaces joined by a veth
    pair, IPv6 off (no router solicitations on the counters); deleted on the way out. Without
    ``offload`` every packet is one MTU-sized segment (``gso_max_segs 1``), as on a link whose
    counters see wire packets; with it a counted packet may be a 64 KiB super-segment."""
    tag = f"wb{os.getpid()}"
    server_ns, client_ns = f"{tag}s", f"{tag}c"
    server_dev, client_dev = f"{tag}s", f"{tag}c"
    made: list[str] = []
    try:
        for ns in (server_ns, client_ns):
            _ip("netns", "add", ns)
            made.append(ns)
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], capture_output=True
            )
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"],
                capture_output=True,
            )
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip(
            "link",
            "add",
            client_dev,
            "netns",
            client_ns,
            "type",
            "veth",
            "peer",
            "name",
            server_dev,
            "netns",
            server_ns,
        )
        for ns, dev, addr in ((server_ns, server_dev, SERVER_IP), (client_ns, client_dev, CLIENT_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            if not offload:
                _ip("-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1")
            _ip("-n", ns, "link", "set", dev, "up")
        yield server_ns, client_ns, client_dev
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def measure(sizes: Sequence[int], *, offload: bool = True) -> list[dict[str, Any]]:
    """The raw rows of the client (see ``_CLIENT``), one per size and direction."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with linked_namespaces(offload=offload) as (server_ns, client_ns, client_dev):
        server = subprocess.Popen(
            ["ip", "netns", "exec", server_ns, sys.executable, "-c", _SERVER, SERVER_IP, str(PORT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the server did not start: {server.stderr.read() if server.stderr else ''}")
            done = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    client_ns,
                    sys.executable,
                    "-c",
                    _CLIENT,
                    client_dev,
                    f"http://{SERVER_IP}:{PORT}",
                    ",".join(str(s) for s in sizes),
                    str(server.pid),  # `ip netns exec` execs the server: the same process
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the client failed: {done.stderr}")
            rows: list[dict[str, Any]] = json.loads(done.stdout)
            return rows
        finally:
            server.terminate()
            server.wait(timeout=30)


def compare(row: dict[str, Any]) -> dict[str, Any]:
    """One row's comparisons, for the direction that carried the body (``bulk``) and the other."""
    out: dict[str, Any] = {"size": row["size"], "direction": row["direction"]}
    for side, wire_key in (("tx", "wire_sent"), ("rx", "wire_received")):
        wire, iface, packets = row[wire_key], row[f"{side}_bytes"], row[f"{side}_packets"]
        payload = framing_estimate(iface, packets)
        out[side] = {
            "wire": wire,
            "iface": iface,
            "packets": packets,
            "payload": payload,
            "payload_diff": round((payload - wire) / wire, 6) if wire else None,
            "raw_diff": round((iface - wire) / wire, 6) if wire else None,
            "retransmitted": row[f"{side}_retrans"],  # segments sent again on this side
        }
    out["bulk"] = "tx" if row["direction"] == "up" else "rx"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="1,10,100", help="comma-separated sizes in MiB")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument(
        "--offload",
        default="on,off",
        help="segmentation offload on the veth: on (super-segments), off (MTU-sized packets), or both",
    )
    args = parser.parse_args(argv)
    why = netns_available()
    if why is not None:
        print(f"bench_wire: {why}", file=sys.stderr)
        return 2
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",")]
    rows = [
        {"offload": mode, **compare(r)}
        for mode in args.offload.split(",")
        for r in measure(sizes, offload=mode == "on")
    ]
    print(json.dumps({"frame_bytes": FRAME_BYTES, "rows": rows}))
    if args.json:
        return 0
    print(
        f"{'offload':>7} {'size':>9} {'dir':>4} {'side':>4} {'wire B':>12} {'iface B':>12} {'packets':>8} "
        f"{'payload B':>12} {'payload Δ':>10} {'raw Δ':>10} {'retx':>5}"
    )
    for r in rows:
        for side in ("tx", "rx"):
            s = r[side]
            mark = "*" if side == r["bulk"] else " "
            pd = "-" if s["payload_diff"] is None else f"{100 * s['payload_diff']:+.3f}%"
            rd = "-" if s["raw_diff"] is None else f"{100 * s['raw_diff']:+.2f}%"
            print(
                f"{r['offload']:>7} {r['size'] / MiB:>7.0f}Mi {r['direction']:>4} {side + mark:>4} {s['wire']:>12,} "
                f"{s['iface']:>12,} {s['packets']:>8,} {s['payload']:>12,} {pd:>10} {rd:>10} {s['retransmitted']:>5}"
            )
    print("* the side that carried the body; Δ = (interface − wire) / wire")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
