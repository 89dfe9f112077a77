"""protocol/data + tokenizer: shard format, sources, deterministic and disjoint assignment."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.config import DataConfig
from protocol.data.assignment import (
    TokenDataset,
    TokenSplit,
    assigned_batches,
    assigned_spans,
    assigned_starts,
    lanes,
    open_dataset,
    open_shards,
    random_batches,
    validation_batches,
    write_shards,
)
from protocol.data.tokenizer import ByteTokenizer, load_tokenizer
from protocol.errors import ConfigError
from protocol.settings import DataSettings

N_TRAIN, N_VAL = 60_000, 2_000
P = 4  # data.pages of these tests: 4 pages of 4 sequences per peer and window


@pytest.fixture(scope="module")
def positional(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shard directory whose token at stream position i is i (so a sequence names its start)."""
    root = tmp_path_factory.mktemp("positional")
    train = np.arange(N_TRAIN, dtype="<u2")
    val = np.arange(N_TRAIN, N_TRAIN + N_VAL, dtype="<u2")
    # two train shard files, to exercise reads across a file boundary
    (root / "train-0.bin").write_bytes(train[:25_000].tobytes())
    (root / "train-1.bin").write_bytes(train[25_000:].tobytes())
    (root / "val-0.bin").write_bytes(val.tobytes())
    index = {
        "format": "sparseloco-shards",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": 65536,
        "tokenizer": "test",
        "eos_id": None,
        "splits": {
            "train": [{"file": "train-0.bin", "tokens": 25_000}, {"file": "train-1.bin", "tokens": 35_000}],
            "val": [{"file": "val-0.bin", "tokens": N_VAL}],
        },
    }
    (root / "index.json").write_text(json.dumps(index))
    return root


def _ranges(batches: list[torch.Tensor]) -> set[int]:
    """Every stream position a peer's batches cover."""
    out: set[int] = set()
    for b in batches:
        for row in b:
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + len(row)))  # contiguous
            out.update(range(int(row[0]), int(row[0]) + len(row)))
    return out


def test_assignment_is_deterministic_and_disjoint_across_peers(positional: Path) -> None:
    ds = open_shards(positional)
    args = (4, 4, 15)  # steps, batch, seq_len
    a = assigned_batches(ds, 7, 0, 3, *args, pages=P)
    assert len(a) == 4 and a[0].shape == (4, 16) and a[0].dtype == torch.int64
    assert all(torch.equal(x, y) for x, y in zip(a, assigned_batches(ds, 7, 0, 3, *args, pages=P)))
    covered = [_ranges(assigned_batches(ds, 7, p, 3, *args, pages=P)) for p in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert not covered[i] & covered[j], f"replicas {i} and {j} share tokens"
    # another window or another run seed gives other data
    assert _ranges(assigned_batches(ds, 7, 0, 4, *args, pages=P)) != covered[0]
    assert _ranges(assigned_batches(ds, 8, 0, 3, *args, pages=P)) != covered[0]
    # train only: positions never reach the validation split
    assert max(max(c) for c in covered) < N_TRAIN


def test_string_peer_ids_are_deterministic_and_differ(positional: Path) -> None:
    ds = open_shards(positional)
    a = assigned_batches(ds, 1, "peer-a", 0, 2, 4, 15, pages=P)
    b = assigned_batches(ds, 1, "peer-b", 0, 2, 4, 15, pages=P)
    assert all(torch.equal(x, y) for x, y in zip(a, assigned_batches(ds, 1, "peer-a", 0, 2, 4, 15, pages=P)))
    assert not _ranges(a) & _ranges(b)


def sharded(n_shards: int = 64, tokens: int = 4096, digest: str = "d" * 64) -> TokenDataset:
    """A dataset of ``n_shards`` train shards whose token at stream position i is i mod 2^16."""
    arrays = [np.arange(k * tokens, (k + 1) * tokens, dtype=np.int64) % 65536 for k in range(n_shards)]
    val = TokenSplit.of_arrays([np.zeros(4096, dtype=np.uint16)])
    return TokenDataset(Path("."), TokenSplit.of_arrays(arrays), val, 65536, "test", digest)


def test_a_window_comes_from_pages_spread_over_the_dataset_and_depends_on_its_digest() -> None:
    """Diversity: ``pages`` runs of consecutive sequences per peer and window, drawn from the whole
    dataset; the spans name exactly what the batches read (what a peer prefetches)."""
    ds, args = sharded(), (8, 8, 15)
    for pages in (4, 16, 64):
        touched = [len(assigned_spans(ds, 3, f"peer-{p}", w, *args, pages=pages)) for p in range(8) for w in range(10)]
        assert set(touched) == {pages}
        spans = assigned_spans(ds, 3, "peer-0", 5, *args, pages=pages)
        starts = assigned_starts(ds, 3, "peer-0", 5, *args, pages=pages)
        covered = {int(s) for a, n in spans for s in range(a, a + n, 16)}
        assert set(starts.tolist()) <= covered and len(starts) == 64  # every sequence lies in a span
        assert all(a // 4096 == (a + n - 1) // 4096 for a, n in spans)  # a page never crosses a shard
    many = {a // 4096 for w in range(10) for a, _ in assigned_spans(ds, 3, "peer-0", w, *args, pages=64)}
    assert len(many) > 48  # 64 pages per window reach most of the 64 shards within a few windows
    other = sharded(digest="e" * 64)  # the same tokens under another name: other batches
    a, b = (assigned_starts(d, 3, "peer-0", 0, *args, pages=P) for d in (ds, other))
    assert not np.array_equal(a, b)
    # Random reference batches come from RANDOM_PAGES pages: here one sequence per page.
    ref = torch.cat(random_batches(ds, 11, 2, 4, 15))
    assert len({int(row[0]) // 16 for row in ref}) == 8


def test_string_peers_overlap_no_more_than_the_bound(positional: Path) -> None:
    """Peers that do not know each other share a window's lane with probability 1/n_lanes: a
    peer's expected share of sequences another of P peers also trains is at most (P − 1)/n_lanes.
    Measured over 300 windows of 8 peers; integer lanes (simulator replicas) are exactly disjoint."""
    ds, args, peers, windows = open_shards(positional), (4, 4, 15), 8, 300
    n_lanes = lanes(ds, *args, pages=P)
    shared = []
    for w in range(windows):
        sets = [set(assigned_starts(ds, 1, f"peer-{p}", w, *args, pages=P).tolist()) for p in range(peers)]
        for p, mine in enumerate(sets):
            others = set().union(*(s for q, s in enumerate(sets) if q != p))
            shared.append(len(mine & others) / len(mine))
    measured, bound = float(np.mean(shared)), (peers - 1) / n_lanes
    print(f"n_lanes {n_lanes}: measured overlap share {measured:.4f}, bound {bound:.4f}")
    assert 0 < measured <= bound * 1.25  # 2400 draws: the bound holds well within sampling error
    exact = [set(assigned_starts(ds, 1, p, 7, *args, pages=P).tolist()) for p in range(peers)]
    assert sum(len(s) for s in exact) == len(set().union(*exact))


def test_assignment_rejects_impossible_requests(positional: Path) -> None:
    ds = open_shards(positional)
    with pytest.raises(ConfigError):
        assigned_batches(ds, 0, 10_000, 0, 4, 4, 15, pages=P)  # lane beyond the data
    with pytest.raises(ConfigError):
        assigned_batches(ds, 0, 0, 0, 1000, 64, 127, pages=P)  # more sequences than the split holds


def test_validation_and_random_batches(positional: Path) -> None:
    ds = open_shards(positional)
    val = validation_batches(ds, 20, 8, 15)
    assert [b.shape[0] for b in val] == [8, 8, 4]
    assert all(int(b.min()) >= N_TRAIN for b in val)  # held-out split only
    r1, r2 = random_batches(ds, 5, 3, 4, 15), random_batches(ds, 5, 3, 4, 15)
    assert all(torch.equal(x, y) for x, y in zip(r1, r2))
    assert not torch.equal(torch.cat(r1), torch.cat(random_batches(ds, 6, 3, 4, 15)))


def test_write_shards_round_trip_and_split(tmp_path: Path) -> None:
    docs = [(f"doc{i}.txt", f"document number {i}\n".encode() * 20) for i in range(200)]
    ds = write_shards(tmp_path / "shards", docs, ByteTokenizer(), val_fraction=0.1)
    total = sum(len(d) + 1 for _, d in docs)  # + one separator per document
    assert len(ds.train) + len(ds.val) == total
    assert 0 < len(ds.val) < len(ds.train)
    assert ds.vocab_size == 256 and ds.tokenizer == "bytes"
    assert ByteTokenizer().decode(ds.train.read(0, 17).tolist()).startswith("document number")
    assert open_shards(tmp_path / "shards").digest == ds.digest


def test_open_dataset_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSELOCO_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("hello world\n" * 2000)
    (text / "b.bin").write_bytes(b"\x00\x01binary")  # skipped
    ds = open_dataset(DataConfig(val_fraction=0.4), str(text))
    assert len(ds.train) + len(ds.val) == len("hello world\n" * 2000) + 1
    again = open_dataset(DataConfig(val_fraction=0.4), str(text))
    assert again.path == ds.path  # cached
    with pytest.raises(ConfigError):
        open_dataset(DataConfig(), str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.json").write_text("{not json")
    with pytest.raises(ConfigError):
        open_dataset(DataConfig(), str(tmp_path / "bad"))


def test_cache_dir_setting_and_size_cap(tmp_path: Path) -> None:
    """``data.cache_dir`` wins over $SPARSELOCO_CACHE; past ``cache_max_bytes`` the oldest entry goes."""
    corpora = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "t.txt").write_text(f"{name} text\n" * 20000)
        corpora.append(tmp_path / name)
    cache = tmp_path / "cache"
    cfg = DataConfig(val_fraction=0.4)  # a small corpus still has a val split
    first = open_dataset(cfg, str(corpora[0]), DataSettings(cache_dir=str(cache)))
    assert Path(first.path).parent == cache
    entry = sum(f.stat().st_size for f in Path(first.path).rglob("*") if f.is_file())
    local = DataSettings(cache_dir=str(cache), cache_max_bytes=entry + entry // 2)
    second = open_dataset(cfg, str(corpora[1]), local)
    assert Path(second.path).is_dir() and not Path(first.path).exists()  # one entry fits, not two


def test_builtin_stdlib_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSELOCO_CACHE", str(tmp_path))
    ds = open_dataset(DataConfig())
    assert len(ds.train) > 1_000_000 and len(ds.val) > 10_000
    assert open_dataset(DataConfig()).digest == ds.digest  # second open reads the cache
    text = ByteTokenizer().decode(ds.train.read(0, 5000).tolist())
    assert "def " in text or "import " in text


def test_tokenizers() -> None:
    tok = load_tokenizer("bytes")
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.vocab_size == 256
    with pytest.raises(ConfigError):
        load_tokenizer("gpt2")
    with pytest.raises(ConfigError):
        load_tokenizer("/nonexistent/tokenizer.json")
