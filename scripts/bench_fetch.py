"""Reading one large object from S3: one ``get`` against ranged parallel fetches.

    python scripts/bench_fetch.py                  # rich table
    python scripts/bench_fetch.py --json           # one JSON object, then the table on stderr
    python scripts/bench_fetch.py --mib 256 --parallel 1,4,8 --part-mib 8 --repeat 3

Starts a SeaweedFS S3 server on 127.0.0.1 (``weed mini``, :mod:`client.demo.seaweed`), puts one
object of ``--mib`` MiB of random bytes, and reads it back ``--repeat`` times per way:

* ``get``: one ``S3Store.get`` capped at the object's size; ``get + sha256``: the same, then its
  digest (how a checkpoint file was read before);
* ``fetch ×N``: :func:`protocol.store.fetch.fetch` with ``--part-mib`` ranges, N in flight, the
  sha256 checked as the ranges land (the checkpoint path now);
* ``fetch ×N, drops``: the same while every ``--drop-every``-th range read loses its answer after
  the body arrived (a connection cut mid-transfer) and is read again: the bytes read twice.

For each: the best and median MiB/s over the repeats, and the largest growth of resident memory
during a read (``scripts/rss_peak.py``). On loopback the network is not the limit; over a home link
(50 Mbit/s) every way is link-bound, and what ranges buy there is that a drop costs the ranges in
flight instead of the whole transfer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rss_peak import RssPeak

from client.demo.seaweed import SeaweedS3
from protocol.errors import StoreUnavailable
from protocol.store.base import DEFAULT_MAX_BYTES, ObjectStore
from protocol.store.fetch import fetch

MiB = 1 << 20
KEY = "bench/checkpoint/00000001/model.safetensors"


class Drops(ObjectStore):
    """``inner`` whose every ``every``-th range read is dropped after its body arrived."""

    def __init__(self, inner: ObjectStore, every: int) -> None:
        self.inner, self.every = inner, every
        self.reads = 0
        self.dropped_bytes = 0
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        with self._lock:
            self.reads += 1
            drop = self.reads % self.every == 0
            if drop:
                self.dropped_bytes += len(data)
        if drop:
            raise StoreUnavailable(f"connection dropped reading {key!r} at {start}")
        return data

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def measure(read: Callable[[], bytes], expected: str, repeat: int) -> dict[str, Any]:
    """MiB/s (best, median) and peak RSS growth of ``repeat`` reads, each checked."""
    rates, peaks = [], []
    for _ in range(repeat):
        with RssPeak() as rss:
            t0 = time.perf_counter()
            data = read()
            seconds = time.perf_counter() - t0
        if hashlib.sha256(data).hexdigest() != expected:
            raise SystemExit("a read returned other bytes")
        rates.append(len(data) / MiB / seconds)
        peaks.append(rss.peak)
        del data
    return {
        "mib_per_s_best": round(max(rates), 1),
        "mib_per_s_median": round(statistics.median(rates), 1),
        "peak_rss_mib": round(max(peaks) / MiB, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = args.mib * MiB
    part = args.part_mib * MiB
    data = os.urandom(size)
    digest = hashlib.sha256(data).hexdigest()
    rows: list[dict[str, Any]] = []
    with SeaweedS3() as s3:
        store = s3.store("bench", max_concurrency=max(args.parallel))
        with store:
            store.put(KEY, data)
            del data
            rows.append(
                {"way": "get", "parallel": 1, **measure(lambda: store.get(KEY, max_bytes=size), digest, args.repeat)}
            )

            def verified_get() -> bytes:  # what a checkpoint file cost before: the whole body, then its hash
                data = store.get(KEY, max_bytes=size)
                hashlib.sha256(data).hexdigest()
                return data

            rows.append({"way": "get + sha256", "parallel": 1, **measure(verified_get, digest, args.repeat)})
            for n in args.parallel:

                def ranged(n: int = n, on: ObjectStore = store) -> bytes:
                    return fetch(on, KEY, size=size, sha256=digest, part_bytes=part, parallel=n)

                rows.append({"way": f"fetch x{n}", "parallel": n, **measure(ranged, digest, args.repeat)})
            n = max(args.parallel)
            drops = Drops(store, args.drop_every)

            def dropping() -> bytes:
                return fetch(drops, KEY, size=size, sha256=digest, part_bytes=part, parallel=n, backoff_s=0.05)

            row = {"way": f"fetch x{n}, drops", "parallel": n, **measure(dropping, digest, args.repeat)}
            row["reread_mib_per_read"] = round(drops.dropped_bytes / MiB / args.repeat, 1)
            rows.append(row)
    return {
        "object_mib": args.mib,
        "part_mib": args.part_mib,
        "repeat": args.repeat,
        "drop_every": args.drop_every,
        "server": "SeaweedFS weed mini on 127.0.0.1",
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"one {result['object_mib']} MiB object from S3 ({result['part_mib']} MiB ranges)")
    for col in ("way", "MiB/s best", "MiB/s median", "peak RSS MiB", "re-read MiB"):
        t.add_column(col, justify="left" if col == "way" else "right")
    for r in result["rows"]:
        t.add_row(
            r["way"],
            f"{r['mib_per_s_best']:.1f}",
            f"{r['mib_per_s_median']:.1f}",
            f"{r['peak_rss_mib']:.1f}",
            str(r.get("reread_mib_per_read", "-")),
        )
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    p.add_argument("--mib", type=int, default=256, help="object size in MiB")
    p.add_argument("--part-mib", type=int, default=8, help="range size in MiB")
    p.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--drop-every", type=int, default=5, help="every n-th range read is dropped (the drops row)")
    args = p.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    Console(stderr=args.json).print(table(result))


if __name__ == "__main__":
    main()
