"""``sparseloco demo``: the whole system on this machine, with progress and a summary.

    sparseloco demo                          # validator + 3 peers, file store, 6 windows
    sparseloco demo --peers 4 --store s3     # SeaweedFS on 127.0.0.1; peers hold no credential (grants)
    sparseloco demo --store dht --json       # hivemind DHT on 127.0.0.1; last line is JSON
    sparseloco demo --validators 4 --quorum 3 --faults liar,kill-leader   # 3-of-4 co-signed aggregates

Thin command: :func:`client.demo.swarm.run_demo` does the work; this module renders the processes'
events and the summary table.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from client.demo.backends import KINDS
from client.demo.errors import DemoError
from client.demo.processes import install_signal_handlers
from client.demo.swarm import FAULTS, PRESET, VALIDATOR, run_demo
from protocol.errors import ConfigError
from protocol.events import (
    AgreementStep,
    Event,
    Failed,
    Joined,
    PeerWindow,
    Resynced,
    SyncFailed,
    WindowPublished,
    WindowRetry,
    WindowWaiting,
    describe,
)

EXIT_FAILED = 1  # a process crashed or the run timed out (DemoError)
EXIT_CONFIG = 2  # the run cannot start: a bad preset, a missing SeaweedFS binary
EXIT_INTERRUPTED = 130


@click.command("demo")
@click.option("--peers", default=3, show_default=True, type=click.IntRange(1, 64), help="Peer processes.")
@click.option("--windows", default=6, show_default=True, type=click.IntRange(1), help="Windows to run.")
@click.option("--store", default="file", show_default=True, type=click.Choice(KINDS), help="Object store.")
@click.option(
    "--dir", "run_dir", default=None, type=click.Path(file_okay=False), help="Run directory [default: a new temp dir]."
)
@click.option("--timeout", "timeout_s", default=1200.0, show_default=True, help="Give up after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on the last line.")
@click.option(
    "--preset",
    default=str(PRESET),
    show_default=False,
    type=click.Path(exists=True, dir_okay=False),
    help="RunSpec TOML to run [default: protocol/presets/demo.toml].",
)
@click.option(
    "--validators",
    default=1,
    show_default=True,
    type=click.IntRange(1, 16),
    help="Validator processes; with several an aggregate counts once --quorum of them signed it.",
)
@click.option(
    "--quorum",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Signatures an aggregate needs (validator.quorum; 0: a majority of --validators).",
)
@click.option(
    "--faults",
    default="",
    help=f"Comma-separated faults to show with several validators: {', '.join(FAULTS)}.",
)
def demo(
    peers: int,
    windows: int,
    store: str,
    run_dir: str | None,
    timeout_s: float,
    as_json: bool,
    preset: str,
    validators: int,
    quorum: int,
    faults: str,
) -> None:
    """Run a validator and N peers as separate processes on this machine (the demo RunSpec preset:
    a small LLaMA-style model on the Python standard library's source, H = 30).

    The run is created with `sparseloco-validator init --corpus builtin:stdlib`: the validator
    tokenizes the corpus once into the run's store, and every peer starts with no data and
    fetches the shards its batches need. The peers start first and the validator once every peer
    has announced itself, so window 0 waits for all of them. Progress goes to stderr: one line per
    peer window and per published window.

    \b
    --json summary fields:
      store, peers, windows_completed, parameters, inner_steps, seconds, run_dir
      val_loss_per_window, accepted_per_window, rejected_per_window   (published windows)
      fingerprints_equal       every peer holds the validator's θ after every window
      contributions_accounted  every upload a peer reported has a row in the contribution log
      upload_bytes_per_peer_per_window, dense_fp32_bytes   (mean compressed vs dense size)
      data_bytes_per_peer_per_window  mean bytes of the dataset a peer fetched per trained window
      download_bytes_per_peer_per_window  mean bytes a peer fetched from the store per window
                               (aggregates, checkpoints, data, contributions it forecast from)
      wire_up_bytes_per_peer_per_window, wire_down_bytes_per_peer_per_window
                               mean bytes a peer's store sockets sent / received per window:
                               HTTP headers, grant requests, listings and retries included
                               (0 for a directory or the DHT, whose traffic is not counted)
      data_cache_hit_rate      of the shards the peers' windows read, the share already local
                               (cached or prefetched in time)
      compute_fraction         peers' inner-loop time (less the waits for the forecast) / their
                               processes' wall time (start-up included)
      compute_fraction_running the same over the time each peer ran (first event to last: without
                               the interpreter's start-up and exit)
      forecast_wait_s_per_window  mean wait for the others' contributions before a window's first
                               inner step (outer.forecast_wait)
      contribution_log         the validator's log (sparseloco-validator logs --db PATH)
      requests_per_peer_per_window  (s3) mean requests a peer's store sent to the bucket per
                               window, by kind: GET, HEAD, LIST, PUT (what the bucket bills)
      store_requests_per_window  (s3) requests the store answered per window, every peer and
                               the validator together (SeaweedFS's metrics; HEADs count as GET)
      grants_per_peer_per_window  (s3) presigned requests the grant servers gave a peer per
                               window, by op (a cached read grant serves many polls)

    With --validators N the run names N validator keys and an aggregate counts once --quorum of
    them co-signed it (a certificate); the leader of window t in view v is validator-<(t + v) mod
    N>. validator-0 publishes genesis and starts first, the others once it opened window 0. Over
    s3 each validator serves grants on its own port and the peers' grant_url lists them all,
    validator-0's first: a peer moves to the next when the one it uses does not answer. --faults liar: validator-1 (the leader of window 1) proposes a false Δ̄ and
    endorses everything; the honest ones object and the next leader takes over. --faults
    kill-leader: the leader of window 2 is killed with SIGKILL once it opened the window and
    restarted once another leader's aggregate of the window is certified (or once the others
    split their signatures, so that only its signature can complete a quorum). Summary fields added:

    \b
      validators, quorum, handover_s, faults, liar   (validator ids)
      leader_per_window, view_per_window, signers_per_window   (certified windows)
      handovers                windows certified in a view > 0
      liar_proposals_applied   certified windows the liar proposed (0: none applied)
      objections               per validator, the proposals it objected to
      killed_leader            window, validator, restarted_after (certified | split: the
                               others signed different digests, so it had to come back)

    Exit status: 0 done, 1 a process failed or the run timed out, 2 the run cannot start
    (configuration), 130 interrupted (every process is stopped).
    """
    install_signal_handlers()
    # Piped output (CI, `| tee`) gets wide lines instead of rich's 80-column wrapping.
    err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
    out = err if as_json else Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        summary = run_demo(
            peers=peers,
            windows=windows,
            store=store,
            run_dir=run_dir,
            timeout_s=timeout_s,
            on_event=_Progress(err),
            preset=preset,
            validators=validators,
            quorum=quorum,
            faults=[f.strip() for f in faults.split(",") if f.strip()],
        )
    except DemoError as exc:
        err.print(f"[red]demo failed:[/red] {exc}")
        sys.exit(EXIT_FAILED)
    except ConfigError as exc:
        err.print(f"[red]demo cannot start:[/red] {exc}")
        sys.exit(EXIT_CONFIG)
    except KeyboardInterrupt:
        err.print("interrupted: every process was stopped")
        sys.exit(EXIT_INTERRUPTED)
    table = summary_table(summary)
    title, caption = table.title, table.caption
    table.title = table.caption = None  # printed as whole lines: the narrow table would wrap them
    for part in (title, table, caption):
        out.print(part)
    out.print(f"contribution log: {summary['contribution_log']}  (sparseloco-validator logs --db …)")
    if as_json:
        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
        sys.stdout.flush()


class _Progress:
    """One short line per published window and per peer window (and trouble), on stderr."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.seen: set[tuple[object, ...]] = set()  # several validators: what was reported already

    def __call__(self, name: str, e: Event) -> None:
        if name.startswith(f"{VALIDATOR}-"):
            self._several(name, e)
        elif name == VALIDATOR:
            if isinstance(e, WindowPublished):
                self.console.print(
                    f"[bold]validator[/bold] window {e.window} published: val_loss {e.val_loss:.4f}"
                    f"  accepted {e.accepted}  rejected {e.rejected}  fingerprint {e.fingerprint[:12]}"
                )
            elif isinstance(e, (WindowRetry, Failed)):
                self.console.print(f"[bold]validator[/bold] [yellow]{describe(e)}[/yellow]")
            elif isinstance(e, WindowWaiting):
                self.console.print(f"[bold]validator[/bold] {describe(e)}")
        elif isinstance(e, PeerWindow):
            self.console.print(
                f"{name:>8} window {e.window} {e.outcome}"
                + (f" loss {e.loss:.4f}" if e.loss is not None else "")
                + (f" inner {e.inner_s:.1f}s" if e.inner_s else "")
                + (f" upload {e.upload_bytes / 1024:.1f} KiB" if e.upload_bytes else "")
                + (
                    f" wire ↑{e.wire_up_bytes / 1024:.1f} ↓{e.wire_down_bytes / 1024:.1f} KiB"
                    if e.wire_up_bytes or e.wire_down_bytes
                    else ""
                )
                + (f" ({e.reason})" if e.reason else "")
            )
        elif isinstance(e, Joined):
            self.console.print(f"{name:>8} joined as {e.peer_id[:12]} at window {e.window}")
        elif isinstance(e, (Resynced, SyncFailed, Failed)):
            self.console.print(f"{name:>8} [yellow]{e.kind}[/yellow] {e.reason}: {e.detail}")

    def _several(self, name: str, e: Event) -> None:
        """One of several validators: each certified window, objection and handover once (every
        validator reports what it saw of them all)."""
        if isinstance(e, WindowPublished) and ("certified", e.window) not in self.seen:
            self.seen.add(("certified", e.window))
            self.console.print(
                f"[bold]{name}[/bold] window {e.window} certified: leader {e.leader[:12]} view {e.view}"
                f"  signers {len(e.signers)}  val_loss {e.val_loss:.4f}  accepted {e.accepted}"
                f"  fingerprint {e.fingerprint[:12]}"
            )
        elif isinstance(e, AgreementStep) and e.step in ("objected", "handover"):
            key = (e.step, e.window, e.validator, e.digest)
            if key in self.seen:
                return
            self.seen.add(key)
            what = "objects to a proposal" if e.step == "objected" else "takes over"
            first = e.detail.splitlines()[0][:120] if e.detail else ""
            self.console.print(
                f"[bold]{name}[/bold] [yellow]window {e.window}: {e.validator[:12]} {what} (view {e.view})[/yellow]"
                + (f" {first}" if first else "")
            )
        elif isinstance(e, (WindowRetry, Failed)):
            self.console.print(f"[bold]{name}[/bold] [yellow]{describe(e)}[/yellow]")


def summary_table(s: dict[str, Any]) -> Table:
    t = Table(title=f"sparseloco demo — {s['peers']} peers, {s['store']} store, {s['seconds']:.0f} s")
    t.add_column("window", justify="right")
    t.add_column("val loss", justify="right")
    t.add_column("accepted", justify="right")
    t.add_column("rejected", justify="right")
    several = "leader_per_window" in s  # several validators: who led and signed each window
    if several:
        for column in ("leader", "view", "signers"):
            t.add_column(column, justify="right")
    for i, loss in enumerate(s["val_loss_per_window"]):
        row = [
            str(i),
            f"{loss:.4f}" if loss is not None else "–",
            str(s["accepted_per_window"][i]),
            str(s["rejected_per_window"][i]),
        ]
        if several:
            w = str(i)
            row += [
                s["leader_per_window"].get(w, "–")[:12],
                str(s["view_per_window"].get(w, "–")),
                str(len(s["signers_per_window"].get(w, []))),
            ]
        t.add_row(*row)
    ratio = s["dense_fp32_bytes"] / max(1, s["upload_bytes_per_peer_per_window"])
    t.caption = (
        f"fingerprints equal: {s['fingerprints_equal']} · contributions accounted: {s['contributions_accounted']} · "
        f"upload {s['upload_bytes_per_peer_per_window']:,} B/peer/window ({ratio:.0f}× below dense fp32) · "
        f"compute fraction {s['compute_fraction']:.2f} at H = {s['inner_steps']} · "
        f"data {s['data_bytes_per_peer_per_window']:,} B/peer/window, {s['data_cache_hit_rate']:.0%} cache hits · "
        f"download {s['download_bytes_per_peer_per_window']:,} B/peer/window"
        + (
            f" · wire ↑{s['wire_up_bytes_per_peer_per_window']:,} ↓{s['wire_down_bytes_per_peer_per_window']:,}"
            " B/peer/window"
            if s["wire_up_bytes_per_peer_per_window"] or s["wire_down_bytes_per_peer_per_window"]
            else ""
        )
    )
    if "requests_per_peer_per_window" in s:  # s3: what the bucket bills
        asked = ", ".join(f"{kind} {n:g}" for kind, n in s["requests_per_peer_per_window"].items())
        t.caption += f" · requests/peer/window: {asked}"
    if several:
        t.caption += (
            f" · {len(s['validators'])} validators, quorum {s['quorum']} · handovers {s['handovers']}"
            f" · liar's proposals applied {s['liar_proposals_applied']}"
        )
    return t
