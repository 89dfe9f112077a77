"""Naming and listing a run's checkpoints (``client.checkpoints``, ``sparseloco checkpoints``), and
the ``sparseloco`` command staying free of torch until a command runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_fixtures import PUBLISHED_AT, VALIDATOR, make_run
from click.testing import CliRunner

from client.checkpoints import Location, list_checkpoints, locate
from client.tools import main
from protocol import layout
from protocol.errors import ConfigError
from protocol.store import open_store


def test_locate_reads_the_store_and_window_out_of_a_checkpoint_location(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(4,))
    spec, w4 = run.spec, layout.window_str(4)
    assert locate(spec, None, settings=run.settings) == Location(run.store_url, None)
    assert locate(spec, None, store_url="s3://b/p", window="7") == Location("s3://b/p", 7)
    assert locate(spec, str(run.checkpoint_dir(4))) == Location(run.store_url, 4)
    assert locate(spec, str(run.checkpoint_dir(4) / "manifest"), window="4") == Location(run.store_url, 4)
    assert locate(spec, str(run.store_dir), window="latest") == Location(run.store_url, None)
    url = f"s3://bucket/pre/fix/{run.run_id}/checkpoint/{w4}/manifest?endpoint=http://127.0.0.1:8333"
    assert locate(spec, url) == Location("s3://bucket/pre/fix?endpoint=http://127.0.0.1:8333", 4)


@pytest.mark.parametrize(
    ("checkpoint", "options", "message"),
    [
        ("{dir}", {"window": "5"}, "window 4, --window says 5"),
        ("{dir}", {"store_url": "file:///x"}, "not both"),
        ("s3://b/0123456789abcdef/checkpoint/00000004", {}, "belongs to run 0123456789abcdef"),
        ("{tmp}/nowhere", {}, "no such file"),
        (None, {"window": "four"}, "number or 'latest'"),
    ],
)
def test_locate_refuses_contradictions(tmp_path: Path, checkpoint: str | None, options: dict, message: str) -> None:
    run = make_run(tmp_path, windows=(4,))
    if checkpoint is not None:
        checkpoint = checkpoint.format(dir=run.checkpoint_dir(4), tmp=tmp_path)
    with pytest.raises(ConfigError, match=message):
        locate(run.spec, checkpoint, **options)


def test_list_checkpoints_verifies_each_manifest(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(0, 4, 8))
    (run.checkpoint_dir(8) / "manifest").write_bytes(b"not a manifest")
    with open_store(run.store_url) as store:
        infos = list_checkpoints(run.spec, store)
    assert [i.window for i in infos] == [0, 4, 8]
    good = infos[1]
    assert good.signed_by == VALIDATOR.public_key_hex and good.signer_peer_id == VALIDATOR.peer_id
    assert good.published_at == PUBLISHED_AT + 4 and good.size is not None and good.size > 0
    assert good.error is None and infos[2].error is not None and infos[2].fingerprint is None


def test_cli_checkpoints_json_and_table(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(0, 4))
    runner = CliRunner()
    res = runner.invoke(main, ["checkpoints", "--run", str(run.run_toml), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["window"] for r in rows] == [0, 4]
    fields = {"window", "size", "signed_by", "signer_peer_id", "fingerprint", "published_at", "aggregate", "error"}
    assert set(rows[0]) == fields
    res = runner.invoke(main, ["checkpoints", "--run", str(run.run_toml), "--store", f"file://{tmp_path / 'empty'}"])
    assert res.exit_code == 0 and "(0)" in res.stdout
    res = runner.invoke(main, ["checkpoints", "--run", str(run.run_toml)])
    assert res.exit_code == 0 and VALIDATOR.public_key_hex[:16] in res.stdout


def test_sparseloco_help_imports_neither_torch_nor_transformers() -> None:
    code = "import sys, client.tools; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
