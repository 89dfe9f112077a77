#!/usr/bin/env python
"""A validator restarted while its peers are gone: the empty windows it publishes meanwhile.

    python scripts/bench_restart.py                     # table
    python scripts/bench_restart.py --json              # one JSON object
    python scripts/bench_restart.py --away-s 60 --deadline-s 15

A local swarm (:class:`client.demo.swarm.LocalSwarm`: a validator and ``--peers`` peers, each a
process, over a directory store) runs the tiny model. Once window ``--at`` is published every peer
and then the validator are SIGKILLed (a host rebooted, a run paused); the validator is started
again at once and the peers ``--away-s`` seconds later, from their state directories. Reported:
the windows the validator published while no peer ran (``empty_while_away``; each is an aggregate
every returning peer replays), and the windows from the peers' return to the first one they all
contributed to, with the seconds it took.
"""

from __future__ import annotations

import argparse
import json
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


def run(peers: int, at: int, away_s: float, deadline_s: float, timeout_s: float) -> dict[str, Any]:
    overrides = {k: dict(v) for k, v in SMALL_RUN.items()}
    overrides["windows"].update(upload_deadline_s=deadline_s, gather_grace_s=1.0)
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        with LocalSwarm(Path(tmp), peers=peers, windows=1000, store="file", overrides=overrides) as swarm:
            swarm.start_peers_then_validator(timeout_s=timeout_s)
            swarm.follow(lambda: at in swarm.published, timeout_s=timeout_s)
            names = sorted(swarm.peers)
            for name in names:
                swarm.kill(name)
            swarm.kill(VALIDATOR)
            published_before = set(swarm.published)
            swarm.start_validator()
            started = time.time()
            swarm.follow(lambda: time.time() - started >= away_s, timeout_s=away_s + 60)
            empty_while_away = sorted(set(swarm.published) - published_before)
            back = time.time()
            for i in range(peers):
                swarm.start_peer(i)

            def back_at(w: int) -> float:
                return swarm.published[w].published_at

            def all_in() -> int | None:
                for w in sorted(swarm.published):
                    if w not in published_before and swarm.published[w].accepted == peers:
                        return w
                return None

            swarm.follow(lambda: all_in() is not None, timeout_s=timeout_s)
            first_full = all_in()
            assert first_full is not None
            took = swarm.published[first_full].published_at - back
            between = [
                w for w in swarm.published if w not in published_before and back_at(w) >= back and w < first_full
            ]
            held = sum(1 for line in (Path(tmp) / "logs" / f"{VALIDATOR}.log").open() if '"window_held"' in line)
    return {
        "peers": peers,
        "away_s": away_s,
        "deadline_s": deadline_s,
        "empty_while_away": len(empty_while_away),
        "window_held_events": held,
        "windows_before_first_full": len(between),
        "seconds_back_to_first_full": round(took, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--at", type=int, default=1, help="kill everyone once this window is published")
    ap.add_argument("--away-s", type=float, default=45.0)
    ap.add_argument("--deadline-s", type=float, default=15.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args.peers, args.at, args.away_s, args.deadline_s, args.timeout_s)
    if args.json:
        print(json.dumps(result))
        return
    table = Table(title=f"validator restarted, peers away {args.away_s:.0f} s, upload deadline {args.deadline_s:.0f} s")
    for col in ("empty windows while away", "window_held", "windows before the first full one", "s back → full"):
        table.add_column(col)
    table.add_row(
        str(result["empty_while_away"]),
        str(result["window_held_events"]),
        str(result["windows_before_first_full"]),
        str(result["seconds_back_to_first_full"]),
    )
    Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
