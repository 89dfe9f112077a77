"""The bill: what a run costs its operator per day in the bucket, at list prices.

A bucket bills requests, storage and egress. Requests come in two classes: class A (PUT, LIST,
and a multipart upload's POSTs) and class B (GET, HEAD); R2 calls them that, S3 Standard bills the
same two groups at its own prices. Every peer of a run polls, reads and writes the one bucket each
window, so the requests of one peer, times the peers, times the windows of a day, are most of the
bill of a large swarm; the rest is what the bucket holds (the retention policy,
:mod:`validator.retention`) and, on S3, every byte read out of it::

    usage = Usage(params=10**9, peers=256, window_minutes=20.0,
                  requests_per_peer_per_window={"GET": 40, "HEAD": 2, "LIST": 6, "PUT": 1},
                  bytes_down_per_peer_per_window=5.2e9, contribution_bytes=2.0e7, aggregate_bytes=2.0e7)
    day = project_day(usage)        # {"r2": usd, "s3": usd, "breakdown": {"r2": {...}, "s3": {...}}}

Prices are inputs (:class:`Prices`; :data:`R2` and :data:`S3_STANDARD` are the list prices), so a
discount or another provider is one more value. What the bucket holds is :func:`stored_bytes`: the
dataset, the contributions and aggregates of the windows kept, and the fp32 checkpoints written
every ``checkpoint_every`` windows (the RunSpec's, 5 by default). The validator keeps everything
unless ``validator.retain_windows`` says otherwise (0 by default): the store then grows all day,
and a day is billed for what it holds on average. A GB is 10⁹ bytes, a month 30 days.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.config import WindowConfig
from protocol.errors import ConfigError
from protocol.settings import ValidatorSettings

__all__ = [
    "CLASS_A",
    "CLASS_B",
    "R2",
    "S3_STANDARD",
    "Prices",
    "Usage",
    "project_day",
    "stored_bytes",
]

CLASS_A = ("PUT", "LIST")  # and a multipart upload's POSTs, which the store counts as PUT
CLASS_B = ("GET", "HEAD")
GB = 1e9
DAYS_PER_MONTH = 30.0
MINUTES_PER_DAY = 24 * 60.0


@dataclass(frozen=True)
class Prices:
    """List prices in USD: per request of each class, per GB-month stored, per GB read out."""

    name: str
    class_a: float  # per request: PUT, LIST (POST)
    class_b: float  # per request: GET, HEAD
    storage_gb_month: float
    egress_gb: float


R2 = Prices("r2", class_a=4.50 / 1e6, class_b=0.36 / 1e6, storage_gb_month=0.015, egress_gb=0.0)
S3_STANDARD = Prices("s3", class_a=0.005 / 1e3, class_b=0.0004 / 1e3, storage_gb_month=0.023, egress_gb=0.09)


@dataclass(frozen=True)
class Usage:
    """What a run does to its bucket. Requests by kind (``GET``, ``HEAD``, ``LIST``, ``PUT``;
    ``other``, deletes among them, is free) per peer and window as measured; the validator's own
    per window too (``validator_requests_per_window``). Bytes read out: each peer's per window
    and the validator's (``None``: one contribution of every peer). ``retain_windows`` and
    ``checkpoint_every``: the validator's retention (0: keeps everything) and the RunSpec's
    checkpoint period; ``day``: which day of the run is billed (storage grows while nothing is
    deleted)."""

    params: int
    peers: int
    window_minutes: float
    requests_per_peer_per_window: Mapping[str, float]
    bytes_down_per_peer_per_window: float
    contribution_bytes: float
    aggregate_bytes: float
    validator_requests_per_window: Mapping[str, float] = field(default_factory=dict)
    validator_bytes_down_per_window: float | None = None
    dataset_bytes: float = 0.0
    checkpoint_every: int = WindowConfig().checkpoint_every
    retain_windows: int = ValidatorSettings().retain_windows
    day: int = 1

    def __post_init__(self) -> None:
        if self.params <= 0 or self.peers <= 0 or self.window_minutes <= 0 or self.day < 1:
            raise ConfigError("a bill needs params > 0, peers > 0, window_minutes > 0 and day >= 1")
        counts = [*self.requests_per_peer_per_window.values(), *self.validator_requests_per_window.values()]
        sizes = [self.bytes_down_per_peer_per_window, self.contribution_bytes, self.aggregate_bytes, self.dataset_bytes]
        if any(not math.isfinite(x) or x < 0 for x in [*counts, *sizes]):
            raise ConfigError("request counts and byte sizes must be finite and >= 0")
        if self.checkpoint_every < 0 or self.retain_windows < 0:
            raise ConfigError("checkpoint_every and retain_windows must be >= 0")

    @property
    def windows_per_day(self) -> float:
        return MINUTES_PER_DAY / self.window_minutes

    @property
    def checkpoint_bytes(self) -> float:
        """One checkpoint: θ in fp32."""
        return 4.0 * self.params


def stored_bytes(usage: Usage) -> float:
    """The bytes the bucket holds on average over the billed day.

    With retention (``retain_windows = K``): the contributions of the last K windows, the
    aggregates from the anchor on (at most K + ``checkpoint_every`` windows) and the checkpoints
    from the anchor on (⌈K / checkpoint_every⌉ + 1), plus the dataset. Without: everything written
    since the run began, on average over day ``day``: (day − ½) days of windows."""
    u = usage
    per_window = u.peers * u.contribution_bytes + u.aggregate_bytes
    checkpoint_rate = 1.0 / u.checkpoint_every if u.checkpoint_every > 0 else 0.0
    if u.retain_windows > 0:
        aggregates = u.retain_windows + u.checkpoint_every
        checkpoints = math.ceil(u.retain_windows * checkpoint_rate) + 1 if checkpoint_rate else 0
        held = u.retain_windows * u.peers * u.contribution_bytes + aggregates * u.aggregate_bytes
        return u.dataset_bytes + held + checkpoints * u.checkpoint_bytes
    windows = (u.day - 0.5) * u.windows_per_day
    return u.dataset_bytes + windows * (per_window + checkpoint_rate * u.checkpoint_bytes)


def _requests_per_day(usage: Usage) -> dict[str, float]:
    """Requests a day by kind: every peer's and the validator's."""
    out: dict[str, float] = {}
    for kind, n in usage.requests_per_peer_per_window.items():
        out[kind] = out.get(kind, 0.0) + n * usage.peers * usage.windows_per_day
    for kind, n in usage.validator_requests_per_window.items():
        out[kind] = out.get(kind, 0.0) + n * usage.windows_per_day
    return out


def _bill(usage: Usage, prices: Prices) -> dict[str, Any]:
    requests = _requests_per_day(usage)
    class_a = sum(n for kind, n in requests.items() if kind in CLASS_A)
    class_b = sum(n for kind, n in requests.items() if kind in CLASS_B)
    validator_down = (
        usage.peers * usage.contribution_bytes
        if usage.validator_bytes_down_per_window is None
        else usage.validator_bytes_down_per_window
    )
    egress = (usage.peers * usage.bytes_down_per_peer_per_window + validator_down) * usage.windows_per_day
    stored = stored_bytes(usage)
    usd = {
        "class_a": class_a * prices.class_a,
        "class_b": class_b * prices.class_b,
        "storage": stored / GB * prices.storage_gb_month / DAYS_PER_MONTH,
        "egress": egress / GB * prices.egress_gb,
    }
    return {
        "requests_per_day": {k: round(v, 1) for k, v in sorted(requests.items())},
        "class_a_requests_per_day": round(class_a, 1),
        "class_b_requests_per_day": round(class_b, 1),
        "stored_gb": round(stored / GB, 3),
        "egress_gb_per_day": round(egress / GB, 3),
        "usd": usd,
        "total_usd": sum(usd.values()),
    }


def project_day(usage: Usage, prices: Mapping[str, Prices] | None = None) -> dict[str, Any]:
    """USD per day for ``usage`` at each of ``prices`` (by name; default R2 and S3 Standard):
    ``{name: total, …, "breakdown": {name: {requests, stored, egress, usd by item}}, "usage": …}``."""
    table = prices if prices is not None else {"r2": R2, "s3": S3_STANDARD}
    breakdown = {name: _bill(usage, p) for name, p in table.items()}
    return {
        **{name: b["total_usd"] for name, b in breakdown.items()},
        "breakdown": breakdown,
        "windows_per_day": round(usage.windows_per_day, 3),
    }
