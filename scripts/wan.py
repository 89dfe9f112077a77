#!/usr/bin/env python
"""A local swarm in the WAN box: the store, the validator and every peer in its own network
namespace behind a shaped link (:mod:`client.demo.wan`), over SeaweedFS S3 with grants.

    sudo .venv/bin/python scripts/wan.py --profile mix --peers 3 --windows 10
    sudo .venv/bin/python scripts/wan.py --profile dsl --peers 2 --windows 4 --json

Needs root, iproute2 (``ip``, ``tc``) and SeaweedFS's ``weed``. Progress (each published window)
goes to stderr; the summary is a table, or one JSON object with ``--json``: the demo's summary
(``windows_completed``, ``fingerprints_equal``, …) plus ``profile``, ``links`` (each participant's
Mbit/s up/down) and ``interface`` (per participant the bytes and packets its link carried up and
down, and the TCP payload estimated from them). Ctrl-C (or SIGTERM) stops every process and
removes the box. ``--size small`` (default) is the integration tests' ~0.1 M-parameter model,
``--size demo`` the demo preset's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from client.demo.processes import install_signal_handlers
from client.demo.swarm import SMALL_RUN as SMALL
from client.demo.swarm import LocalSwarm, default_threads
from client.demo.wan import PROFILES, Wan
from protocol.events import Event, WindowPublished

SIZES: dict[str, dict[str, dict[str, Any]]] = {"small": SMALL, "demo": {}}


def interface_table(wan: Wan) -> dict[str, dict[str, Any]]:
    """Per participant: its link (Mbit/s) and what crossed it (bytes, packets, payload estimate)."""
    return {
        name: {"profile": link.profile, "up_mbit": link.up_mbit, "down_mbit": link.down_mbit}
        | wan.counters(name).to_dict()
        for name, link in wan.links.items()
    }


def progress(name: str, event: Event) -> None:
    if isinstance(event, WindowPublished):
        print(
            f"[{time.strftime('%H:%M:%S')}] window {event.window} published by {name}: "
            f"{event.accepted} accepted, {event.rejected} rejected, val loss {event.val_loss:.4f}",
            file=sys.stderr,
            flush=True,
        )


def run(
    wan: Wan, *, peers: int, windows: int, size: str, timeout_s: float, run_dir: Path | None = None
) -> dict[str, Any]:
    """One swarm of ``peers`` peers for ``windows`` windows in the started box ``wan``: the demo's
    summary with the box's links and interface counters."""
    with LocalSwarm(
        run_dir,
        peers=peers,
        windows=windows,
        store="s3",
        overrides=SIZES[size],
        peer_threads=default_threads(peers),
        join_timeout_s=timeout_s,
        on_event=progress,
        wan=wan,
    ) as swarm:
        try:
            swarm.start_peers_then_validator(timeout_s=timeout_s)
            swarm.follow(swarm.finished, timeout_s=timeout_s)
            swarm.wait_exit(timeout_s=60.0)
            return swarm.summary() | {"interface": interface_table(wan)}
        finally:
            if run_dir is None:
                swarm.cleanup()


def print_table(summary: dict[str, Any]) -> None:
    print(
        f"profile {summary['profile']}: {summary['windows_completed']} windows, "
        f"fingerprints_equal={summary['fingerprints_equal']}, {summary['seconds']} s"
    )
    head = f"{'participant':<12} {'link':>12} {'up MB':>9} {'up pkts':>8} {'down MB':>9} {'down pkts':>9}"
    print(head)
    print("-" * len(head))
    for name, row in summary["interface"].items():
        link = f"{row['up_mbit']:g}/{row['down_mbit']:g}"
        print(
            f"{name:<12} {link:>12} {row['up_bytes'] / 1e6:>9.3f} {row['up_packets']:>8} "
            f"{row['down_bytes'] / 1e6:>9.3f} {row['down_packets']:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="mix")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the run here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    reason = Wan.available()
    if reason is not None:
        print(f"cannot build the WAN box: {reason}", file=sys.stderr)
        return 2
    install_signal_handlers()  # Ctrl-C / SIGTERM unwind through every `with`: processes, then the box
    try:
        with Wan.for_swarm(args.profile, args.peers) as wan:
            print(f"box {wan.tag}: {wan.subnet}, bridge {wan.bridge}", file=sys.stderr, flush=True)
            summary = {"profile": args.profile} | run(
                wan,
                peers=args.peers,
                windows=args.windows,
                size=args.size,
                timeout_s=args.timeout,
                run_dir=args.run_dir,
            )
    except KeyboardInterrupt:
        print("interrupted: processes stopped, box removed", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
