"""scripts/gpu_check.sh --dry-run: every step of the GPU check on the CPU with the tiny model, so
that the script the GPU runs cannot rot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("micro_batch", "scoring", "train_window", "codec")
PLAN_ARGS = (
    "preset",
    "seq_len",
    "batch_size",
    "steps",
    "score_sequences",
    "score_seq_len",
    "score_rows",
    "score_repeats",
    "codec_tensors",
    "codec_cpu_seconds",
    "budget",
)


@pytest.fixture(scope="module")
def dry_run() -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1])


def test_the_dry_run_passes_every_section(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out["ok"] is True and out["failed"] == [] and out["dry_run"] is True
    assert out["device"] == "cpu" and out["preset"] == "tiny" and out["params"] > 0
    for name in SECTIONS:
        section = out["sections"][name]
        assert section["ok"] is True and section["error"] is None, (name, section)
        assert section["seconds"] >= 0
        assert name in proc.stdout  # the table before the JSON line
    assert "train_window: step 1/" in proc.stderr  # progress on stderr


def test_the_figures(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    s = dry_run[1]["sections"]
    mb = s["micro_batch"]
    assert mb["auto_micro_batch"] == 0 and mb["sequences_per_pass"] == 2  # on a CPU: the whole batch
    assert mb["activation_bytes_per_sequence"] > 0 and mb["footprint_suggestion"] == 0
    sc = s["scoring"]
    assert sc["tokens_per_s"] > 0 and sc["sequences"] == 2 and sc["seq_len"] == 64 and sc["repeats"] >= 1
    tr = s["train_window"]
    assert tr["inner_steps"] == 2 and tr["tokens"] == 2 * 2 * 64
    assert tr["tokens_per_s"] > 0 and tr["tokens_per_s_after_first_step"] > 0
    assert tr["fold_s"] > 0 and tr["payload_bytes"] > 0
    assert tr["peak_device_copies"] > 0 and tr["peak_copies_train"] >= tr["peer_state_copies"]
    # θ, the working model, e and the two AdamW moments, as scripts/bench_peer.py counts them.
    assert tr["peer_state_copies"] == pytest.approx(5.0, abs=0.25) and tr["steady_matches_claim"] is True
    co = s["codec"]
    assert co["bytes_identical"] is True and co["feedback_identical"] is True and co["bytes_differ"] == []
    assert co["tensors_compared"] == co["tensors_total"] > 0 and co["compared"] == "all"
    assert co["params_compared"] == co["params_total"] > 0
    assert co["encode_mparams_per_s"] > 0 and co["compress_step_s"] > 0 and co["payload_bytes"] > 0
    assert 0 < co["payload_bits_per_param"] < 1


def _module():
    """scripts/gpu_check.py imported (once: its dataclasses need it in sys.modules)."""
    name = "scripts_gpu_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gpu_check.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_a_failing_section_is_recorded_and_the_next_ones_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gc = _module()

    def broken(plan, ctx, clock):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(gc, "section_micro_batch", broken)
    monkeypatch.setattr(gc, "section_scoring", lambda plan, ctx, clock: {"error": "bytes differ"})
    monkeypatch.setattr(gc, "section_train", lambda plan, ctx, clock: {"tokens_per_s": 1.0})
    monkeypatch.setattr(gc, "section_codec", lambda plan, ctx, clock: {"bytes_identical": True})
    assert gc.main(["--dry-run"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] is False and out["failed"] == ["micro_batch", "scoring"]
    assert out["sections"]["micro_batch"]["error"] == "RuntimeError: out of memory, say"
    assert out["sections"]["scoring"]["error"] == "bytes differ"
    assert out["sections"]["train_window"] == {"tokens_per_s": 1.0, "ok": True, "error": None, "seconds": 0.0}


def test_a_section_past_its_budget_is_stopped() -> None:
    gc = _module()
    plan = gc.make_plan(gc.argparse.Namespace(**{k: None for k in PLAN_ARGS}, dry_run=True, device=None))

    def forever(clock):
        while True:
            time.sleep(0.05)

    t0 = time.monotonic()
    out = gc.run_section("slow", 2.5, forever, plan)
    assert time.monotonic() - t0 < 10
    assert out["ok"] is False and out["error"].startswith("SectionTimeout")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_every_section_fails_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    gc = _module()
    assert gc.main([]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"] == "cuda:0" and out["preset"] == "1b" and out["failed"] == list(SECTIONS)
    assert all("CUDA is not available" in s["error"] for s in out["sections"].values())
