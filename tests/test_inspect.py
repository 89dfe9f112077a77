"""`sparseloco inspect`: the library function, the click command and the real console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from wire_samples import PEER, RUN, VALIDATOR, blobs

from client.inspect import inspect_file, inspect_paths
from client.tools import main
from protocol.wire.frame import Kind


@pytest.fixture()
def objects(tmp_path: Path) -> dict[str, Path]:
    files = {}
    for kind, blob in blobs().items():
        p = tmp_path / "ok" / kind.label
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(blob)
        files[kind.label] = p
    tampered = bytearray(blobs()[Kind.CONTRIBUTION])
    tampered[120] ^= 0x04
    files["tampered"] = tmp_path / "bad" / "tampered"
    files["tampered"].parent.mkdir()
    files["tampered"].write_bytes(bytes(tampered))
    files["truncated"] = tmp_path / "bad" / "truncated"
    files["truncated"].write_bytes(blobs()[Kind.AGGREGATE][:-10])
    files["text"] = tmp_path / "bad" / "notes.txt"
    files["text"].write_text("hello\nworld\n")
    return files


def test_ok_lines_describe_each_kind(objects) -> None:
    kinds = ("contribution", "aggregate", "checkpoint", "announcement", "dataset")
    lines = {k: inspect_file(objects[k]).line for k in kinds}
    assert lines["contribution"].startswith(f"OK contribution window=7 sender={PEER.peer_id} bytes=")
    assert "tensors=3 nnz=" in lines["contribution"]
    assert lines["aggregate"].startswith(f"OK aggregate window=7 sender={VALIDATOR.peer_id}")
    assert "manifest=2" in lines["aggregate"]
    assert "files=2" in lines["checkpoint"]
    assert 'hardware="cpu x2" role=g1:1/3' in lines["announcement"]
    assert lines["dataset"].startswith(f"OK dataset window=0 sender={VALIDATOR.peer_id}")
    assert "tokenizer=bytes shards=3 block_tokens=1024 train_tokens=20537 val_tokens=4321 dataset=" in lines["dataset"]
    size = objects["aggregate"].stat().st_size
    assert f"bytes={size} " in lines["aggregate"]


def test_invalid_lines_give_path_reason_and_message(objects) -> None:
    r = inspect_file(objects["tampered"])
    assert not r.ok and r.reason == "bad_signature"
    assert r.line == f"INVALID {objects['tampered']} bad_signature: signature does not verify"
    assert inspect_file(objects["truncated"]).reason == "malformed"
    assert inspect_file(objects["text"]).reason == "unsupported_version"
    assert inspect_file(objects["text"].parent / "missing").reason == "unreadable"
    assert inspect_file(objects["aggregate"], max_bytes=100).reason == "too_large"


def test_optional_run_and_signer_checks(objects) -> None:
    assert inspect_file(objects["aggregate"], run_hash=RUN, allowed_signers=[VALIDATOR.public_key]).ok
    assert inspect_file(objects["contribution"], run_hash="0" * 64).reason == "wrong_run"
    assert inspect_file(objects["aggregate"], allowed_signers=[PEER.public_key]).reason == "unknown_signer"


def test_directories_expand_to_their_files_in_order(objects) -> None:
    results = list(inspect_paths([objects["aggregate"].parent]))
    names = ["aggregate", "announcement", "checkpoint", "contribution", "dataset"]
    assert [Path(r.path).name for r in results] == sorted(names)
    assert all(r.ok for r in results)


def test_click_command_exit_codes(objects) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["inspect", str(objects["aggregate"]), str(objects["checkpoint"])])
    assert ok.exit_code == 0 and ok.stdout.count("\nOK ") + ok.stdout.startswith("OK ") == 2
    bad = runner.invoke(main, ["inspect", str(objects["aggregate"]), str(objects["tampered"])])
    assert bad.exit_code == 2
    assert bad.stdout.splitlines()[1].startswith("INVALID ")
    checked = runner.invoke(
        main, ["inspect", "--run-hash", RUN, "--validator-key", VALIDATOR.public_key_hex, str(objects["aggregate"])]
    )
    assert checked.exit_code == 0, checked.output
    assert runner.invoke(main, ["inspect", "--run-hash", "nothex", str(objects["aggregate"])]).exit_code == 2
    assert runner.invoke(main, ["inspect", "--validator-key", "zz", str(objects["aggregate"])]).exit_code == 2


def _script() -> str:
    found = shutil.which("sparseloco", path=os.path.dirname(sys.executable)) or shutil.which("sparseloco")
    if found is None:
        pytest.skip("the sparseloco console script is not installed (pip install -e .)")
    return found


def test_real_console_script_never_prints_a_traceback(objects, tmp_path) -> None:
    script = _script()
    good = [str(objects[k]) for k in ("contribution", "aggregate", "checkpoint", "announcement")]
    proc = subprocess.run([script, "inspect", *good], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [
        ["OK", "contribution"],
        ["OK", "aggregate"],
        ["OK", "checkpoint"],
        ["OK", "announcement"],
    ]
    weird = tmp_path / "dir-with-nothing"
    weird.mkdir()
    everything = [*good, str(objects["tampered"]), str(objects["text"]), str(tmp_path / "nope"), str(weird)]
    proc = subprocess.run([script, "inspect", *everything], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(everything)
    assert [line.split()[0] for line in lines] == ["OK"] * 4 + ["INVALID"] * 4


def test_checkpoint_weights_are_checked_against_their_manifest(tmp_path: Path) -> None:
    """Weights are safetensors, not envelopes: inspecting a checkpoint folder verifies them by the
    manifest's size and sha256 instead of calling them invalid objects."""
    import hashlib

    from wire_samples import RUN_ID

    from protocol.layout import checkpoint_key
    from protocol.wire import CheckpointFile, CheckpointManifest, encode_checkpoint

    weights = b"not an envelope, but the bytes the manifest signed"
    entry = CheckpointFile(
        checkpoint_key(RUN_ID, 4, "model.safetensors"), hashlib.sha256(weights).hexdigest(), len(weights)
    )
    manifest = CheckpointManifest(RUN, 4, "genesis", "ab" * 32, (entry,), 1.0, launch="cd" * 32)
    folder = tmp_path / "checkpoint" / "00000004"
    folder.mkdir(parents=True)
    (folder / "manifest").write_bytes(encode_checkpoint(manifest, VALIDATOR))
    (folder / "model.safetensors").write_bytes(weights)

    lines = [r.line for r in inspect_paths([tmp_path])]
    assert [line.split()[:2] for line in lines] == [["OK", "checkpoint"], ["OK", "checkpoint-file"]]

    (folder / "model.safetensors").write_bytes(weights[:-1] + b"!")  # same size, other bytes
    bad = [r for r in inspect_paths([tmp_path]) if not r.ok]
    assert len(bad) == 1 and bad[0].reason == "digest_mismatch"
    # Without its manifest a weights file is what it is: not a signed object.
    alone = list(inspect_paths([folder / "model.safetensors"]))
    assert not alone[0].ok and alone[0].reason == "unsupported_version"


# ------------------------------------------------------------------ hostile files
def test_control_characters_never_reach_the_terminal(tmp_path: Path) -> None:
    """A tensor name that tries to rewrite the terminal line (erase it, print a fake OK) is shown
    escaped, and the object stays INVALID; the same for file names and announcement fields."""
    from fuzz_seeds import load

    from protocol.wire import Announcement, encode_announcement

    hostile = tmp_path / "evil\x1b[1A\r"
    hostile.write_bytes(load("objects")["control-chars-in-name"])
    ann = tmp_path / "ann"
    ann.write_bytes(encode_announcement(Announcement(RUN, 0, "v\x07\u202e1", "cpu\x1b]0;owned\x07"), PEER))
    results = {r.path: r for r in inspect_paths([hostile, ann])}
    bad, good = results[str(hostile)], results[str(ann)]
    assert not bad.ok and bad.line.startswith("INVALID ") and bad.reason == "malformed"
    assert good.ok and good.line.startswith("OK announcement ")
    for r in (bad, good):
        assert r.line.isprintable() and "\x1b" not in r.line and "\u202e" not in r.line
    assert "\\x1b[2K\\x0dOK contribution" in bad.line  # what the name really holds, visibly
    out = CliRunner().invoke(main, ["inspect", str(hostile), str(ann)]).stdout
    assert [line.split()[0] for line in out.splitlines()] == ["INVALID", "OK"]


def test_codec_errors_are_protocol_errors_and_sizes_are_capped(tmp_path: Path) -> None:
    from fuzz_seeds import load

    from client.inspect import DEFAULT_MAX_BYTES

    for name in ("block128-packed12", "huge-block-prime-rows", "unary-all-ones"):
        p = tmp_path / name
        p.write_bytes(load("objects")[name])
        r = inspect_file(p)
        assert not r.ok and r.reason == "malformed", r.line  # never internal_error
    assert DEFAULT_MAX_BYTES <= 256 << 20
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(DEFAULT_MAX_BYTES + 1)  # sparse: refused from its size, never read
    assert inspect_file(big).reason == "too_large"
    assert inspect_file(big, max_bytes=DEFAULT_MAX_BYTES + 1).reason == "unsupported_version"


def test_a_runs_preflight_probes_are_named_not_called_invalid() -> None:
    """``<run>/probe/<peer>`` holds random bytes by design (preflight's write probe): inspecting a
    whole run says what they are instead of failing on them."""

    from wire_samples import RUN_ID

    from client.inspect import inspect_store
    from protocol.identity import Identity
    from protocol.layout import probe_key
    from protocol.store.memory import MemoryStore

    store = MemoryStore(f"inspect-probe-{os.getpid()}")
    store.put(probe_key(RUN_ID, Identity.from_seed(b"p" * 32).peer_id), os.urandom(4096))
    results = list(inspect_store(store, f"{RUN_ID}/", label="memory://"))
    assert len(results) == 1 and results[0].ok, results
    assert results[0].line.startswith("OK probe bytes=4096")
