#!/usr/bin/env python
"""The swarm over shaped links: per WAN profile, N peers for W windows in the box
(:mod:`client.demo.wan`), and a late joiner's catch-up on the same links.

    sudo .venv/bin/python scripts/bench_wan.py --json                        # every profile
    sudo .venv/bin/python scripts/bench_wan.py --profiles dsl --peers 3 --windows 6

Per profile (home, dsl, cloud, mix; the store and the validator always on cloud):

* ``windows_completed``, ``fingerprints_equal``: the demo's summary (the validator's log, every
  peer's θ after every window).
* ``window_s``: the mean time between consecutive published windows (first to last, an outage's
  delay included); ``window_s_median`` the median.
* ``compute_fraction``: a peer's training time (``inner_s`` less the wait for the forecast) in the
  windows after the first published one, over the time from the first published window to the
  last; the mean over the original peers.
* ``up_bytes_per_peer_per_window`` / ``down_bytes_per_peer_per_window``: what the original peers'
  links carried (whole frames, at the interface), per peer and window; ``…_payload_est`` the TCP
  payload estimated from them (:func:`client.demo.wan.payload_estimate`).
* ``catch_up_s``: one more peer started once window ``--late-after`` is published, on the profile's
  slowest link (dsl for mix): seconds from its start to its first trained window (null when it
  trained none before the original peers applied the last window: give it more windows; a peer
  process takes ~20 s to start on two busy cores).

* ``reported_vs_interface_max_rel_diff``: the largest relative difference, over the original
  peers and both directions, between the wire bytes the peers' window reports carry (what their
  store sockets moved) and the TCP payload their links carried up to their last report
  (:class:`client.demo.wan.Ledger`).
* ``requests_per_peer_per_window``: bucket requests by kind (GET, HEAD, LIST, PUT) each peer's
  store sent, from its window reports; ``store_requests_per_window`` what SeaweedFS counted from
  everyone (a HEAD counts as a GET there).

Over the whole run: ``outage`` (mix: its dsl peer's link is down ``--outage-s`` seconds from the
moment the validator grants it window 1's upload: ``windows_lost`` of the run it had no upload
accepted for, ``duplicate_uploads`` beyond one per window in the store or the validator's log);
``bill_per_day_usd`` (``r2``, ``s3``): a day of a 1B run with 256 peers and 20-minute windows at
list ``prices`` (inputs of ``scripts/bench_bill.py``), from the mix run's measured requests per
peer and per validator window, with sizes at the codec's bounds.

Prints progress to stderr, then a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_bill import demo_counts, project
from wan import SIZES, progress

from client.demo.processes import install_signal_handlers
from client.demo.swarm import LocalSwarm, default_threads
from client.demo.wan import LINKS, PROFILES, Counters, Ledger, Link, Wan, swarm_links
from protocol import layout
from protocol.events import Event, Granted, PeerWindow

OUTAGE_WINDOW = 1  # the window whose upload the outage interrupts (mix only: its last dsl peer)
SLOWEST = {"home": "home", "dsl": "dsl", "cloud": "cloud", "mix": "dsl"}  # the late joiner's link


# ---------------------------------------------------------------------- hooks filled elsewhere
def reported_vs_interface_max_rel_diff(ledger: Ledger, originals: list[str]) -> float | None:
    """Largest relative difference, over the original peers and both directions, between the wire
    bytes a peer's window reports carry and the TCP payload its link carried up to its last report
    (:class:`client.demo.wan.Ledger`); None: no report."""
    diff = ledger.max_rel_diff(originals)
    return None if diff is None else round(diff, 5)


def requests_per_peer_per_window(summary: dict[str, Any]) -> dict[str, float] | None:
    """Bucket requests per peer per window by kind (GET, HEAD, LIST, PUT): what each peer's store
    sent, from its window reports (the demo's summary); None: not over S3."""
    counts: dict[str, float] | None = summary.get("requests_per_peer_per_window")
    return counts


class Outage:
    """The link of ``victim`` taken down for ``seconds`` as soon as the validator grants it the
    upload of window ``window`` (its put is then on the wire, or about to be), then up again."""

    def __init__(self, victim: str, seconds: float, window: int) -> None:
        self.victim, self.seconds, self.window = victim, seconds, window
        self.granted = False
        self.down_at: float | None = None
        self.up_at: float | None = None

    def on_event(self, swarm: LocalSwarm, name: str, event: Event) -> None:
        if isinstance(event, Granted) and event.op == "put" and swarm.spec is not None:
            peer_id = swarm.peers[self.victim].peer_id
            key = layout.contrib_key(layout.run_id(swarm.spec.hash()), self.window, peer_id or "")
            self.granted = self.granted or event.key.endswith(key)

    def run(self, swarm: LocalSwarm, wan: Wan, timeout_s: float) -> None:
        swarm.follow(lambda: self.granted, timeout_s=timeout_s)
        wan.down(self.victim)
        self.down_at = time.monotonic()
        print(f"link of {self.victim} down for {self.seconds:.0f} s (window {self.window}'s upload)", file=sys.stderr)
        swarm.follow(lambda: time.monotonic() - (self.down_at or 0.0) >= self.seconds, timeout_s=self.seconds + 60)
        wan.up(self.victim)
        self.up_at = time.monotonic()

    def cost(self, swarm: LocalSwarm, windows: int) -> dict[str, Any]:
        """``windows_lost``: windows of the run the victim did not get an upload accepted for;
        ``duplicate_uploads``: its contributions beyond one per window, in the store or the
        validator's log; ``resent``: windows whose retry found its own bytes already stored."""
        assert swarm.backend is not None and swarm.spec is not None
        view = swarm.peers[self.victim]
        run = layout.run_id(swarm.spec.hash())
        stored = [
            k for k in swarm.backend.admin_store().list(layout.contribs_prefix(run)) if k.endswith(view.peer_id or "")
        ]
        logged = [r for r in swarm.log_contributions() if r.peer == view.peer_id]
        reports = [e for e in view.events if isinstance(e, PeerWindow)]
        uploaded = {e.window for e in reports if e.outcome == "uploaded"}
        return {
            "victim": self.victim,
            "seconds": self.seconds,
            "window": self.window,
            "windows_lost": sum(1 for w in range(windows) if w not in uploaded),
            "duplicate_uploads": (len(stored) - len(set(stored))) + (len(logged) - len({r.window for r in logged})),
            "resent": sum(1 for e in reports if e.reason == "already present"),
            "attempts": {e.window: e.upload_attempts for e in reports if e.upload_attempts > 1},
            "upload_s": {e.window: e.upload_s for e in reports if e.window == self.window},
            "not_uploaded": {e.window: f"{e.outcome}: {e.reason}" for e in reports if e.outcome != "uploaded"},
        }


def bill(row: dict[str, Any]) -> dict[str, Any] | None:
    """The day's bucket bill of a 1B run with 256 peers and 20-minute windows, from the requests
    ``row``'s run measured per peer and per validator window (:func:`bench_bill.project`: R2 and
    S3 Standard list prices as inputs, sizes from the codec's bounds); None: no counts."""
    if not row.get("requests_per_peer_per_window") or not row.get("store_requests_per_window"):
        return None
    per_peer, validator = demo_counts(
        {
            "requests_per_peer_per_window": row["requests_per_peer_per_window"],
            "store_requests_per_window": row["store_requests_per_window"],
            "peers": row["peers"],
        }
    )
    return project(per_peer, validator)


# ---------------------------------------------------------------------- one profile
def box_links(profile: str, peers: int) -> dict[str, Link]:
    """The swarm's links and the late joiner's (``peer-<peers>``) on the profile's slowest link."""
    return swarm_links(profile, peers) | {f"peer-{peers}": LINKS[SLOWEST[profile]]}


def bench_profile(
    profile: str,
    *,
    peers: int,
    windows: int,
    late_after: int,
    size: str,
    timeout_s: float,
    outage_s: float,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    late = f"peer-{peers}"
    ledgers: list[Ledger] = []
    links = box_links(profile, peers)
    dsl = [name for name, link in links.items() if link.profile == "dsl" and name != late]
    cut = Outage(dsl[-1], outage_s, OUTAGE_WINDOW) if outage_s > 0 and profile == "mix" and dsl else None
    swarms: list[LocalSwarm] = []

    def on_event(name: str, event: Event) -> None:
        progress(name, event)
        for ledger in ledgers:
            ledger.on_event(name, event)
        if cut is not None and swarms:
            cut.on_event(swarms[0], name, event)

    with (
        Wan(links) as wan,
        LocalSwarm(
            None if run_dir is None else run_dir / profile,
            peers=peers,
            windows=windows,
            store="s3",
            overrides=SIZES[size],
            peer_threads=default_threads(peers + 1),
            join_timeout_s=timeout_s,
            on_event=on_event,
            wan=wan,
        ) as swarm,
    ):
        ledgers.append(Ledger(wan))
        swarms.append(swarm)
        try:
            originals = [f"peer-{i}" for i in range(peers)]
            swarm.start_peers_then_validator(timeout_s=timeout_s)
            start = {name: wan.counters(name) for name in originals}
            if cut is not None:
                cut.run(swarm, wan, timeout_s)
            swarm.follow(lambda: late_after in swarm.published, timeout_s=timeout_s)
            swarm.start_peer(peers)
            late_started = time.time()
            last = windows - 1
            swarm.follow(lambda: all(last in swarm.peers[n].applied for n in originals), timeout_s=timeout_s)
            summary = swarm.summary()
            moved = [wan.counters(name) - start[name] for name in originals]
            row = measure(swarm, originals, moved, windows, late, late_started)
            row |= {
                "profile": profile,
                "links": {
                    name: f"{link.up_mbit:g}/{link.down_mbit:g} {link.profile}" for name, link in wan.links.items()
                },
                "peers": peers,
                "windows": windows,
                "windows_completed": summary["windows_completed"],
                "fingerprints_equal": summary["fingerprints_equal"],
                "reported_upload_bytes_per_peer_per_window": summary["upload_bytes_per_peer_per_window"],
                "reported_download_bytes_per_peer_per_window": summary["download_bytes_per_peer_per_window"],
                "reported_vs_interface_max_rel_diff": reported_vs_interface_max_rel_diff(ledgers[0], originals),
                "requests_per_peer_per_window": requests_per_peer_per_window(summary),
                "store_requests_per_window": summary.get("store_requests_per_window"),
                "outage": None if cut is None else cut.cost(swarm, windows),
                "seconds": summary["seconds"],
            }
        except BaseException:
            print(f"logs kept in {swarm.run_dir / 'logs'}", file=sys.stderr)
            raise
        swarm.cleanup()
        return row


def measure(
    swarm: LocalSwarm, originals: list[str], moved: list[Counters], windows: int, late: str, late_started: float
) -> dict[str, Any]:
    published = sorted(e.published_at for e in swarm.published.values())
    span = published[-1] - published[0] if len(published) > 1 else 0.0
    window_s = span / (len(published) - 1) if span > 0 else None
    median_s = statistics.median(b - a for a, b in zip(published, published[1:])) if span > 0 else None
    first_window = min(swarm.published) if swarm.published else 0

    def training_s(name: str) -> float:
        """The peer's training time in the windows after the first published one (those ``span`` holds)."""
        return sum(
            max(0.0, e.inner_s - e.forecast_wait_s)
            for e in swarm.peers[name].events
            if isinstance(e, PeerWindow) and e.tokens > 0 and e.window > first_window
        )

    compute = statistics.mean(training_s(name) / span for name in originals) if span > 0 else None
    first = next((e for e in swarm.peers[late].events if isinstance(e, PeerWindow) and e.tokens > 0), None)
    per = len(originals) * windows

    def avg(values: list[int]) -> int:
        return round(sum(values) / per)

    return {
        "window_s": None if window_s is None else round(window_s, 3),
        "window_s_median": None if median_s is None else round(median_s, 3),
        "compute_fraction": None if compute is None else round(compute, 4),
        "up_bytes_per_peer_per_window": avg([c.up_bytes for c in moved]),
        "down_bytes_per_peer_per_window": avg([c.down_bytes for c in moved]),
        "up_payload_est_per_peer_per_window": avg([c.up_payload for c in moved]),
        "down_payload_est_per_peer_per_window": avg([c.down_payload for c in moved]),
        "catch_up_s": None if first is None else round(first.time - late_started, 2),
        "late_joiner_window": None if first is None else first.window,
    }


# ---------------------------------------------------------------------- output
COLUMNS = (
    ("profile", "profile", "{}"),
    ("windows_completed", "windows", "{}"),
    ("fingerprints_equal", "θ equal", "{}"),
    ("window_s", "window s", "{:.2f}"),
    ("compute_fraction", "compute", "{:.3f}"),
    ("up_bytes_per_peer_per_window", "up B/peer/w", "{:,}"),
    ("down_bytes_per_peer_per_window", "down B/peer/w", "{:,}"),
    ("catch_up_s", "catch-up s", "{:.1f}"),
    ("seconds", "run s", "{:.0f}"),
)


def print_table(rows: list[dict[str, Any]]) -> None:
    widths = [max(len(title), 12) for _, title, _ in COLUMNS]
    print("  ".join(title.rjust(w) for (_, title, _), w in zip(COLUMNS, widths)))
    for row in rows:
        cells = [("-" if row[key] is None else fmt.format(row[key])) for key, _, fmt in COLUMNS]
        print("  ".join(cell.rjust(w) for cell, w in zip(cells, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated, of " + ", ".join(PROFILES))
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--late-after", type=int, default=2, help="start the late joiner once this window is published")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for each profile's run")
    parser.add_argument(
        "--outage-s", type=float, default=30.0, help="mix: its dsl peer's link is down this long mid-upload (0: none)"
    )
    parser.add_argument("--run-dir", type=Path, help="keep each profile's run (logs, states) under this directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = sorted(set(profiles) - set(PROFILES))
    if unknown or not 0 <= args.late_after < args.windows - 1:
        parser.error(f"unknown profile(s) {unknown}" if unknown else "--late-after must be below --windows - 1")
    reason = Wan.available()
    if reason is not None:
        print(f"cannot build the WAN box: {reason}", file=sys.stderr)
        return 2
    install_signal_handlers()
    rows = []
    try:
        for profile in profiles:
            print(f"== {profile}", file=sys.stderr, flush=True)
            rows.append(
                bench_profile(
                    profile,
                    peers=args.peers,
                    windows=args.windows,
                    late_after=args.late_after,
                    size=args.size,
                    timeout_s=args.timeout,
                    outage_s=args.outage_s,
                    run_dir=args.run_dir,
                )
            )
    except KeyboardInterrupt:
        print("interrupted: processes stopped, box removed", file=sys.stderr)
        return 130
    result = summarise(rows) | {"peers": args.peers, "windows": args.windows, "size": args.size}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(rows)
        print(f"outage: {json.dumps(result['outage'])}")
        print(f"bill per day at 1B x 256 x 20 min (USD): {json.dumps(result['bill_per_day_usd'])}")
    return 0


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON: ``profiles`` by name, the outage (mix), the bill from the mix run's requests (else
    the first profile's) and the prices it used."""
    by_name = {row["profile"]: row for row in rows}
    source = by_name.get("mix", rows[0] if rows else {})
    priced = bill(source) if source else None
    return {
        "profiles": by_name,
        "outage": next((row["outage"] for row in rows if row.get("outage")), None),
        "bill_per_day_usd": None
        if priced is None
        else {"r2": priced["projection"]["r2"], "s3": priced["projection"]["s3"], "from_profile": source["profile"]},
        "bill": priced,
        "prices": None if priced is None else priced["prices"],
    }


if __name__ == "__main__":
    sys.exit(main())
