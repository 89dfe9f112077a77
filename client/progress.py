"""What a peer shows while it runs: a live status panel for people, JSON lines for programs.

The peer loop reports through two calls and never formats anything itself::

    with PeerDisplay(json_lines=False) as show:
        show.update(window=3, step=12, steps=30, loss=2.71, tokens_per_s=4100.0)
        show.emit(PeerWindow(window=3, outcome="uploaded", upload_bytes=48213, ...))

``update`` refreshes the panel (window, inner step, loss, tokens/s, upload size/time, last score).
``emit`` records something that happened, as a typed :mod:`protocol.events` record: in JSON mode
(``--status-json``, what ``sparseloco demo`` reads) it prints exactly one JSON object per line on
stdout (:func:`protocol.events.to_json`) and nothing else goes to stdout; in human mode it prints
the local time and :func:`protocol.events.describe` above the panel.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from protocol.events import Event, describe, to_json


class PeerDisplay:
    """Live rich panel on stderr, or JSON lines on stdout (see the module docstring)."""

    def __init__(self, *, json_lines: bool = False, console: Console | None = None) -> None:
        self.json_lines = json_lines
        self.console = console or Console(stderr=True)
        self.fields: dict[str, Any] = {}
        self._live: Live | None = None

    def __enter__(self) -> PeerDisplay:
        if not self.json_lines and self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(typ, exc, tb)
            self._live = None

    # ------------------------------------------------------------------ API
    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the panel (cheap: the live display redraws at most 4 times a second)."""
        self.fields.update(fields)
        if self._live is not None:
            self._live.update(self._render(), refresh=False)

    def emit(self, event: Event) -> None:
        """Record one event: a JSON line (``{"event": kind, "time": ..., **fields}``) or a log line."""
        if self.json_lines:
            sys.stdout.write(to_json(event) + "\n")
            sys.stdout.flush()
            return
        if self._live is not None:
            self._live.update(self._render(), refresh=False)
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        self.console.print(f"[dim]{stamp}[/dim] {describe(event)}")

    # ------------------------------------------------------------------ rendering
    def _render(self) -> Table:
        f = self.fields
        table = Table(title=f"sparseloco peer {str(f.get('peer_id', ''))[:12]}", show_header=False, expand=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        step = f"{f.get('step', 0)}/{f.get('steps', '?')}"
        table.add_row("window", f"{f.get('window', '-')}  ({f.get('phase', 'starting')})")
        table.add_row("inner step", step)
        table.add_row("loss", _num(f.get("loss"), "{:.4f}"))
        table.add_row("tokens/s", _num(f.get("tokens_per_s"), "{:,.0f}"))
        table.add_row("upload", _upload(f))
        table.add_row("last score", _num(f.get("score"), "{:+.4f}"))
        table.add_row("fingerprint", str(f.get("fingerprint", "-"))[:16])
        return table


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _upload(f: dict[str, Any]) -> str:
    if f.get("upload_bytes") is None:
        return "-"
    return f"{f['upload_bytes'] / 1024:.1f} KiB in {f.get('upload_s', 0.0):.2f} s"
