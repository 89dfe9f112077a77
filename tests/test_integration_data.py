"""The run's data for real: ``sparseloco-validator init`` and peer and validator processes.

A block damaged in the store is never trained on — the peer skips that window with the reason —
and the peer trains again once the store is repaired. A run made from a tokenizer.json trained
here (a small BPE, offline) is created, joined and trained for two windows.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from client.demo.swarm import VALIDATOR, LocalSwarm
from client.tools import main
from protocol import layout
from protocol.data.assignment import assigned_spans
from protocol.data.corpus import stdlib_documents
from protocol.data.run_data import open_run_dataset, read_dataset_manifest
from protocol.events import Event, ModelEvaluated
from protocol.identity import Identity
from protocol.settings import DataSettings
from protocol.store import open_store

pytestmark = pytest.mark.integration

SMALL: dict[str, dict[str, Any]] = {
    "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4},
    "inner": {"steps": 8, "lr": 3e-3, "warmup_steps": 4, "total_steps": 200},
    "windows": {"upload_deadline_s": 40.0, "gather_grace_s": 1.0, "checkpoint_every": 2},
    "validator": {"eval_sequences": 8, "eval_peers_per_window": 8},
}
TIMEOUT_S = 180.0


@pytest.fixture
def run_dir(tmp_path: Path):
    yield tmp_path / "run"
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def _pick_damage(swarm: LocalSwarm, cache: Path) -> tuple[str, int]:
    """Keys for the two peers and a block of a train shard that peer-0 needs first in window 1 and
    nobody else needs in windows 0 and 1: (the shard's sha256, the block's first byte)."""
    assert swarm.spec is not None
    spec, d = swarm.spec, swarm.spec.data
    ds = open_run_dataset(spec, open_store(swarm.store_url), DataSettings(cache_dir=str(cache)))
    m = read_dataset_manifest(open_store(swarm.store_url), spec)
    train = m.split("train")
    other = Identity.from_seed(b"peer-1".ljust(32, b"."))
    for seed in range(64):
        mine = Identity.from_seed(seed.to_bytes(32, "little"))

        def blocks(ident: Identity, w: int) -> set[tuple[int, int]]:
            spans = assigned_spans(
                ds, spec.seed, ident.peer_id, w, spec.inner.steps, d.batch_size, d.seq_len, pages=d.pages
            )
            return {
                (i, b)
                for start, length in spans
                for i, offset, n in ds.train.pieces(start, length)
                for b in range(offset // m.block_tokens, (offset + n - 1) // m.block_tokens + 1)
            }

        fresh = blocks(mine, 1) - blocks(mine, 0) - blocks(other, 0) - blocks(other, 1)
        if fresh:
            mine.save(swarm.peer_dir(0) / "key.pem")
            other.save(swarm.peer_dir(1) / "key.pem")
            shard, block = min(fresh)
            return train[shard].sha256, block * m.block_bytes
    raise AssertionError("no key gives peer-0 a block of its own in window 1")


def test_a_damaged_block_is_never_trained_on_and_the_peer_recovers_when_it_is_repaired(
    run_dir: Path, tmp_path: Path
) -> None:
    with LocalSwarm(run_dir, peers=2, windows=3, store="file", overrides=SMALL, shard_tokens=1 << 16) as swarm:
        assert swarm.spec is not None
        sha, at = _pick_damage(swarm, tmp_path / "probe")
        path = run_dir / "store" / layout.shard_key(layout.run_id(swarm.spec.hash()), sha)
        good = path.read_bytes()
        path.write_bytes(good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :])  # one byte off, same size
        swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)
        p0 = swarm.peers["peer-0"]
        swarm.follow(lambda: 1 in p0.windows, timeout_s=TIMEOUT_S)
        skipped = p0.windows[1]
        path.write_bytes(good)  # the store is repaired
        swarm.follow(swarm.finished, timeout_s=TIMEOUT_S)
        swarm.wait_exit(timeout_s=60.0)
        summary = swarm.summary()
    assert skipped.outcome == "skipped" and skipped.tokens == 0, skipped
    assert skipped.reason is not None and "data_unavailable" in skipped.reason and "digest_mismatch" in skipped.reason
    assert p0.windows[2].outcome == "uploaded"  # recovered: the next window fetched the repaired block
    cached = list((swarm.peer_dir(0) / "cache" / "blocks").iterdir())
    assert cached and all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in cached)  # verified only
    assert summary["windows_completed"] == 3 and summary["fingerprints_equal"]
    assert summary["accepted_per_window"][1] == 1  # peer-1's; peer-0 sent nothing for window 1
    assert summary["data_bytes_per_peer_per_window"] > 0


def _train_bpe(corpus: Path, out: Path) -> Path:
    """A byte-level BPE tokenizer.json of 512 tokens trained on ``corpus`` (seconds, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((p.read_text() for p in sorted(corpus.iterdir())), trainer)
    tok.save(str(out))
    return out


def test_a_run_made_from_a_trained_tokenizer_json(run_dir: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, (_, data) in enumerate(itertools.islice(stdlib_documents(), 40)):
        (corpus / f"{i:03d}.py").write_bytes(data)
    tokenizer = _train_bpe(corpus, tmp_path / "tokenizer.json")
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    evaluated: list[ModelEvaluated] = []

    def note(name: str, event: Event) -> None:
        if name == VALIDATOR and isinstance(event, ModelEvaluated):
            evaluated.append(event)

    overrides = {**SMALL, "data": {**SMALL["data"], "val_fraction": 0.2}}
    with LocalSwarm(
        run_dir,
        peers=2,
        windows=2,
        store="file",
        overrides=overrides,
        corpus=str(corpus),
        tokenizer=str(tokenizer),
        local={"validator": {"eval_every": 2, "eval_sequences": 16}},  # bits per byte need the tokenizer
        on_event=note,
    ) as swarm:
        assert swarm.spec is not None
        spec = swarm.spec
        assert spec.data.tokenizer == f"hf:{digest}" and spec.model.vocab_size >= 512
        store = open_store(swarm.store_url)
        assert store.get(layout.tokenizer_key(layout.run_id(spec.hash()), digest)) == tokenizer.read_bytes()
        assert read_dataset_manifest(store, spec).vocab_size == 512
        swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)
        swarm.follow(swarm.finished, timeout_s=TIMEOUT_S)
        swarm.wait_exit(timeout_s=60.0)
        summary = swarm.summary()
    assert summary["windows_completed"] == 2 and summary["fingerprints_equal"], summary
    assert all(n >= 1 for n in summary["accepted_per_window"])
    assert evaluated and evaluated[-1].window == 1 and 0 < evaluated[-1].bits_per_byte < 10
    # the exported model ships the run's own tokenizer.json, fetched from the store and verified
    out = tmp_path / "hf"
    res = CliRunner().invoke(main, ["export", "--run", str(run_dir / "run.toml"), "--window", "latest", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
