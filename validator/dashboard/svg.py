"""The dashboard's charts as inline SVG, drawn on the server: no script runs and nothing is fetched.

Each chart is one ``<svg>`` element with a ``class`` naming it (``chart-loss``, ``chart-outcomes``,
``chart-reasons``); each data point is an element with a class of its own (``loss-point``,
``bar-accepted``/``bar-rejected``, ``bar-reason``), ``data-first``/``data-last`` windows where it
stands for windows, and a ``<title>`` the browser shows on hover. Every text is escaped: reasons
come from the log, and what a log holds is not trusted.

    loss_chart(series.buckets)        # validation loss per window (or per bucket of windows)
    outcome_chart(series.buckets)     # accepted and rejected contributions per window, stacked
    reasons_chart(reasons)            # rejections per reason, most frequent first
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from validator.logview import ReasonCount, WindowBucket

__all__ = ["loss_chart", "nice_ticks", "outcome_chart", "reasons_chart"]

WIDTH, HEIGHT = 760, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40  # margins around the plot area (axis labels live there)
BLUE, GREEN, RED, GREY, INK = "#1f5fbf", "#2e7d32", "#c62828", "#d0d4da", "#333"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values (1, 2 or 5 × 10^k apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    n = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [round(first + i * step, 12) for i in range(n)]


@dataclass(frozen=True)
class _Plot:
    """The plot area of a WIDTH × HEIGHT chart and the data ranges it maps."""

    x0: float
    x1: float
    y0: float
    y1: float

    def x(self, v: float) -> float:
        span = self.x1 - self.x0 or 1.0
        return LEFT + (v - self.x0) / span * (WIDTH - LEFT - RIGHT)

    def y(self, v: float) -> float:
        span = self.y1 - self.y0 or 1.0
        return HEIGHT - BOTTOM - (v - self.y0) / span * (HEIGHT - TOP - BOTTOM)


def loss_chart(buckets: Sequence[WindowBucket]) -> str:
    """Validation loss (nats/token) per window: a line and one ``loss-point`` per bucket that has a
    loss (windows without one, such as windows adopted after a lost log, leave no point)."""
    pts = [(b, b.val_loss) for b in buckets if b.val_loss is not None and math.isfinite(b.val_loss)]
    if not pts:
        return _empty("chart-loss", "no validation loss recorded yet")
    losses = [v for _, v in pts]
    lo, hi = min(losses), max(losses)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.05, 0.01)
    plot = _Plot(buckets[0].first, buckets[-1].last + 1, lo - pad, hi + pad)
    xy = [(plot.x((b.first + b.last + 1) / 2), plot.y(v)) for b, v in pts]
    parts = [_open("chart-loss", "validation loss (nats/token) per window"), *_axes(plot)]
    parts.append(
        f'<polyline fill="none" stroke="{BLUE}" stroke-width="1.5" points="'
        + " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        + '"/>'
    )
    radius = 3 if len(pts) <= 150 else 1.5
    for (b, v), (x, y) in zip(pts, xy):
        parts.append(
            f'<circle class="loss-point" {_windows_attrs(b)} cx="{x:.1f}" cy="{y:.1f}" r="{radius}" fill="{BLUE}">'
            f"<title>{escape(_windows_label(b))}: val loss {v:.4f}</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


def outcome_chart(buckets: Sequence[WindowBucket]) -> str:
    """Accepted (green, below) and rejected (red, above) contributions per window, stacked."""
    if not buckets:
        return _empty("chart-outcomes", "no window decided yet")
    top = max(b.accepted + b.rejected for b in buckets) or 1
    plot = _Plot(buckets[0].first, buckets[-1].last + 1, 0.0, top * 1.05)
    parts = [_open("chart-outcomes", "contributions per window: accepted and rejected"), *_axes(plot)]
    for b in buckets:
        x0, x1 = plot.x(b.first), plot.x(b.last + 1)
        gap = min(2.0, (x1 - x0) * 0.15)
        w = max(0.5, x1 - x0 - gap)
        label = escape(
            f"{_windows_label(b)}: {b.accepted} accepted, {b.rejected} rejected, {b.unannounced} unannounced"
        )
        for cls, count, colour, below in (
            ("bar-accepted", b.accepted, GREEN, 0),
            ("bar-rejected", b.rejected, RED, b.accepted),
        ):
            if count <= 0:
                continue
            y_top, y_bottom = plot.y(below + count), plot.y(below)
            parts.append(
                f'<rect class="{cls}" {_windows_attrs(b)} x="{x0 + gap / 2:.1f}" y="{y_top:.1f}" '
                f'width="{w:.1f}" height="{max(0.5, y_bottom - y_top):.1f}" fill="{colour}">'
                f"<title>{label}</title></rect>"
            )
    parts.append(_legend(((GREEN, "accepted"), (RED, "rejected"))))
    parts.append("</svg>")
    return "".join(parts)


def reasons_chart(reasons: Sequence[ReasonCount]) -> str:
    """Rejections per reason, one horizontal ``bar-reason`` each, most frequent first."""
    if not reasons:
        return _empty("chart-reasons", "no rejection recorded")
    row, label_w = 22, 180
    height = TOP + row * len(reasons) + 8
    most = max(r.rejections for r in reasons) or 1
    bar_max = WIDTH - label_w - 80
    parts = [
        f'<svg class="chart chart-reasons" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="rejections by reason">',
        f'<text x="8" y="16" font-size="13" fill="{INK}">rejections by reason</text>',
    ]
    for i, r in enumerate(reasons):
        y = TOP + i * row
        w = max(1.0, r.rejections / most * bar_max)
        name = escape(r.reason or "(none)")
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 14}" font-size="12" text-anchor="end" fill="{INK}">{name}</text>'
            f'<rect class="bar-reason" data-reason="{name}" x="{label_w}" y="{y + 3}" width="{w:.1f}" '
            f'height="{row - 8}" fill="{RED}"><title>{name}: {r.rejections} rejections of {r.peers} peer(s), '
            f"last in window {r.last_window}</title></rect>"
            f'<text x="{label_w + w + 6:.1f}" y="{y + 14}" font-size="12" fill="{INK}">{r.rejections}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _open(cls: str, title: str) -> str:
    return (
        f'<svg class="chart {cls}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">'
        f'<text x="8" y="16" font-size="13" fill="{INK}">{escape(title)}</text>'
    )


def _axes(plot: _Plot) -> list[str]:
    """Grid lines and labelled ticks: windows along x (whole numbers), values along y."""
    out = []
    y_ticks = nice_ticks(plot.y0, plot.y1, 4)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    digits = max(0, -math.floor(math.log10(y_step))) if y_step > 0 else 0
    for v in y_ticks:
        y = plot.y(v)
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GREY}" stroke-width="0.5"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" fill="{INK}">{v:.{digits}f}</text>'
        )
    x_ticks = [t for t in nice_ticks(plot.x0, plot.x1 - 1, 8) if float(t).is_integer()]
    for t in x_ticks:
        x = plot.x(t + 0.5)
        out.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" font-size="11" text-anchor="middle" fill="{INK}">{int(t)}</text>'
        )
    out.append(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}" stroke="{INK}"/>'
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 6}" font-size="11" text-anchor="middle" '
        f'fill="{INK}">window</text>'
    )
    return out


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    x = WIDTH - RIGHT - 90 * len(entries)
    out = []
    for i, (colour, text) in enumerate(entries):
        out.append(
            f'<rect x="{x + i * 90}" y="6" width="10" height="10" fill="{colour}"/>'
            f'<text x="{x + i * 90 + 14}" y="15" font-size="11" fill="{INK}">{escape(text)}</text>'
        )
    return "".join(out)


def _empty(cls: str, text: str) -> str:
    return (
        f'<svg class="chart {cls}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="60" '
        f'viewBox="0 0 {WIDTH} 60" role="img"><text x="8" y="34" font-size="13" fill="{INK}">{escape(text)}</text></svg>'
    )


def _windows_attrs(b: WindowBucket) -> str:
    return f'data-first="{b.first}" data-last="{b.last}"'


def _windows_label(b: WindowBucket) -> str:
    return f"window {b.first}" if b.first == b.last else f"windows {b.first}–{b.last} ({b.windows})"
