"""What a peer shows while it runs: a live status panel for people, JSON lines for programs.

The peer loop reports through two calls and never formats anything itself::

    with PeerDisplay(json_lines=False) as show:
        show.update(window=3, step=12, steps=30, loss=2.71, tokens_per_s=4100.0)
        show.emit(PeerWindow(window=3, outcome="uploaded", upload_bytes=48213, ...))

``update`` refreshes the panel (window, inner step, loss, tokens/s, upload size/time, the bytes the
store's sockets sent and received in the last reported window, and the
validator's verdict on the last contribution: accepted or rejected, score, reputation, from the
window's published outcomes).
``emit`` records something that happened, as a typed :mod:`protocol.events` record: in JSON mode
(``--status-json``, what ``sparseloco demo`` reads) it prints exactly one JSON object per line on
stdout (:func:`protocol.events.to_json`) and nothing else goes to stdout; in human mode it prints
the local date and time and :func:`protocol.events.describe` above the panel; with
``log_format="json"`` (``--log-format json``) it prints :mod:`protocol.logformat` JSON lines on
stderr instead, and no panel. Every event also goes to the ``sinks`` (the metrics endpoint).

``watch`` follows one large download (a checkpoint a late joiner reads, a large aggregate; what
:mod:`protocol.store.fetch` reads in ranges)::

    progress = show.watch("checkpoint 120")    # a protocol.store.fetch.Progress
    progress(done, total)                      # after every range

On the live panel its row reads ``checkpoint 120 1.2/3.4 GB, 12 MB/s, ETA 3m02s``; without one
(not a terminal, ``--status-json``, ``--log-format json``) a ``downloading`` event says the same
at most every :data:`DOWNLOAD_EVERY_S` seconds. The end is a ``downloaded`` event (bytes, seconds)
everywhere.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from protocol.events import Applied, Downloaded, Downloading, Event, describe, download_line, to_json
from protocol.logformat import JsonLogLines
from protocol.store.fetch import Progress

#: Without a live panel, a download in progress is reported at most this often.
DOWNLOAD_EVERY_S = 10.0


class PeerDisplay:
    """Live rich panel on stderr, or JSON lines on stdout (see the module docstring)."""

    def __init__(
        self,
        *,
        json_lines: bool = False,
        console: Console | None = None,
        log_format: str = "human",
        sinks: Sequence[Callable[[Event], None]] = (),
    ) -> None:
        self.json_lines = json_lines
        self.console = console or Console(stderr=True, soft_wrap=True)  # a log file gets whole lines
        self.fields: dict[str, Any] = {}
        self.sinks = list(sinks)
        self._json_log = JsonLogLines(sys.stderr, role="peer") if log_format == "json" else None
        self._live: Live | None = None

    def __enter__(self) -> PeerDisplay:
        if not self.json_lines and self._json_log is None and self.console.is_terminal:
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

    def watch(self, what: str) -> Progress:
        """The progress callback of one download named ``what`` (module docstring). Creating it
        costs nothing: a small object read in one request never calls it."""
        return DownloadMeter(what, self)

    @property
    def live(self) -> bool:
        """Whether a live panel is showing (a terminal, human output)."""
        return self._live is not None

    def emit(self, event: Event) -> None:
        """Record one event: a JSON line (``{"event": kind, "time": ..., **fields}``) or a log line."""
        for sink in self.sinks:
            sink(event)
        if isinstance(event, Applied) and event.accepted is not None:
            self.fields.update(accepted=event.accepted, reason=event.reason, score=event.score)
            self.fields.update(reputation=event.reputation)
        if self.json_lines:
            sys.stdout.write(to_json(event) + "\n")
            sys.stdout.flush()
            return
        if self._json_log is not None:
            self._json_log(event)
            return
        if self._live is not None:
            self._live.update(self._render(), refresh=False)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.time))
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
        table.add_row("wire", _wire(f))
        if f.get("download"):
            table.add_row("download", str(f["download"]))
        table.add_row("last verdict", _verdict(f))
        table.add_row("score / rep", f"{_num(f.get('score'), '{:+.4g}')} / {_num(f.get('reputation'), '{:.3f}')}")
        table.add_row("fingerprint", str(f.get("fingerprint", "-"))[:16])
        return table


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _verdict(f: dict[str, Any]) -> str:
    """The validator's decision on the last contribution (protocol.outcomes)."""
    if f.get("accepted") is None:
        return "-"
    return "accepted" if f["accepted"] else f"rejected ({f.get('reason')})"


def _upload(f: dict[str, Any]) -> str:
    if f.get("upload_bytes") is None:
        return "-"
    return f"{f['upload_bytes'] / 1024:.1f} KiB in {f.get('upload_s', 0.0):.2f} s"


def _wire(f: dict[str, Any]) -> str:
    """What the store's sockets moved in the last reported window (headers, grants, retries too)."""
    if f.get("wire_up_bytes") is None:
        return "-"
    return f"↑ {f['wire_up_bytes'] / 1024:.1f} KiB  ↓ {f.get('wire_down_bytes', 0) / 1024:.1f} KiB"


class DownloadMeter:
    """One download's progress shown on a :class:`PeerDisplay`: speed since it began and the time
    left at that speed; on the panel at every call, as a ``downloading`` event at most every
    ``every_s`` without one, a ``downloaded`` event at the end."""

    def __init__(
        self,
        what: str,
        display: PeerDisplay,
        *,
        every_s: float = DOWNLOAD_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.display, self.every_s, self.clock = what, display, every_s, clock
        self.started = clock()
        self._next_line = self.started + every_s
        self._finished = False

    def __call__(self, done: int, total: int) -> None:
        if self._finished:
            return
        now = self.clock()
        seconds = max(now - self.started, 1e-9)
        rate = done / seconds
        eta = (total - done) / rate if rate > 0 else None
        if done >= total:
            self._finished = True
            self.display.update(download=None)
            self.display.emit(Downloaded(what=self.what, size_bytes=total, seconds=round(seconds, 3), bytes_per_s=rate))
        elif self.display.live:
            self.display.update(download=download_line(self.what, done, total, rate, eta))
        elif now >= self._next_line:
            self._next_line = now + self.every_s
            self.display.emit(
                Downloading(what=self.what, done_bytes=done, total_bytes=total, bytes_per_s=rate, eta_s=eta)
            )
