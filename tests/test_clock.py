"""This machine's clock against the store's ``Date`` header: the measurement, the bound from the
RunSpec's window timing, preflight's ``clock`` check, join's refusal and the peer's skip reason.

The store is a small HTTP server on 127.0.0.1 that answers every request with a chosen ``Date``
(or none), so a clock 120 s ahead or behind is simulated without touching this machine's clock.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from client.cli import EXIT_CANNOT_JOIN, main
from client.clock import Offset, bound_s, check_clock, measure, sources
from client.peer.loop import CLOSED_HINT_AFTER, Peer
from client.preflight import Preflight
from protocol.config import WindowConfig
from protocol.identity import Identity
from protocol.settings import LocalSettings, StoreSettings
from protocol.store.memory import MemoryStore
from tests.test_peer_state import tiny_spec


class DateServer:
    """An HTTP server whose answers carry ``Date`` = now + ``skew_s`` (none when ``skew_s`` is None)."""

    def __init__(self) -> None:
        self.skew_s: float | None = 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self.send_response(403)  # what an S3 endpoint answers an anonymous request
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD

            def send_header(self, keyword: str, value: str) -> None:
                if keyword == "Date":
                    if server.skew_s is None:
                        return
                    value = formatdate(time.time() + server.skew_s, usegmt=True)
                super().send_header(keyword, value)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[DateServer]:
    srv = DateServer()
    yield srv
    srv.close()


VALIDATOR = Identity.from_seed(bytes(range(32)))
SPEC = tiny_spec(VALIDATOR, upload_deadline_s=60.0, gather_grace_s=5.0)  # bound: min(6, 5) = 5 s


def s3_store(url: str) -> StoreSettings:
    return StoreSettings(url="s3://bucket/run", s3_endpoint=url)


# ---------------------------------------------------------------------- the measurement


@pytest.mark.parametrize("skew_s", [0.0, 120.0, -120.0])
def test_the_offset_is_the_store_dates_distance_within_its_uncertainty(server: DateServer, skew_s: float) -> None:
    server.skew_s = skew_s
    offset = measure(server.url)
    assert offset is not None and offset.source == server.url
    assert 1.0 <= offset.uncertainty_s < 2.0  # Date's second, and a loopback round trip
    # the store is skew_s ahead, so this machine is -skew_s ahead of it
    assert abs(offset.offset_s - -skew_s) <= offset.uncertainty_s


def test_an_answer_without_date_or_no_answer_measures_nothing(server: DateServer) -> None:
    server.skew_s = None
    assert measure(server.url) is None
    server.close()
    assert measure(server.url, timeout_s=1.0) is None


def test_the_bound_is_a_tenth_of_the_deadline_or_the_grace_whichever_is_less() -> None:
    assert bound_s(WindowConfig(upload_deadline_s=600.0, gather_grace_s=5.0)) == 5.0
    assert bound_s(WindowConfig(upload_deadline_s=20.0, gather_grace_s=5.0)) == 2.0


def test_the_sources_are_the_store_endpoint_then_each_grant_server() -> None:
    assert sources(StoreSettings(url="file:///tmp/x")) == []
    assert sources(StoreSettings(url="memory://x")) == []
    assert sources(StoreSettings(url="s3://b/p")) == ["https://s3.amazonaws.com"]
    assert sources(StoreSettings(url="s3://b/p", s3_region="eu-west-1")) == ["https://s3.eu-west-1.amazonaws.com"]
    store = StoreSettings(url="s3://b/p?endpoint=http://h:8333", grant_url="http://g1:1, http://g2:2")
    assert sources(store) == ["http://h:8333", "http://g1:1", "http://g2:2"]


# ---------------------------------------------------------------------- the verdict


def test_a_clock_in_step_passes(server: DateServer) -> None:
    verdict = check_clock(SPEC, s3_store(server.url))
    assert (verdict.status, verdict.reason) == ("ok", "ok")
    assert verdict.bound_s == 5.0 and "the run allows 5.0 s" in verdict.detail


@pytest.mark.parametrize("skew_s, side", [(-120.0, "ahead of"), (120.0, "behind")])
def test_a_clock_120_s_off_fails_with_the_offset_and_the_fix(server: DateServer, skew_s: float, side: str) -> None:
    server.skew_s = skew_s
    verdict = check_clock(SPEC, s3_store(server.url))
    assert (verdict.status, verdict.reason) == ("failed", "clock_offset")
    assert re.search(f"this machine's clock is 1(19|20|21) s {side} the store's", verdict.detail)
    assert "enable NTP (timedatectl set-ntp true) and check again" in verdict.detail


def test_an_offset_beyond_the_bound_only_within_its_uncertainty_warns() -> None:
    near = Offset("http://s", 5.5, 1.2)  # 4.3 .. 6.7 s against 5 s
    inside = Offset("http://s", 4.5, 1.2)  # 3.3 .. 5.7 s: the best estimate is within
    assert check_clock(SPEC, s3_store("http://s"), measure=lambda url: inside).status == "ok"
    verdict = check_clock(SPEC, s3_store("http://s"), measure=lambda url: near)
    assert (verdict.status, verdict.reason) == ("warning", "clock_marginal")
    far = Offset("http://s", 6.3, 1.2)
    assert check_clock(SPEC, s3_store("http://s"), measure=lambda url: far).status == "failed"


def test_the_grant_server_answers_when_the_store_does_not(server: DateServer) -> None:
    server.skew_s = 120.0
    store = StoreSettings(url="s3://b/p", s3_endpoint="http://127.0.0.1:1", grant_url=server.url)
    verdict = check_clock(SPEC, store, measure=lambda url: measure(url, timeout_s=1.0))
    assert verdict.status == "failed" and verdict.offset is not None and verdict.offset.source == server.url
    assert "this machine's clock is 1" in verdict.detail
    assert f"behind the grant server's ({server.url})" in verdict.detail and "store's" not in verdict.detail


def test_a_store_without_http_or_without_date_is_skipped_with_the_reason(server: DateServer) -> None:
    verdict = check_clock(SPEC, StoreSettings(url="file:///tmp/store"))
    assert (verdict.status, verdict.reason) == ("skipped", "no_http") and verdict.figures() == {}
    server.skew_s = None
    verdict = check_clock(SPEC, s3_store(server.url))
    assert (verdict.status, verdict.reason) == ("skipped", "no_date") and server.url in verdict.detail


# ---------------------------------------------------------------------- preflight, join, the peer


def preflight_clock(store: StoreSettings) -> dict[str, object]:
    checks = Preflight(SPEC, LocalSettings(store=store), Identity.from_seed(b"p" * 32), MemoryStore("c"), device="cpu")
    return checks._clock().to_json()


def test_preflights_clock_check_reports_its_figures(server: DateServer) -> None:
    server.skew_s = -120.0
    check = preflight_clock(s3_store(server.url))
    assert check["name"] == "clock" and check["status"] == "failed" and check["reason"] == "clock_offset"
    assert check["bound_s"] == 5.0 and check["source"] == server.url
    assert isinstance(check["offset_s"], float) and abs(check["offset_s"] - 120.0) <= check["uncertainty_s"]
    server.skew_s = 0.0
    assert preflight_clock(s3_store(server.url))["status"] == "ok"
    assert preflight_clock(StoreSettings(url="file:///tmp/x"))["reason"] == "no_http"


def test_join_refuses_a_clock_beyond_the_bound(server: DateServer, tmp_path: Path, caplog) -> None:
    server.skew_s = -120.0
    run = tmp_path / "run.toml"
    run.write_text(SPEC.replace(data={"dataset": "0" * 64}).to_toml())
    store = f"s3://bucket/run?endpoint={server.url}"
    with caplog.at_level(logging.ERROR, logger="sparseloco.peer"):
        result = CliRunner().invoke(main, ["join", "--run", str(run), "--store", store, "--state", str(tmp_path / "s")])
    assert result.exit_code == EXIT_CANNOT_JOIN
    message = caplog.text + result.output
    assert re.search("cannot join: this machine's clock is 1(19|20|21) s ahead of the store's", message)
    assert "timedatectl set-ntp true" in message
    assert not (tmp_path / "s" / "key.pem").exists()  # refused before anything else


def skip_reason(offset: Offset | None, closed: int) -> str:
    peer = Peer.__new__(Peer)  # only the reason's state: no store, no trainer
    peer.clock_offset, peer._closed_in_a_row = offset, closed
    return peer._closed_reason()


def test_a_window_closed_before_training_says_the_offset_or_hints_at_the_clock() -> None:
    plain = "window closed before training started"
    assert skip_reason(None, 1) == plain
    assert skip_reason(None, CLOSED_HINT_AFTER - 1) == plain
    hinted = skip_reason(None, CLOSED_HINT_AFTER)
    assert hinted.startswith(plain) and f"{CLOSED_HINT_AFTER} windows in a row" in hinted and "clock" in hinted
    measured = skip_reason(Offset("http://s3", 120.4, 1.1), 1)
    assert measured == f"{plain} (this machine's clock is 120 s ahead of the store's (http://s3), ± 1.1 s)"
