"""``sparseloco-validator logs --plot PATH``: the dashboard's charts as one PNG, drawn with matplotlib.

Three panels, from the same bounded reads as the dashboard (:mod:`validator.dashboard.views`):
validation loss per window, accepted and rejected contributions per window (stacked), and rejections
by reason. matplotlib is an optional dependency (``pip install 'sparseloco[plot]'``); it is imported
here only, when a plot is asked for.

    with LogView.open(db) as log:
        write_plots(log, "log.png", windows=(100, None))
"""

from __future__ import annotations

from pathlib import Path

from protocol.errors import ConfigError
from validator.dashboard import views
from validator.logview import LogView

__all__ = ["PLOT_POINTS", "write_plots"]

PLOT_POINTS = 2000  # at most this many points (buckets of windows) per panel
GREEN, RED, BLUE = "#2e7d32", "#c62828", "#1f5fbf"


def write_plots(log: LogView, path: str | Path, *, windows: tuple[int | None, int | None] = (None, None)) -> None:
    """Write the three charts of the windows in ``windows`` (inclusive, either end open) to ``path``
    as a PNG. Raises ConfigError when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("logs --plot needs matplotlib: pip install 'sparseloco[plot]'") from exc

    series = views.series(log, windows=windows, points=PLOT_POINTS)
    reasons = log.rejection_reasons(windows=windows)
    fig = Figure(figsize=(10, 11), dpi=100, layout="constrained")
    loss_ax, outcome_ax, reason_ax = fig.subplots(3, 1)
    per = "" if series.per_bucket <= 1 else f" ({series.per_bucket} windows per point)"

    pts = [(b.first + (b.last - b.first) / 2, b.val_loss) for b in series.buckets if b.val_loss is not None]
    loss_ax.set_title(f"validation loss per window{per}")
    loss_ax.set_xlabel("window")
    loss_ax.set_ylabel("nats/token")
    if pts:
        loss_ax.plot([x for x, _ in pts], [y for _, y in pts], color=BLUE, marker="o" if len(pts) <= 150 else None)
    else:
        loss_ax.text(0.5, 0.5, "no validation loss recorded yet", ha="center", transform=loss_ax.transAxes)

    starts = [b.first for b in series.buckets]
    widths = [(b.last - b.first + 1) * 0.85 for b in series.buckets]
    accepted = [b.accepted for b in series.buckets]
    outcome_ax.set_title(f"contributions per window: accepted and rejected{per}")
    outcome_ax.set_xlabel("window")
    outcome_ax.bar(starts, accepted, width=widths, align="edge", color=GREEN, label="accepted")
    rejected = [b.rejected for b in series.buckets]
    outcome_ax.bar(starts, rejected, width=widths, align="edge", bottom=accepted, color=RED, label="rejected")
    outcome_ax.legend(loc="upper right")

    reason_ax.set_title("rejections by reason")
    if reasons:
        names = [r.reason for r in reversed(reasons)]  # most frequent on top
        reason_ax.barh(names, [r.rejections for r in reversed(reasons)], color=RED)
        reason_ax.set_xlabel("rejections")
    else:
        reason_ax.text(0.5, 0.5, "no rejection recorded", ha="center", transform=reason_ax.transAxes)
    fig.savefig(Path(path), format="png")
