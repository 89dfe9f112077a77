"""`sparseloco-validator dashboard` end to end in headless Chromium: the command serves a log
written by the real ContributionLog, Chromium renders it (--dump-dom, --screenshot), and what it
rendered is checked against the log.

Skipped only when no Chromium binary is on PATH (`apt-get install chromium`; `.ci/run` installs it).
With SPARSELOCO_DASHBOARD_SCREENSHOT=docs/dashboard.png the screenshot is also written there (the
one README.md shows)."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest
from dashboard_log import EVIL, Built, build_log
from PIL import Image

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SIZE = (1280, 1600)
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM = next((found for name in BROWSERS if (found := shutil.which(name))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium; .ci/run installs it)"
)
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Elements(HTMLParser):
    """Every element of a serialized DOM as (tag, attributes, text inside it)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, dict[str, str], list[str]]] = []
        self.open: list[int] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}, []))
        if tag not in VOID:
            self.open.append(len(self.found) - 1)

    def handle_endtag(self, tag: str) -> None:
        while self.open:
            if self.found[self.open.pop()][0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for i in self.open:
            self.found[i][2].append(data)

    def with_class(self, cls: str) -> list[tuple[str, dict[str, str], str]]:
        return [(t, a, "".join(x)) for t, a, x in self.found if cls in a.get("class", "").split()]


def parse(dom: str) -> _Elements:
    p = _Elements()
    p.feed(dom)
    p.close()
    return p


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Callable[[bool], tuple[str, Built]]]:
    """Start the dashboard command on a free port, serving a fresh log (with or without the peer
    whose id is markup); gives its URL and what the log holds. Stopped after the test."""
    procs: list[subprocess.Popen[str]] = []

    def start(markup_peer: bool) -> tuple[str, Built]:
        built = build_log(tmp_path / "contributions.sqlite", markup_peer=markup_peer)
        cmd = [sys.executable, "-m", "validator.cli", "dashboard", "--db", str(built.path), "--port", "0"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # it prints its URL once it listens
        found = re.search(r"dashboard at (http://\S+)", line)
        assert found, f"the dashboard did not start: {line!r}"
        return found.group(1), built

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=60)


def chromium(tmp_path: Path, *args: str) -> str:
    """Run headless Chromium with its own profile; its stdout."""
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={SIZE[0]},{SIZE[1]}",
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@needs_chromium
def test_chromium_renders_the_log(serve: Callable[[bool], tuple[str, Built]], tmp_path: Path) -> None:
    url, built = serve(True)
    dom = parse(chromium(tmp_path, "--dump-dom", url))

    # the loss chart: an SVG with one point per window, in window order, with the log's losses
    charts = [a.get("class", "") for t, a, _ in dom.found if t == "svg"]
    assert any("chart-loss" in c for c in charts) and any("chart-outcomes" in c for c in charts)
    points = dom.with_class("loss-point")
    assert [(t, int(a["data-first"])) for t, a, _ in points] == [("circle", w) for w in range(built.windows)]
    assert [float(text.rsplit(" ", 1)[1]) for _, _, text in points] == built.val_loss
    assert len(dom.with_class("bar-accepted")) == built.windows

    # the leaderboard: every peer of the log with its windows and accepted counts
    peers = [a["data-peer"] for _, a, _ in dom.with_class("peer-row")]
    windows = [int(text) for _, _, text in dom.with_class("windows")]
    accepted = [int(text) for _, _, text in dom.with_class("accepted")]
    assert dict(zip(peers, zip(windows, accepted))) == built.counts and len(peers) == len(built.counts)

    # rejections by reason, in the table and the chart
    names = [text for _, _, text in dom.with_class("reason")]
    counts = [int(text) for _, _, text in dom.with_class("rejections")]
    assert dict(zip(names, counts)) == built.reasons and len(names) == len(built.reasons)
    assert {a["data-reason"] for _, a, _ in dom.with_class("bar-reason")} == set(built.reasons)

    # the open window and what was read in it; nothing the log holds became markup
    assert ["".join(text) for _, a, text in dom.found if a.get("id") == "open-window"] == [str(built.open_window)]
    assert not [t for t, _, _ in dom.found if t == "script"] and EVIL in peers


@needs_chromium
def test_chromium_peer_page_shows_markup_as_text(serve: Callable[[bool], tuple[str, Built]], tmp_path: Path) -> None:
    url, _ = serve(True)
    dom = parse(chromium(tmp_path, "--dump-dom", url + "peer/" + quote(EVIL, safe="")))
    history = dom.with_class("history-row")
    assert len(history) == 4 and all(EVIL in text for _, _, text in history)
    assert not [t for t, _, _ in dom.found if t == "script"]


@needs_chromium
def test_chromium_screenshot_is_the_page(serve: Callable[[bool], tuple[str, Built]], tmp_path: Path) -> None:
    url, _ = serve(False)  # the page README.md shows
    shot = tmp_path / "dashboard.png"
    chromium(tmp_path, f"--screenshot={shot}", url)
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    assert struct.unpack(">II", head[16:24]) == SIZE
    with Image.open(shot) as img:
        pixels = img.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 22) or []
    background = max(colours)[1]
    inked = sum(n for n, c in colours if c != background)
    assert len(colours) >= 16 and inked >= 0.05 * SIZE[0] * SIZE[1]  # text, charts and tables, not a blank page
    assert any(r > 150 and g < 90 and b < 90 for _, (r, g, b) in colours)  # the red of rejected bars
    assert any(g > 100 and r < 80 and b < 80 for _, (r, g, b) in colours)  # the green of accepted bars
    target = os.environ.get("SPARSELOCO_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copyfile(shot, ROOT / target)
