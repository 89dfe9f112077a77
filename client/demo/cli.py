"""``sparseloco demo``: the whole system on this machine, with progress and a summary.

    sparseloco demo                          # validator + 3 peers, file store, 6 windows
    sparseloco demo --peers 4 --store s3     # SeaweedFS on 127.0.0.1, one credential per peer
    sparseloco demo --store dht --json       # hivemind DHT on 127.0.0.1; last line is JSON

Thin command: :func:`client.demo.swarm.run_demo` does the work; this module renders lines and tables.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from protocol.errors import ConfigError
from client.demo.backends import KINDS
from client.demo.swarm import PRESET, run_demo
from client.demo.processes import install_signal_handlers


@click.command("demo")
@click.option("--peers", default=3, show_default=True, type=click.IntRange(1, 64), help="Peer processes.")
@click.option("--windows", default=6, show_default=True, type=click.IntRange(1), help="Windows to run.")
@click.option("--store", default="file", show_default=True, type=click.Choice(KINDS), help="Object store.")
@click.option("--dir", "run_dir", default=None, type=click.Path(file_okay=False), help="Run directory [default: a new temp dir].")
@click.option("--timeout", "timeout_s", default=1200.0, show_default=True, help="Give up after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on the last line.")
@click.option("--preset", default=str(PRESET), show_default=False, type=click.Path(exists=True, dir_okay=False),
              help="RunSpec TOML to run [default: protocol/presets/demo.toml].")  # fmt: skip
def demo(peers: int, windows: int, store: str, run_dir: str | None, timeout_s: float, as_json: bool,
         preset: str) -> None:  # fmt: skip
    """Run a validator and N peers as separate processes on this machine (the demo RunSpec preset:
    a small LLaMA-style model on the Python standard library's source, H = 30)."""
    install_signal_handlers()
    # Piped output (CI, `| tee`) gets wide lines instead of rich's 80-column wrapping.
    err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
    out = err if as_json else Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        summary = run_demo(peers=peers, windows=windows, store=store, run_dir=run_dir, timeout_s=timeout_s,
                           on_line=_Progress(err), preset=preset)  # fmt: skip
    except ConfigError as exc:
        err.print(f"[red]demo failed:[/red] {exc}")
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("interrupted: every process was stopped")
        sys.exit(130)
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
    """One short line per published window and per peer window, on stderr."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, name: str, line: str) -> None:
        if name == "validator" and " published:" in line:
            self.console.print(f"[bold]validator[/bold] {line.strip()[:150]}")
            return
        if not line.startswith("{"):
            return
        try:
            e = json.loads(line)
        except ValueError:
            return
        if e.get("event") == "window":
            loss = e.get("loss")
            self.console.print(
                f"{name:>8} window {e.get('window')} {e.get('outcome')}"
                + (f" loss {loss:.4f}" if isinstance(loss, float) else "")
                + (f" inner {e['inner_s']:.1f}s" if e.get("inner_s") else "")
                + (f" upload {e['upload_bytes'] / 1024:.1f} KiB" if e.get("upload_bytes") else "")
                + (f" ({e['reason']})" if e.get("reason") else "")
            )
        elif e.get("event") == "joined":
            self.console.print(f"{name:>8} joined as {str(e.get('peer_id'))[:12]} at window {e.get('window')}")
        elif e.get("event") in ("resync", "sync_failed", "failed"):
            self.console.print(f"{name:>8} [yellow]{e.get('event')}[/yellow] {e.get('reason')}: {e.get('detail', '')}")


def summary_table(s: dict[str, Any]) -> Table:
    t = Table(title=f"sparseloco demo — {s['peers']} peers, {s['store']} store, {s['seconds']:.0f} s")
    t.add_column("window", justify="right")
    t.add_column("val loss", justify="right")
    t.add_column("accepted", justify="right")
    t.add_column("rejected", justify="right")
    for i, loss in enumerate(s["val_loss_per_window"]):
        t.add_row(str(i), f"{loss:.4f}" if loss is not None else "–", str(s["accepted_per_window"][i]),
                  str(s["rejected_per_window"][i]))  # fmt: skip
    ratio = s["dense_fp32_bytes"] / max(1, s["upload_bytes_per_peer_per_window"])
    t.caption = (
        f"fingerprints equal: {s['fingerprints_equal']} · contributions accounted: {s['contributions_accounted']} · "
        f"upload {s['upload_bytes_per_peer_per_window']:,} B/peer/window ({ratio:.0f}× below dense fp32) · "
        f"compute fraction {s['compute_fraction']:.2f} at H = {s['inner_steps']}"
    )
    return t
