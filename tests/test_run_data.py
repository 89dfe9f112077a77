"""The run's dataset in its store: init → signed manifest → peers fetch, verify and cache only the
blocks their windows need, with ranged reads; a damaged block is never trained on; the cache keeps
to its cap."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from client.data_feed import DataFeed
from client.replica import FullReplica
from client.window import Skipped, Trained, WindowJob
from protocol import layout
from protocol.config import RunSpec
from protocol.data.assignment import assigned_batches, assigned_spans, assigned_starts
from protocol.data.cache import BLOCKS, BlockCache
from protocol.data.run_data import MAX_MANIFEST_BYTES, StoreBlocks, open_run_dataset, read_dataset_manifest
from protocol.data.tokens import TokenDataset
from protocol.errors import DataUnavailable, DigestMismatch, MalformedPayload, StoreUnavailable, UnknownSigner
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import build_model, parameters_of
from protocol.settings import DataSettings, LocalSettings, StoreSettings, local_table
from protocol.store.base import ObjectStore
from protocol.store.memory import MemoryStore
from protocol.wire import GENESIS, DatasetManifest, DatasetShard, dataset_body, dataset_digest, decode_dataset
from validator.init import InitResult, init_run

torch.set_num_threads(1)

BASE = RunSpec().replace(
    model={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
    data={"seq_len": 32, "batch_size": 4, "val_fraction": 0.2},
    inner={"steps": 4, "warmup_steps": 1},
    validator={"eval_sequences": 8},
)
SHARD_TOKENS = 8192
VKEY = Identity.from_seed(b"v" * 32)


@dataclass(frozen=True)
class Run:
    result: InitResult
    store_name: str
    root: Path

    @property
    def spec(self) -> RunSpec:
        return self.result.spec

    def store(self) -> MemoryStore:
        return MemoryStore(self.store_name)

    def shard_bytes(self) -> dict[str, bytes]:
        """Every shard object of the run, by sha256."""
        store = self.store()
        prefix = layout.data_prefix(self.result.run_id) + "shard/"
        return {k.rsplit("/", 1)[1]: store.get(k) for k in store.list(prefix)}

    def train_stream(self) -> np.ndarray:
        """The train split as one array, from the store's shards in manifest order."""
        m = read_dataset_manifest(self.store(), self.spec)
        objs = self.shard_bytes()
        return np.concatenate([np.frombuffer(objs[s.sha256], dtype="<u2") for s in m.split("train")])


def write_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        lines = [f"def f_{i}_{j}(x):\n    return x * {j} + {i}  # document {i}, line {j}\n" for j in range(400)]
        (corpus / f"doc{i:02d}.py").write_text("".join(lines))
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02")  # not text: skipped
    return corpus


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("run")
    name = f"data-{uuid.uuid4().hex[:8]}"
    url = f"memory://{name}"
    result = init_run(
        [str(write_corpus(root))],
        base=BASE,
        local={"store": {"url": url}},
        store=StoreSettings(url=url),
        identity=VKEY,
        out=root / "run.toml",
        shard_tokens=SHARD_TOKENS,
    )
    yield Run(result, name, root)
    MemoryStore.forget(name)


class Recording(ObjectStore):
    """A store handle that notes every key it reads whole (``gets``) and every range it reads
    (``ranges``: key, start, length)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.gets: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        self.gets.append(key)
        return self.inner.get(key, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.ranges.append((key, start, length))
        return self.inner.get_range(key, start, length)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def window_args(spec: RunSpec) -> tuple[int, int, int]:
    return spec.inner.steps, spec.data.batch_size, spec.data.seq_len


def window_blocks(ds: TokenDataset, spec: RunSpec, peer: str, window: int) -> set[tuple[str, int]]:
    """(shard sha256, block index) of every block ``peer``'s batches of ``window`` read."""
    access = ds.access
    assert isinstance(access, StoreBlocks)
    m, shards = access.manifest, access.manifest.split("train")
    out = set()
    for start, length in assigned_spans(ds, spec.seed, peer, window, *window_args(spec), pages=spec.data.pages):
        for i, offset, n in ds.train.pieces(start, length):
            first, last = offset // m.block_tokens, (offset + n - 1) // m.block_tokens
            out.update((shards[i].sha256, b) for b in range(first, last + 1))
    return out


# ---------------------------------------------------------------------- init and the manifest
def test_init_writes_a_run_whose_runspec_names_the_signed_dataset(run: Run) -> None:
    r, spec = run.result, run.spec
    loaded = RunSpec.load(r.out)
    assert loaded.hash() == r.run_hash and layout.run_id(r.run_hash) == r.run_id
    assert spec.data.dataset == r.dataset and spec.data.tokenizer == "bytes"
    assert VKEY.public_key_hex in spec.validator.public_keys
    assert local_table(r.out)["store"]["url"] == f"memory://{run.store_name}"
    store = run.store()
    m = read_dataset_manifest(store, spec)
    assert dataset_digest(m) == spec.data.dataset  # the digest is the body's: known before the run hash
    assert {s.sha256 for s in m.shards} == set(run.shard_bytes())  # every shard, content-addressed
    assert all(hashlib.sha256(b).hexdigest() == sha for sha, b in run.shard_bytes().items())
    assert r.documents == 24 and r.shards == len(m.shards) > 8  # the binary file was skipped
    assert r.train_tokens + r.val_tokens == sum(len(p.read_bytes()) + 1 for p in (run.root / "corpus").glob("*.py"))
    assert not store.exists(layout.checkpoint_manifest_key(r.run_id, 0))  # genesis: the validator publishes it


def test_the_manifest_is_checked_against_the_runspec_and_its_signers(run: Run) -> None:
    blob = run.store().get(layout.dataset_manifest_key(run.result.run_id))
    spec = run.spec
    kwargs = {"run_hash": spec.hash(), "max_bytes": MAX_MANIFEST_BYTES}
    assert decode_dataset(blob, allowed_signers=[VKEY.public_key], digest=spec.data.dataset, **kwargs).sender
    with pytest.raises(DigestMismatch):
        decode_dataset(blob, allowed_signers=[VKEY.public_key], digest="0" * 64, **kwargs)
    with pytest.raises(UnknownSigner):
        decode_dataset(blob, allowed_signers=[Identity.from_seed(b"x" * 32).public_key], **kwargs)


@pytest.mark.parametrize(
    "shards, eos, message",
    [
        ((("val", 10), ("train", 10)), 0, "train shards, then validation"),
        ((("train", 10),), 0, "train and validation"),
        ((("train", 0), ("val", 10)), 0, "of 0 tokens"),
        ((("train", 10), ("val", 10)), 256, "outside the vocabulary"),
    ],
)
def test_a_manifest_that_breaks_the_rules_has_no_encoding(shards: tuple, eos: int, message: str) -> None:
    m = DatasetManifest(
        "bytes",
        2,
        256,
        eos,
        tuple(
            DatasetShard(s, hashlib.sha256(bytes([i])).hexdigest(), n, bytes(32 * -(-n // 1024)))
            for i, (s, n) in enumerate(shards)
        ),
    )
    with pytest.raises(MalformedPayload, match=message):
        dataset_body(m)


# ---------------------------------------------------------------------- fetch, verify, cache
def test_a_peer_fetches_only_its_windows_blocks_with_ranged_reads_verified_and_cached(run: Run, tmp_path: Path) -> None:
    spec, args, pages = run.spec, window_args(run.spec), run.spec.data.pages
    rec = Recording(run.store())
    cache = DataSettings(cache_dir=str(tmp_path / "cache"))
    ds = open_run_dataset(spec, rec, cache)
    batches = assigned_batches(ds, spec.seed, "peer-a", 3, *args, pages=pages)
    m = read_dataset_manifest(run.store(), spec)
    needed = window_blocks(ds, spec, "peer-a", 3)
    assert rec.gets == [layout.dataset_manifest_key(run.result.run_id)]  # no shard is read whole
    read = set()
    for key, start, length in rec.ranges:  # block-aligned ranged reads of shard objects
        assert key.startswith(layout.data_prefix(run.result.run_id) + "shard/") and start % m.block_bytes == 0
        read.update(
            (key.rsplit("/", 1)[1], b) for b in range(start // m.block_bytes, -(-(start + length) // m.block_bytes))
        )
    assert read == needed
    spans = assigned_spans(ds, spec.seed, "peer-a", 3, *args, pages=pages)
    assert len(spans) == min(pages, spec.inner.steps * spec.data.batch_size)
    assert len(rec.ranges) <= len(spans)  # one ranged read per page at most (adjacent pages share one)
    usage = ds.usage()
    assert usage.requests == len(rec.ranges) and usage.fetched_bytes == sum(n for *_, n in rec.ranges)
    assert usage.fetched_bytes <= len(needed) * m.block_bytes < sum(s.tokens for s in m.split("train")) // 4
    # The batches are exactly the train stream's tokens at the assigned positions.
    stream = run.train_stream()
    starts = assigned_starts(ds, spec.seed, "peer-a", 3, *args, pages=pages)
    rows = torch.cat(batches)
    assert all(torch.equal(row, torch.from_numpy(stream[s : s + 33].astype(np.int64))) for row, s in zip(rows, starts))
    assert usage.misses == len(needed) and usage.hits == 0
    # Another process with the same cache reads them from disk: nothing fetched but the manifest.
    again = open_run_dataset(spec, Recording(run.store()), cache)
    second = assigned_batches(again, spec.seed, "peer-a", 3, *args, pages=pages)
    assert all(torch.equal(a, b) for a, b in zip(batches, second))
    assert (again.usage().hits, again.usage().misses, again.usage().fetched_bytes) == (len(needed), 0, 0)


def test_a_damaged_block_is_fetched_again_never_used_and_the_peer_recovers(run: Run, tmp_path: Path) -> None:
    spec, args, pages = run.spec, window_args(run.spec), run.spec.data.pages
    window = 2
    probe = open_run_dataset(spec, run.store(), DataSettings(cache_dir=str(tmp_path / "probe")))
    sha, _ = min(window_blocks(probe, spec, "peer-b", window))
    key = layout.shard_key(run.result.run_id, sha)

    # Damaged once in transit: fetched again, and the window trains on the verified bytes.
    store = run.store()
    store.faults.corrupt(key, times=1)
    ds = open_run_dataset(spec, store, DataSettings(cache_dir=str(tmp_path / "once")))
    assigned_batches(ds, spec.seed, "peer-b", window, *args, pages=pages)
    assert ds.usage().requests > len({s for s, _ in window_blocks(ds, spec, "peer-b", window)})  # one read twice

    # Damaged in the store: the window is skipped with the reason, nothing damaged is cached...
    store = run.store()
    fault = store.faults.corrupt(key)
    cache = tmp_path / "peer"
    replica = FullReplica(
        spec, data_key="peer-b", data=lambda: open_run_dataset(spec, store, DataSettings(cache_dir=str(cache)))
    )
    theta = {n: p.detach().clone() for n, p in parameters_of(build_model(spec.model)).items()}
    job = WindowJob(window, theta, GENESIS, FeedbackState(), report=lambda **_: None, should_stop=lambda: False)
    skipped = replica.train(job)
    assert isinstance(skipped, Skipped) and "data_unavailable" in skipped.reason and "hash" in skipped.reason
    assert fault.fired >= 2  # fetched again before giving up
    cached = list((cache / BLOCKS).iterdir())
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in cached)
    with pytest.raises(DataUnavailable):
        replica.data.batches(window)
    # ...and once the store is repaired, the same window trains, and its blocks are cached.
    store.faults.clear()
    trained = replica.train(job)
    assert isinstance(trained, Trained) and trained.stats.tokens == spec.inner.steps * spec.data.batch_size * 32
    m = read_dataset_manifest(run.store(), spec)
    shard = next(s for s in m.shards if s.sha256 == sha)
    names = {p.name for p in (cache / BLOCKS).iterdir()}
    assert {shard.block(b).hex() for s, b in window_blocks(probe, spec, "peer-b", window) if s == sha} <= names


def test_a_store_that_is_down_for_a_while_delays_the_data_but_costs_no_window(run: Run, tmp_path: Path) -> None:
    """A peer's link or the store down for a few reads: with patience the reads wait and the
    window's batches come; without it the read fails at once (the window would be skipped)."""
    spec, args, pages = run.spec, window_args(run.spec), run.spec.data.pages
    window = 1
    shards = layout.data_prefix(run.result.run_id) + "shard/"

    store = run.store()
    ds = open_run_dataset(spec, store, DataSettings(cache_dir=str(tmp_path / "patient")), patience_s=30.0)
    down = store.faults.fail(shards, ops=("get",), times=3, error=StoreUnavailable)
    assert assigned_batches(ds, spec.seed, "peer-b", window, *args, pages=pages)
    assert down.fired == 3  # three reads failed, and were tried again

    store = run.store()
    ds = open_run_dataset(spec, store, DataSettings(cache_dir=str(tmp_path / "impatient")))
    store.faults.fail(shards, ops=("get",), times=3, error=StoreUnavailable)
    with pytest.raises(DataUnavailable, match="injected get failure"):
        assigned_batches(ds, spec.seed, "peer-b", window, *args, pages=pages)


def test_the_next_windows_blocks_are_prefetched_while_training(run: Run, tmp_path: Path) -> None:
    spec = run.spec
    feed = DataFeed(
        spec, key="peer-c", opener=lambda: open_run_dataset(spec, run.store(), DataSettings(cache_dir=str(tmp_path)))
    )
    feed.batches(4)
    access = feed.dataset().access
    assert isinstance(access, StoreBlocks) and access.wait_prefetched(timeout=60)
    ds, before = feed.dataset(), feed.dataset().usage()
    # Window 5's batches as the feed reads them, without the feed's own prefetch of window 6,
    # whose reads would land in the same counters at a time of their own.
    assigned_batches(ds, spec.seed, "peer-c", 5, *window_args(spec), pages=spec.data.pages)
    used = ds.usage() - before
    assert used.misses == 0 and used.requests == 0 and used.hits == len(window_blocks(ds, spec, "peer-c", 5))


# ---------------------------------------------------------------------- the cache cap
def test_the_cache_keeps_to_its_cap_least_recently_used_first(tmp_path: Path) -> None:
    blobs = {bytes([i]) * 1000: None for i in range(4)}
    names = {data: hashlib.sha256(data).hexdigest() for data in blobs}
    a, b, c, d = list(names)
    cache = BlockCache(tmp_path, max_bytes=3500)  # evicting frees down to 90 %: 3150
    for t, data in enumerate((a, b, c)):
        assert cache.put(names[data], data)
        os.utime(cache.path(names[data]), (1000.0 + t, 1000.0 + t))  # a oldest, then b, then c
    assert cache.get(names[a], 1000) == a  # a is used now: b is the least recently used
    assert cache.put(names[d], d)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[x] for x in (a, c, d))
    assert cache.total_bytes() <= 3500
    assert not cache.put(hashlib.sha256(b"x" * 4000).hexdigest(), b"x" * 4000)  # larger than the cap
    (tmp_path / names[c]).write_bytes(b"y" * 1000)  # damaged on disk: not served, removed
    assert BlockCache(tmp_path, 3000).get(names[c], 1000) is None and not (tmp_path / names[c]).exists()


def test_a_peer_keeps_its_cache_under_the_cap_window_after_window(run: Run, tmp_path: Path) -> None:
    spec, args, pages = run.spec, window_args(run.spec), run.spec.data.pages
    m = read_dataset_manifest(run.store(), spec)
    cap = 24 * m.block_bytes  # about one window of blocks
    ds = open_run_dataset(spec, run.store(), DataSettings(cache_dir=str(tmp_path), cache_max_bytes=cap))
    for window in range(12):
        assigned_batches(ds, spec.seed, "peer-d", window, *args, pages=pages)
        assert BlockCache(tmp_path / BLOCKS).total_bytes() <= cap
    assert ds.usage().misses > 3  # it did have to evict and fetch again


# ---------------------------------------------------------------------- inputs and the command
def test_init_reads_jsonl_text_and_shard_directories(tmp_path: Path) -> None:
    from protocol.data.corpus import documents
    from protocol.data.shards import write_shards
    from protocol.data.tokenizer import ByteTokenizer
    from protocol.errors import ConfigError
    from validator.dataset import build_dataset

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "first row\\n", "id": 1}\n\n{"text": "second row\\n"}\n')
    assert [d for _, d in documents(str(rows))] == [b"first row\n", b"second row\n"]
    assert [n for n, _ in documents(str(rows))] == ["rows.jsonl:1", "rows.jsonl:3"]
    with pytest.raises(ConfigError, match="body"):
        list(documents(str(rows), text_field="body"))
    old = write_shards(tmp_path / "old", [(f"d{i}", b"x = 1\n" * 3000) for i in range(20)], ByteTokenizer(), 0.2)
    built = build_dataset(
        [str(tmp_path / "old"), str(rows)], ByteTokenizer(), val_fraction=0.2, work=tmp_path / "work", shard_tokens=4096
    )
    m = built.manifest
    total = sum(s.tokens for s in m.shards)
    assert total == len(old.train) + len(old.val) + len(b"first row\n") + len(b"second row\n") + 2
    assert all(s.tokens <= 4096 for s in m.shards) and m.metadata["documents"] == 2
    assert {hashlib.sha256(p.read_bytes()).hexdigest() for p in built.files.values()} == {s.sha256 for s in m.shards}


def test_the_init_command_prints_the_run_and_refuses_to_overwrite(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from validator.cli import cli

    corpus = write_corpus(tmp_path)
    base = tmp_path / "base.toml"
    base.write_text(BASE.to_toml() + "\n[local]\npoll_interval_s = 0.5\n")
    args = [
        "init",
        "--corpus",
        str(corpus),
        "--store",
        f"file://{tmp_path / 'store'}",
        "--key",
        str(tmp_path / "v.pem"),
    ]
    args += ["--spec", str(base), "--out", str(tmp_path / "run.toml"), "--shard-tokens", "8192", "--json"]
    args += ["--grant-url", "https://validator.example:8710"]  # what volunteers need besides the store
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    printed = json.loads(out.output.strip().splitlines()[-1])
    spec = RunSpec.load(tmp_path / "run.toml")
    assert printed["run_hash"] == spec.hash() and printed["dataset"] == spec.data.dataset
    assert local_table(tmp_path / "run.toml") == {
        "poll_interval_s": 0.5,
        "store": {"url": f"file://{tmp_path / 'store'}", "grant_url": "https://validator.example:8710"},
    }
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 2 and "exists" in again.output


# ---------------------------------------------------------------------- the validator's own reads
def test_a_damaged_validation_shard_never_stalls_the_validator(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every validation shard of the run is damaged in the store: the validator publishes the window
    anyway, says that its loss could not be measured and why, and measures it again once the store
    is repaired. (A validator that retried the window while the damage lasts would never publish.)"""
    from validator.node import Validator

    name = f"data-val-{uuid.uuid4().hex[:8]}"
    url = f"memory://{name}"
    result = init_run(
        [str(write_corpus(tmp_path))],
        base=BASE.replace(windows={"upload_deadline_s": 1.0, "gather_grace_s": 0.05}),  # no peers to wait for
        local={"store": {"url": url}},
        store=StoreSettings(url=url),
        identity=VKEY,
        out=tmp_path / "run.toml",
        shard_tokens=SHARD_TOKENS,
    )
    try:
        spec, store = result.spec, MemoryStore(name)
        manifest = read_dataset_manifest(store, spec)
        for shard in manifest.split("val"):
            store.faults.corrupt(layout.shard_key(result.run_id, shard.sha256))
        local = LocalSettings.from_dict({"poll_interval_s": 0.02, "data": {"cache_dir": str(tmp_path / "cache")}})
        v = Validator(spec, store, VKEY, tmp_path / "validator", local=local)
        v.resume()
        with caplog.at_level("WARNING"):
            damaged = v.run_window()
        assert damaged is not None and damaged.window == 0 and math.isnan(damaged.val_loss)  # not measured
        assert "validation data unavailable" in caplog.text and "do not hash" in caplog.text  # and why
        store.faults.clear()
        repaired = v.run_window()
        assert repaired is not None and repaired.window == 1 and math.isfinite(repaired.val_loss)
        v.close()
    finally:
        MemoryStore.forget(name)


def test_init_without_the_buckets_credential_says_which_settings_give_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator who runs init before loading the bucket's credential reads the variables to
    set, with run.toml's table named as written ([local.store], not eaten as markup)."""
    from click.testing import CliRunner

    from validator.cli import cli

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    corpus = write_corpus(tmp_path)
    args = ["init", "--corpus", str(corpus), "--store", "s3://sparseloco/runs", "--key", str(tmp_path / "v.pem")]
    args += ["--spec", str(tmp_path / "base.toml"), "--out", str(tmp_path / "run.toml")]
    args += ["--s3-endpoint", "http://127.0.0.1:9", "--s3-region", "us-east-1"]
    (tmp_path / "base.toml").write_text(BASE.to_toml())
    out = CliRunner().invoke(cli, args, terminal_width=400)
    assert out.exit_code == 2, out.output
    text = " ".join(out.output.split())
    assert "run.toml's [local.store] table" in text and "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in text
    assert "validator.env" in text and not (tmp_path / "run.toml").exists()


def test_a_validator_started_while_the_store_does_not_answer_waits_for_the_dataset(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    """The validator's start reads the run's dataset manifest: a store that is down for a few
    reads is waited for (said once), where the start used to fail with a store error."""
    from protocol.settings import LocalSettings
    from validator.node import _open_dataset

    store = run.store()
    down = store.faults.fail(
        layout.dataset_manifest_key(run.result.run_id), ops=("get",), times=2, error=StoreUnavailable
    )
    with caplog.at_level(logging.WARNING, logger="validator.node"):
        ds = _open_dataset(run.spec, store, LocalSettings(poll_interval_s=0.01))
    assert down.fired == 2 and ds.vocab_size > 0
    assert sum("does not answer" in r.getMessage() for r in caplog.records) == 1
