"""The bill (validator/bill.py): a run's day in the bucket at list prices, against numbers worked by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from protocol.errors import ConfigError
from validator.bill import R2, S3_STANDARD, Prices, Usage, project_day, stored_bytes

# 10 peers, hourly windows (24 a day), retention of 8 windows, a checkpoint every 4.
USAGE = Usage(
    params=1000,
    peers=10,
    window_minutes=60.0,
    requests_per_peer_per_window={"GET": 100, "HEAD": 10, "LIST": 5, "PUT": 1, "other": 3},
    bytes_down_per_peer_per_window=1e9,
    contribution_bytes=1e6,
    aggregate_bytes=2e6,
    validator_requests_per_window={"LIST": 2, "GET": 10},
    validator_bytes_down_per_window=1e7,
    dataset_bytes=3e9,
    checkpoint_every=4,
    retain_windows=8,
)


def test_requests_a_day_are_every_peers_and_the_validators() -> None:
    r2 = project_day(USAGE)["breakdown"]["r2"]
    # GET 100·10·24 + 10·24, HEAD 10·10·24, LIST 5·10·24 + 2·24, PUT 1·10·24, other 3·10·24
    assert r2["requests_per_day"] == {"GET": 24240, "HEAD": 2400, "LIST": 1248, "PUT": 240, "other": 720}
    assert r2["class_a_requests_per_day"] == 1248 + 240  # deletes and the like ("other") are free
    assert r2["class_b_requests_per_day"] == 24240 + 2400


def test_a_day_on_r2_and_on_s3_worked_by_hand() -> None:
    day = project_day(USAGE)
    r2, s3 = day["breakdown"]["r2"]["usd"], day["breakdown"]["s3"]["usd"]
    assert r2["class_a"] == pytest.approx(1488 * 4.50e-6)  # 0.006696
    assert r2["class_b"] == pytest.approx(26640 * 0.36e-6)  # 0.0095904
    assert s3["class_a"] == pytest.approx(1488 * 0.005e-3)  # 0.00744
    assert s3["class_b"] == pytest.approx(26640 * 0.0004e-3)  # 0.010656
    # held: dataset 3e9 + 8 windows of 10 contributions (8e7) + 12 aggregates (2.4e7) + 3 checkpoints of 4 kB
    assert stored_bytes(USAGE) == 3_104_012_000
    assert r2["storage"] == pytest.approx(3.104012 * 0.015 / 30)
    assert s3["storage"] == pytest.approx(3.104012 * 0.023 / 30)
    # egress: (10 peers · 1 GB + the validator's 10 MB) · 24 windows, free on R2
    assert day["breakdown"]["s3"]["egress_gb_per_day"] == pytest.approx(240.24)
    assert r2["egress"] == 0 and s3["egress"] == pytest.approx(240.24 * 0.09)
    assert day["r2"] == pytest.approx(0.006696 + 0.0095904 + 0.00155201, abs=1e-6)
    assert day["s3"] == pytest.approx(0.00744 + 0.010656 + 0.00237974 + 21.6216, abs=1e-6)
    assert day["windows_per_day"] == 24


def test_without_retention_the_bucket_grows_and_a_later_day_costs_more() -> None:
    keep_all = dataclasses.replace(USAGE, retain_windows=0, day=2)
    # 1.5 days on average over day 2: 36 windows of 10 contributions + an aggregate + a quarter checkpoint
    assert stored_bytes(keep_all) == pytest.approx(3e9 + 36 * (10 * 1e6 + 2e6 + 4000 / 4))
    first = project_day(dataclasses.replace(keep_all, day=1))["breakdown"]["s3"]["usd"]["storage"]
    second = project_day(keep_all)["breakdown"]["s3"]["usd"]["storage"]
    assert second > first


def test_the_validator_reads_every_contribution_unless_told() -> None:
    default = dataclasses.replace(USAGE, validator_bytes_down_per_window=None)
    # (10 · 1e9 + 10 · 1e6) · 24
    assert project_day(default)["breakdown"]["s3"]["egress_gb_per_day"] == pytest.approx(240.24)
    assert project_day(dataclasses.replace(USAGE, validator_bytes_down_per_window=0))["breakdown"]["s3"][
        "egress_gb_per_day"
    ] == pytest.approx(240.0)


def test_prices_are_inputs() -> None:
    free_reads = Prices("free", class_a=1.0, class_b=0.0, storage_gb_month=0.0, egress_gb=0.0)
    day = project_day(USAGE, {"free": free_reads})
    assert day["free"] == 1488.0 and set(day["breakdown"]) == {"free"}
    assert R2.class_a == 4.5e-6 and S3_STANDARD.class_a == 5e-6 and S3_STANDARD.egress_gb == 0.09


@pytest.mark.parametrize(
    "change",
    [
        {"peers": 0},
        {"window_minutes": 0.0},
        {"day": 0},
        {"requests_per_peer_per_window": {"GET": -1}},
        {"requests_per_peer_per_window": {"GET": math.nan}},
        {"bytes_down_per_peer_per_window": math.inf},
        {"retain_windows": -1},
    ],
)
def test_nonsense_usage_is_a_config_error(change: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(USAGE, **change)  # type: ignore[arg-type]
