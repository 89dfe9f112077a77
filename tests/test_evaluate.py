"""Evaluation: ``protocol.evaluation`` (loss, perplexity, bits per byte), ``sparseloco eval`` (held-out
data, lm-eval zero-shot tasks when available) and the validator's periodic evaluation, which must
agree with ``sparseloco eval`` on the same θ."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_fixtures import make_run, tiny_model, trained_like
from click.testing import CliRunner
from validator_fixtures import Swarm, tiny_spec

from client import zero_shot
from client.checkpoints import load_checkpoint, locate, model_of
from client.evaluate import heldout_data
from client.tools import main
from protocol.config import RunSpec
from protocol.data.assignment import open_dataset, validation_batches
from protocol.data.tokenizer import ByteTokenizer
from protocol.evaluation import LMScore, score_lm, text_bytes
from protocol.events import Event, ModelEvaluated
from protocol.identity import Identity
from protocol.model import Transformer, eval_loss
from protocol.settings import LocalSettings
from validator.cli import cli as validator_cli
from validator.log import LOG_FILE
from validator.logview import LogView
from validator.node import Validator


def test_score_is_the_validators_loss_and_bits_per_byte_follow_from_it() -> None:
    spec = RunSpec.from_dict({"model": tiny_model(), "data": {"seq_len": 32, "batch_size": 4}})
    model = Transformer(spec.model)
    model.load_state_dict(trained_like(spec, scale=0.05))
    batches = validation_batches(open_dataset(spec.data), 10, 4, 32)
    score = score_lm(model, batches, ByteTokenizer())
    assert score.loss == pytest.approx(eval_loss(model, batches), rel=1e-6)
    assert score.sequences == 10 and score.tokens == 10 * 32 == score.bytes  # one byte per byte token
    assert score.bits_per_byte == pytest.approx(score.loss / math.log(2))
    assert score.perplexity == pytest.approx(math.exp(score.loss))
    assert LMScore(loss=1e4, tokens=1, bytes=1, sequences=1).perplexity == math.inf


def test_text_bytes_counts_decoded_utf8_for_other_tokenizers() -> None:
    class Words:  # any tokenizer that is not the byte one is decoded
        def decode(self, ids: list[int]) -> str:
            return "é" * len(ids)

    assert text_bytes(Words(), [1, 2, 3]) == 6  # type: ignore[arg-type]
    assert text_bytes(ByteTokenizer(), [195, 169]) == 2


def test_heldout_data_is_the_validation_split_or_all_of_any_text(tmp_path: Path) -> None:
    spec = RunSpec.from_dict({"model": tiny_model(), "data": {"seq_len": 32, "batch_size": 4}})
    held = heldout_data(spec, None, sequences=6)
    expected = validation_batches(open_dataset(spec.data), 6, 4, 32)
    assert held.description == "builtin:stdlib (validation split)"
    assert all(torch.equal(a, b) for a, b in zip(held.batches, expected))
    text = tmp_path / "notes.txt"
    text.write_text("hello world\n" * 100)
    held = heldout_data(spec, str(text), sequences=1000)
    assert held.description.endswith("(all text)") and held.available_tokens == 1201  # 1200 bytes + separator
    assert sum(b.shape[0] for b in held.batches) == 1201 // 33
    assert bytes(held.batches[0][0, :12].tolist()) == b"hello world\n"


def test_zero_shot_is_skipped_with_a_reason_without_lm_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zero_shot, "lm_eval_available", lambda: False)
    results = zero_shot.run_tasks("unused", ["arc_easy"])
    assert results == [zero_shot.TaskResult("arc_easy", skipped=zero_shot.NOT_INSTALLED)]


def test_zero_shot_runs_offline_through_lm_evals_python_api(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def simple_evaluate(**kwargs: Any) -> dict[str, Any]:
        import os

        calls.append({**kwargs, "offline": os.environ.get("HF_DATASETS_OFFLINE")})
        if kwargs["tasks"] == ["missing"]:
            raise FileNotFoundError("dataset not in the cache")
        return {"results": {kwargs["tasks"][0]: {"alias": "x", "acc,none": 0.3, "acc_stderr,none": 0.01}}}

    monkeypatch.setitem(sys.modules, "lm_eval", types.SimpleNamespace(simple_evaluate=simple_evaluate))
    monkeypatch.setattr(zero_shot, "lm_eval_available", lambda: True)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    ok, missing = zero_shot.run_tasks("/models/x", ["arc_easy", "missing"], device="cpu", limit=5)
    assert ok == zero_shot.TaskResult("arc_easy", metrics={"acc": 0.3})
    assert missing.metrics is None and missing.skipped is not None and "not available locally" in missing.skipped
    assert calls[0]["model"] == "hf" and calls[0]["model_args"]["pretrained"] == "/models/x"
    assert calls[0]["num_fewshot"] == 0 and calls[0]["limit"] == 5 and calls[0]["offline"] == "1"
    assert "HF_DATASETS_OFFLINE" not in __import__("os").environ  # restored


def test_cli_eval_json_and_table(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(0, 4))
    runner = CliRunner()
    res = runner.invoke(main, ["eval", "--run", str(run.run_toml), "--sequences", "8", "--tasks", "", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["checkpoint"]["window"] == 4 and report["sequences"] == 8 and report["tasks"] == []
    ckpt = load_checkpoint(run.spec, locate(run.spec, None, window=4, settings=run.settings))
    batches = validation_batches(open_dataset(run.spec.data), 8, 4, 32)
    assert report["loss"] == pytest.approx(eval_loss(model_of(run.spec, ckpt), batches), rel=1e-6)
    assert report["bits_per_byte"] == pytest.approx(report["loss"] / math.log(2))
    res = runner.invoke(main, ["eval", "--run", str(run.run_toml), "--window", "0", "--sequences", "8"])
    assert res.exit_code == 0, res.output
    assert "bits per byte" in res.stdout and "checkpoint 0" in res.stdout
    if not zero_shot.lm_eval_available():  # default tasks nobody asked for are not listed
        assert "skipped" not in res.stdout
        asked = runner.invoke(main, ["eval", "--run", str(run.run_toml), "--sequences", "8", "--tasks", "arc_easy"])
        assert asked.exit_code == 0, asked.output
        assert "skipped: lm_eval is not installed" in asked.stdout  # one asked for is, with why


# ------------------------------------------------------------------ the validator's periodic evaluation
def test_validator_evaluates_every_n_windows_as_sparseloco_eval_does(tmp_path: Path) -> None:
    vkey = Identity.generate()
    spec = tiny_spec(vkey, windows={"upload_deadline_s": 0.1})
    local = LocalSettings.from_dict(
        {"poll_interval_s": 0.02, "max_windows": 2, "validator": {"eval_every": 1, "eval_sequences": 12}}
    )
    swarm = Swarm(spec, 2)
    events: list[Event] = []
    try:
        swarm.announce_all()
        v = Validator(spec, swarm.handle(), vkey, tmp_path / "v", local=local, emit=events.append)
        v.resume()
        params = v._state().params
        for p in swarm.peers:  # window 0 moves θ
            swarm.upload(p.peer_id, 0, swarm.honest(p, params, 0, v._state().base))
        v.run()
        v.close()
        with LogView.open(tmp_path / "v" / LOG_FILE) as log:
            evals = log.evaluations()
            first, final = log.window(0), log.window(1)
        assert first is not None and first.accepted == 2  # window 0 moved θ
        assert [e.window for e in evals] == [0, 1] and all(e.sequences == 12 for e in evals)
        assert final is not None and evals[1].fingerprint == final.fingerprint
        assert [e.window for e in events if isinstance(e, ModelEvaluated)] == [0, 1]
        # the run's final θ is checkpointed (window 2 = max_windows); `sparseloco eval` agrees
        run_toml = tmp_path / "run.toml"
        run_toml.write_text(spec.to_toml())
        res = CliRunner().invoke(
            main,
            [
                "eval",
                "--run",
                str(run_toml),
                "--store",
                f"memory://{swarm.name}",
                "--sequences",
                "12",
                "--tasks",
                "",
                "--json",
            ],
        )
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout)
        assert report["checkpoint"]["window"] == 2 and report["checkpoint"]["fingerprint"] == final.fingerprint
        assert report["loss"] == pytest.approx(evals[1].loss, rel=1e-6)
        assert report["bits_per_byte"] == pytest.approx(evals[1].bits_per_byte, rel=1e-6)
    finally:
        swarm.close()

    runner = CliRunner()
    db = str(tmp_path / "v" / LOG_FILE)
    out = runner.invoke(validator_cli, ["logs", "--db", db, "--evals", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["window"] for r in rows] == [0, 1] and {"loss", "perplexity", "bits_per_byte"} <= set(rows[0])
    out = runner.invoke(validator_cli, ["logs", "--db", db, "--summary"])
    assert out.exit_code == 0 and "evaluations of θ" in out.output and "leaderboard" in out.output
    out = runner.invoke(validator_cli, ["logs", "--db", db, "--summary", "--json"])
    assert {r["peer"] for r in json.loads(out.output)} == {p.peer_id for p in swarm.peers}


def test_validator_run_takes_the_periodic_evaluation_as_local_options() -> None:
    out = CliRunner().invoke(validator_cli, ["run", "--help"])
    assert out.exit_code == 0 and "--eval-every" in out.output and "--eval-sequences" in out.output
