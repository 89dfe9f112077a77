#!/usr/bin/env python
"""A store outage during a run: the warning lines the validator writes and the windows it costs.

    python scripts/bench_outage.py                      # table
    python scripts/bench_outage.py --json               # one JSON object
    python scripts/bench_outage.py --outage-s 60 --deadline-s 90

A local swarm (:class:`client.demo.swarm.LocalSwarm`: a validator with its grant server and
``--peers`` peers, each a process, over a SeaweedFS bucket on 127.0.0.1) runs ``--windows``
windows of the tiny model. Once window ``--at`` is published the SeaweedFS server is stopped for
``--outage-s`` seconds and started again on the same ports and data (the outage is shorter than
the upload deadline ``--deadline-s``, so no window needs to be lost). Reported: the validator's
warning lines (Python logging at WARNING or above, on its stderr), those that carry a URL with a
query string, its ``store_errors`` summaries, the windows published with fewer contributions than
peers (``windows_lost``), the accepted contributions per window, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.demo.swarm import SMALL_RUN, VALIDATOR, LocalSwarm  # noqa: E402

WARNING = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) ")
QUERY_URL = re.compile(r"https?://[^\s'\"]*\?")


def run(
    peers: int, windows: int, at: int, outage_s: float, deadline_s: float, timeout_s: float, keep: str = ""
) -> dict[str, Any]:
    overrides = {k: dict(v) for k, v in SMALL_RUN.items()}
    overrides["windows"].update(upload_deadline_s=deadline_s, gather_grace_s=2.0)
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as scratch:
        tmp = keep or scratch
        with LocalSwarm(Path(tmp), peers=peers, windows=windows, store="s3", overrides=overrides) as swarm:
            assert swarm.backend is not None and swarm.backend._server is not None
            server = swarm.backend._server
            swarm.start_peers_then_validator(timeout_s=timeout_s)
            swarm.follow(lambda: at in swarm.published, timeout_s=timeout_s)
            started = time.time()
            server.down()
            swarm.follow(lambda: time.time() - started >= outage_s, timeout_s=outage_s + 30)
            server.up()
            swarm.follow(swarm.finished, timeout_s=timeout_s)
            swarm.wait_exit(timeout_s=60.0)
            summary = swarm.summary()
            log = (Path(tmp) / "logs" / f"{VALIDATOR}.log").read_text(errors="replace").splitlines()
    warnings = [line for line in log if WARNING.match(line)]
    summaries = [line for line in log if '"store_errors"' in line]
    accepted = summary["accepted_per_window"]
    return {
        "peers": peers,
        "windows": windows,
        "outage_s": outage_s,
        "deadline_s": deadline_s,
        "validator_warning_lines": len(warnings),
        "warning_lines_with_query_url": sum(1 for line in warnings if QUERY_URL.search(line)),
        "store_error_summaries": len(summaries),
        "windows_completed": summary["windows_completed"],
        "windows_lost": sum(1 for n in accepted if n < peers) + (windows - summary["windows_completed"]),
        "accepted_per_window": accepted,
        "rejected_per_window": summary["rejected_per_window"],
        "seconds": summary["seconds"],
        "first_warnings": [line[:300] for line in warnings[:3]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--at", type=int, default=1, help="stop the store once this window is published")
    ap.add_argument("--outage-s", type=float, default=15.0)
    ap.add_argument("--deadline-s", type=float, default=40.0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--keep", default="", help="run in this directory and keep it (logs, contribution log)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args.peers, args.windows, args.at, args.outage_s, args.deadline_s, args.timeout_s, args.keep)
    if args.json:
        print(json.dumps(result))
        return
    table = Table(title=f"store outage of {args.outage_s:.0f} s, upload deadline {args.deadline_s:.0f} s")
    for col in ("warning lines", "with query URL", "summaries", "windows lost", "accepted per window", "s"):
        table.add_column(col)
    table.add_row(
        str(result["validator_warning_lines"]),
        str(result["warning_lines_with_query_url"]),
        str(result["store_error_summaries"]),
        str(result["windows_lost"]),
        str(result["accepted_per_window"]),
        str(result["seconds"]),
    )
    Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
