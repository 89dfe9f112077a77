"""Which tokens each peer trains on in each window, and local datasets for in-process runs.

**Assignment.** A run's dataset (:class:`~protocol.data.tokens.TokenDataset`) is a train and a val
stream of shards. Every train shard is cut into *slots* of ``seq_len + 1`` tokens (starting at a
window-dependent offset below one slot, so the cuts move from window to window), and its slots into
*pages* of ``ceil(H·B / pages)`` consecutive slots, ``pages`` being the RunSpec's ``data.pages``; a
page never crosses a shard. Window t permutes all pages of the dataset with a keyed affine
bijection and cuts the permuted list into *lanes* of ``pages`` pages; a peer trains on the H·B
sequences of one lane, in a shuffled order. So a peer's window comes from ``pages`` places spread
over the whole dataset (diverse replicas and batches), each one contiguous run of tokens that one
ranged read of the store fetches (:func:`assigned_spans`), and two lanes of one window never share
a token.

* An integer peer (a simulator replica) is its own lane: the replicas of a window are exactly
  disjoint.
* A string peer id is hashed to a lane per window. Peers do not know each other, so two of them
  land on the same lane with probability ``1 / n_lanes`` in a window and are otherwise disjoint:
  a peer's expected share of sequences that another of ``P`` peers also trains in that window is
  at most ``(P − 1) / n_lanes``. Measured (``tests/test_data.py``): 2.8 % for 8 peers and 234
  lanes, bound 3.0 %. The demo's dataset (stdlib, 1 Mi-token shards) has about 65 lanes of 960
  sequences: with its 3 peers, at most 3.1 %.

Everything is a pure function of (run seed, dataset digest, peer, window), so the validator
reproduces a peer's batches exactly; :func:`assigned_spans` names the token ranges of any window
ahead of time, for prefetching. The validator's random reference sequences
(:func:`random_batches`) come from random pages likewise, its validation sequences
(:func:`validation_batches`) evenly from the val stream::

    ds = open_run_dataset(spec, store, settings.data)          # protocol.data.run_data
    d = spec.data
    batches = assigned_batches(ds, spec.seed, peer_id, window, spec.inner.steps,
                               d.batch_size, d.seq_len, pages=d.pages)   # list of [B, T+1]

**Local datasets.** :func:`open_dataset` opens a corpus on this machine for in-process runs (the
simulator, benchmarks, tests): ``builtin:stdlib`` or a text file/directory, tokenized once into the
cache directory (keyed by the source, its files' sizes and mtimes, the tokenizer and the validation
fraction), or a shard directory (:mod:`protocol.data.shards`). ``builtin:stdlib`` depends on the
interpreter version; a real run reads the dataset ``init`` put into its store instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from protocol.config import DataConfig
from protocol.data.cache import cache_dir
from protocol.data.corpus import (
    BUILTIN_STDLIB,
    PIECE_BYTES,
    STDLIB_CAP_BYTES,
    Document,
    stdlib_documents,
    text_documents,
)
from protocol.data.shards import INDEX, VERSION, open_shards, write_shards
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from protocol.data.tokens import TokenDataset, TokenSplit
from protocol.errors import ConfigError
from protocol.settings import DataSettings

__all__ = [
    "INDEX",
    "RANDOM_PAGES",
    "STDLIB_CAP_BYTES",
    "TokenDataset",
    "TokenSplit",
    "assigned_batches",
    "assigned_spans",
    "assigned_starts",
    "cache_dir",
    "lanes",
    "open_dataset",
    "open_shards",
    "pipeline_data_key",
    "random_batches",
    "stdlib_documents",
    "text_documents",
    "validation_batches",
    "write_shards",
]

RANDOM_PAGES = 64  # pages of the validator's random reference and scoring sequences


# ----------------------------------------------------------------------------- local datasets
def open_dataset(cfg: DataConfig, source: str = BUILTIN_STDLIB, local: DataSettings | None = None) -> TokenDataset:
    """A corpus on this machine (``builtin:stdlib``, a shard directory, or a text file/directory),
    tokenized with ``cfg.tokenizer`` and split with ``cfg.val_fraction``; text sources are cached
    in ``local``'s cache directory under its cap (the oldest entries go first)."""
    local = local or DataSettings()
    tok = load_tokenizer(cfg.tokenizer)
    if source == BUILTIN_STDLIB:
        ver = sysconfig.get_python_version()
        key = _key("stdlib", VERSION, ver, tok.name, STDLIB_CAP_BYTES, PIECE_BYTES, cfg.val_fraction)
        return _cached(key, stdlib_documents, tok, cfg.val_fraction, local)
    src = Path(source).expanduser()
    if (src / INDEX).is_file():
        ds = open_shards(src)
        if ds.tokenizer != tok.name:
            raise ConfigError(f"{src} was tokenized with {ds.tokenizer!r}, the run uses {tok.name!r}")
        return ds
    if not src.exists():
        raise ConfigError(f"data source not found: {source!r}")
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = _key("text", VERSION, str(src.resolve()), stamp, tok.name, PIECE_BYTES, cfg.val_fraction)
    return _cached(key, lambda: text_documents(src), tok, cfg.val_fraction, local)


def _cached(
    key: str,
    docs: Callable[[], Iterable[Document]],
    tok: ByteTokenizer | HFTokenizer,
    val_fraction: float,
    local: DataSettings,
) -> TokenDataset:
    out = cache_dir(local) / key
    if (out / INDEX).is_file():
        return open_shards(out)
    ds = write_shards(out, docs(), tok, val_fraction)
    if local.cache_max_bytes:
        _trim_cache(out.parent, keep=out, cap_bytes=local.cache_max_bytes)
    return ds


def _trim_cache(root: Path, *, keep: Path, cap_bytes: int) -> None:
    """Remove the least recently written cache entries (never ``keep``) until ``root`` holds at
    most ``cap_bytes``. An entry is one tokenized source; a removed one is rebuilt when needed."""
    entries = [p for p in root.iterdir() if (p / INDEX).is_file()]  # published entries, not temporaries
    size = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in entries}
    total = sum(size.values())
    for p in sorted(entries, key=lambda p: p.stat().st_mtime):
        if total <= cap_bytes:
            return
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)
            total -= size[p]


def _key(kind: str, *parts: Any) -> str:
    return f"{kind}-{hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]}"


# ----------------------------------------------------------------------------- pages
def _h(*parts: Any) -> int:
    """A stable 64-bit hash (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


def _affine(n: int, *key: Any) -> tuple[int, int]:
    """Multiplier coprime with ``n`` and an offset: j -> (a·j + b) mod n is a bijection."""
    a = _h("mul", *key) % n or 1
    while math.gcd(a, n) != 1:
        a = a + 1 if a + 1 < n else 1
    return a, _h("add", *key) % n


class _Pages:
    """The pages of one split: ``page_seqs`` consecutive slots of ``span`` tokens inside one shard."""

    def __init__(self, split: TokenSplit, span: int, page_seqs: int) -> None:
        self.split, self.span, self.page_seqs = split, span, page_seqs
        # Slots fit whatever the window's offset (< span): the last one ends by the shard's end.
        slots = np.maximum(0, (split.lengths - span + 1) // span)
        self.cum = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(slots // page_seqs)])

    @property
    def n(self) -> int:
        return int(self.cum[-1])

    def starts(self, pages: np.ndarray, shift: int) -> np.ndarray:
        """Token positions of every sequence of ``pages`` (in page order), with the slot offset ``shift``."""
        shard = np.searchsorted(self.cum, pages, side="right") - 1
        first = self.split.starts[shard] + shift + (pages - self.cum[shard]) * self.page_seqs * self.span
        grid: np.ndarray = first[:, None] + np.arange(self.page_seqs, dtype=np.int64)[None, :] * self.span
        return grid.reshape(-1)


def _window_pages(dataset: TokenDataset, n_steps: int, batch_size: int, seq_len: int, pages: int) -> tuple[_Pages, int]:
    """The window's pages and how many of them a lane holds (never more than its sequences)."""
    per_peer = n_steps * batch_size
    per_lane = min(pages, per_peer)
    return _Pages(dataset.train, seq_len + 1, -(-per_peer // per_lane)), per_lane


def lanes(dataset: TokenDataset, n_steps: int, batch_size: int, seq_len: int, *, pages: int) -> int:
    """How many peers a window can feed disjointly (``pages`` pages each)."""
    window_pages, per_lane = _window_pages(dataset, n_steps, batch_size, seq_len, pages)
    return window_pages.n // per_lane


# ----------------------------------------------------------------------------- batches
def assigned_starts(
    dataset: TokenDataset,
    run_seed: int,
    peer: str | int,
    window: int,
    n_steps: int,
    batch_size: int,
    seq_len: int,
    *,
    pages: int,
) -> np.ndarray:
    """Token positions in the train split of the ``n_steps · batch_size`` sequences (of
    ``seq_len + 1`` tokens) peer ``peer`` trains on in ``window``, in training order."""
    chosen, window_pages, shift = _lane(dataset, run_seed, peer, window, n_steps, batch_size, seq_len, pages)
    starts = window_pages.starts(chosen, shift)
    key = (run_seed, dataset.digest, window)
    order = np.random.default_rng(_h("order", *key, peer)).permutation(len(starts))[: n_steps * batch_size]
    return starts[order]  # every batch mixes the lane's pages


def assigned_spans(
    dataset: TokenDataset,
    run_seed: int,
    peer: str | int,
    window: int,
    n_steps: int,
    batch_size: int,
    seq_len: int,
    *,
    pages: int,
) -> list[tuple[int, int]]:
    """The train-split token ranges ``(start, length)`` :func:`assigned_batches` reads for these
    arguments, one per page, sorted (what to prefetch)."""
    chosen, window_pages, shift = _lane(dataset, run_seed, peer, window, n_steps, batch_size, seq_len, pages)
    first = window_pages.starts(np.sort(chosen), shift)[:: window_pages.page_seqs]
    return [(int(s), window_pages.page_seqs * window_pages.span) for s in first]


def _lane(
    dataset: TokenDataset,
    run_seed: int,
    peer: str | int,
    window: int,
    n_steps: int,
    batch_size: int,
    seq_len: int,
    pages: int,
) -> tuple[np.ndarray, _Pages, int]:
    """The pages of ``peer``'s lane in ``window``, the window's pages and its slot offset."""
    window_pages, per_lane = _window_pages(dataset, n_steps, batch_size, seq_len, pages)
    n_lanes = window_pages.n // per_lane
    if n_lanes < 1:
        raise ConfigError(
            f"train split of {len(dataset.train)} tokens in {dataset.train.n_shards} shards is too small for "
            f"{per_lane} pages of {window_pages.page_seqs} sequences"
        )
    key = (run_seed, dataset.digest, window)
    if isinstance(peer, int):
        if not 0 <= peer < n_lanes:
            raise ConfigError(f"integer peer lane {peer} outside 0..{n_lanes - 1}")
        lane = peer
    else:
        lane = _h("lane", *key, peer) % n_lanes
    a, b = _affine(window_pages.n, *key)
    j = np.arange(lane * per_lane, (lane + 1) * per_lane, dtype=np.int64)
    chosen = (a * j + b) % window_pages.n  # a·j < 2^63 for any dataset below ~3·10^9 pages
    return chosen, window_pages, _h("shift", *key) % window_pages.span


def assigned_batches(
    dataset: TokenDataset,
    run_seed: int,
    peer: str | int,
    window: int,
    n_steps: int,
    batch_size: int,
    seq_len: int,
    *,
    pages: int,
) -> list[Tensor]:
    """The ``n_steps`` batches [batch_size, seq_len + 1] (int64, CPU) peer ``peer`` trains on in
    ``window``. Reading a run's dataset may fetch from the store: ``DataUnavailable`` when a range
    cannot be had intact."""
    starts = assigned_starts(dataset, run_seed, peer, window, n_steps, batch_size, seq_len, pages=pages)
    tokens = _stack(dataset, "train", starts, seq_len + 1)
    return list(torch.split(tokens, batch_size))


def random_batches(
    dataset: TokenDataset,
    seed: int,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    *,
    split: str = "train",
    pages: int = RANDOM_PAGES,
) -> list[Tensor]:
    """Sequences of ``split`` from ``pages`` pages drawn at random from ``seed`` (the validator's
    reference and held-out scoring batches): random data, a few ranged reads."""
    n = n_batches * batch_size
    per_draw = min(pages, n)
    tokens = dataset.train if split == "train" else dataset.val
    window_pages = _Pages(tokens, seq_len + 1, -(-n // per_draw))
    if window_pages.n < per_draw:
        raise ConfigError(f"{split} split of {len(tokens)} tokens is too small for {n} random sequences")
    gen = np.random.default_rng(_h("random", split, seed, dataset.digest))
    chosen = np.sort(gen.choice(window_pages.n, size=per_draw, replace=False))
    starts = window_pages.starts(chosen, 0)
    picked = starts[gen.permutation(len(starts))[:n]]
    return list(torch.split(_stack(dataset, split, picked, seq_len + 1), batch_size))


def validation_batches(dataset: TokenDataset, n_sequences: int, batch_size: int, seq_len: int) -> list[Tensor]:
    """A fixed set of held-out sequences, evenly spaced over the val split (same for everyone)."""
    span = seq_len + 1
    n_slots = len(dataset.val) // span
    if n_slots < 1:
        raise ConfigError(f"validation split of {len(dataset.val)} tokens is shorter than one sequence")
    n = min(n_sequences, n_slots)
    starts = (np.arange(n, dtype=np.int64) * n_slots // n) * span
    return list(torch.split(_stack(dataset, "val", starts, span), batch_size))


def _stack(dataset: TokenDataset, split: str, starts: np.ndarray, length: int) -> Tensor:
    """The sequences at ``starts`` as one int64 tensor, their tokens made local first."""
    tokens = dataset.split(split)
    dataset.need(split, [(int(s), length) for s in starts])
    rows = [tokens.read(int(s), length).astype(np.int64) for s in starts]
    return torch.from_numpy(np.stack(rows))


def pipeline_data_key(group: str) -> str:
    """The name under which a pipeline replica's batches are assigned (for
    :func:`assigned_batches`): every stage of replica ``group`` trains on the same batches, and
    the validator scores each stage's contribution on them."""
    return f"pipeline:{group}"
