"""Put/get throughput of the DHT object store between two OS processes on 127.0.0.1.

    python scripts/bench_dht.py            # rich table
    python scripts/bench_dht.py --json     # one JSON object
    python scripts/bench_dht.py --flood 10000 [--json]   # listings under a flood (below)

Setup: a DHT server node runs in a child process (``python -m protocol.store.dht.serve``); this
process holds two *client-mode* nodes (they store nothing for others), so every put crosses to the
child and every get comes back from it — nothing is served from a local replica or cache. ``put`` is
timed on the writer, ``get`` (with every piece and the whole value hash-checked) on the reader.

Baseline, measured in the same run over the same connection: one hivemind ``DHTNode.store`` /
``get`` record holding the whole value (no pieces, manifest or index: one signed, content-addressed
record, which every node checks like any other); only possible up to the ~4 MiB message cap, so it
is absent for larger sizes. Every node runs the run's write rules; the stores sign with a
throwaway validator key, so ``bench/...`` keys are theirs to write.

``--flood N``: listing work under a flood of valid, self-signed directory entries
(:mod:`scripts.bench_dht_flood`): 5 honest contributions in one window, then N entries of that
window in one store RPC (a fresh key each) and ``--fake-folders`` fake window folders. Each
listing is timed and counted (entries in the records, entries decoded, keys returned) before and
after the flood, side by side, for the validator's listing (``list_written_by`` the announced
peers), a plain capped ``list``, and a ``list`` without caps (how every listing worked before the
caps: the baseline).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from protocol.identity import Identity
from protocol.store.dht.records import open_record, seal_record
from protocol.store.dht.store import DHTStore

SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 3 << 20, 8 << 20]
RAW_LIMIT = 3 << 20  # raw single records above ~3.5 MiB do not round-trip (hivemind's 4 MiB message cap)
SIGNER = Identity.generate()  # the benchmark's validator key


def start_server() -> tuple[subprocess.Popen[str], list[str]]:
    cmd = [sys.executable, "-m", "protocol.store.dht.serve", "--control"]  # stdin EOF stops it
    cmd += ["--validator-key", SIGNER.public_key_hex]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    maddrs: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("MADDR "):
            maddrs.append(line.split()[1])
        elif line.strip() == "READY":
            return proc, maddrs
        else:
            break
    proc.kill()
    raise RuntimeError(f"DHT server process failed: {line!r}")


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_size(writer: DHTStore, reader: DHTStore, size: int, repeats: int) -> dict[str, Any]:
    from hivemind.utils.timed_storage import get_dht_time

    puts, gets, raw_puts, raw_gets = [], [], [], []
    for rep in range(repeats):
        data, key = os.urandom(size), f"bench/{size}/{rep}-{os.urandom(4).hex()}"
        puts.append(timed(lambda: writer.put(key, data)))
        got: list[bytes] = []
        gets.append(timed(lambda: got.append(reader.get(key, max_bytes=size))))
        assert got[0] == data, "payload changed in transit"
        if size <= RAW_LIMIT:
            raw_key, expiration = writer.policy.dht_key("piece", hashlib.sha256(data).hexdigest()), get_dht_time() + 600

            def raw_put() -> None:
                record = seal_record(SIGNER, key=raw_key, subkey="", expiration=expiration, content=data)
                writer._run(writer._node.store(raw_key, record, expiration), "raw put")

            raw_puts.append(timed(raw_put))
            found: list[Any] = []
            raw_gets.append(timed(lambda: found.append(reader._run(reader._node.get(raw_key, latest=True), "raw get"))))
            assert found[0] is not None and open_record(found[0].value).content == data, "raw record changed"
    mib = size / (1 << 20)

    def rate(samples: list[float]) -> float | None:
        return round(mib / statistics.median(samples), 2) if samples else None

    return {
        "bytes": size,
        "put_mib_s": rate(puts),
        "get_mib_s": rate(gets),
        "put_ms": round(1e3 * statistics.median(puts), 2),
        "get_ms": round(1e3 * statistics.median(gets), 2),
        "raw_put_mib_s": rate(raw_puts),
        "raw_get_mib_s": rate(raw_gets),
    }


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def show(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="DHTStore between two processes on 127.0.0.1 (median)")
    for col in ("payload", "put MiB/s", "get MiB/s", "put ms", "get ms", "raw put MiB/s", "raw get MiB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        cells = [r["put_mib_s"], r["get_mib_s"], r["put_ms"], r["get_ms"], r["raw_put_mib_s"], r["raw_get_mib_s"]]
        table.add_row(human(r["bytes"]), *("—" if c is None else str(c) for c in cells))
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-size", type=int, default=1 << 20)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--flood", type=int, default=0, help="measure listings under a flood of N entries")
    parser.add_argument("--fake-folders", type=int, default=500)
    args = parser.parse_args()
    if args.flood:
        from bench_dht_flood import run_flood

        return run_flood(args.flood, args.fake_folders, args.repeats, args.json, start_server, SIGNER)
    server, maddrs = start_server()
    keys = [SIGNER.public_key]
    try:
        with (
            DHTStore(
                maddrs, client_mode=True, piece_size=args.piece_size, identity=SIGNER, validator_keys=keys
            ) as writer,
            DHTStore(maddrs, client_mode=True, piece_size=args.piece_size, validator_keys=keys) as reader,
        ):
            bench_size(writer, reader, 1 << 10, 3)  # warm-up: connections and routing tables
            rows = [bench_size(writer, reader, size, args.repeats) for size in SIZES]
    finally:
        assert server.stdin is not None
        server.stdin.close()  # graceful: the server closes its node and p2pd
        server.wait(30)
    if args.json:
        print(json.dumps({"piece_size": args.piece_size, "repeats": args.repeats, "results": rows}))
    else:
        show(rows, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
