#!/usr/bin/env python
"""What a peer fetches from the run's store per window, for a few ``data.pages``, against whole shards.

The run's dataset is built as ``sparseloco-validator init`` builds it (the demo's corpus and shard
size by default) and put into an in-memory store; each peer then reads its windows' batches
through the same code a peer runs (:class:`protocol.data.run_data.StoreBlocks`: ranged reads of
verified blocks, a cache of its own, the next window prefetched), and the store counts every
request and byte. The baseline is what fetching whole shards costs for the same windows: every
shard a window's pages touch that the peer did not hold yet, in full (what peers fetched before
blocks existed; a shard, once fetched, stays cached).

    python scripts/bench_data.py                       # the demo's window: H = 30, 32 × 128 tokens, 3 peers
    python scripts/bench_data.py --pages 4,16,64,256 --windows 6 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from protocol import layout
from protocol.data.assignment import assigned_batches, assigned_spans
from protocol.data.cache import BlockCache
from protocol.data.run_data import StoreBlocks
from protocol.data.tokenizer import ByteTokenizer
from protocol.data.tokens import TokenDataset
from protocol.identity import Identity
from protocol.store.memory import MemoryStore
from validator.dataset import DEFAULT_SHARD_TOKENS, BuiltDataset, build_dataset

RUN = "bench-data"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="builtin:stdlib", help="what init tokenizes (builtin:stdlib, text dir/file)")
    p.add_argument("--pages", default="4,16,64,256", help="comma-separated data.pages values")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=30, help="H")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--seed", type=int, default=0, help="the run seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def build(args: argparse.Namespace, work: Path) -> tuple[BuiltDataset, MemoryStore]:
    built = build_dataset(
        [args.corpus], ByteTokenizer(), val_fraction=0.02, work=work / "built", shard_tokens=args.shard_tokens
    )
    store = MemoryStore(f"bench-data-{time.monotonic_ns()}")
    for sha, path in built.files.items():
        store.put(layout.shard_key(RUN, sha), path.read_bytes())
    return built, store


def peer_dataset(built: BuiltDataset, store: MemoryStore, cache: Path) -> TokenDataset:
    access = StoreBlocks(store, RUN, built.manifest, BlockCache(cache))
    m = built.manifest
    return TokenDataset(
        cache, access.splits["train"], access.splits["val"], m.vocab_size, m.tokenizer, "d" * 64, access
    )


def measure(
    built: BuiltDataset, store: MemoryStore, pages: int, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """Bytes and requests per peer per window for ``pages``, with blocks and with whole shards."""
    window = (args.inner_steps, args.batch_size, args.seq_len)
    shard_bytes = [built.manifest.shard_bytes(s) for s in built.manifest.split("train")]
    before = dict(store.counts)
    blocks_bytes, shards_bytes, requests, hit_rates, trained = [], [], [], [], 0
    for p in range(args.peers):
        peer = Identity.from_seed(bytes([p + 1]) * 32).peer_id
        ds = peer_dataset(built, store, work / f"cache-{pages}-{p}")
        held: set[int] = set()
        for w in range(args.windows):
            used = ds.usage()
            assigned_batches(ds, args.seed, peer, w, *window, pages=pages)
            later = assigned_spans(ds, args.seed, peer, w + 1, *window, pages=pages)
            ds.prefetch("train", later)
            assert isinstance(ds.access, StoreBlocks) and ds.access.wait_prefetched(timeout=600)
            d = ds.usage() - used
            blocks_bytes.append(d.fetched_bytes)
            requests.append(d.requests)
            hit_rates.append(d.hits / max(1, d.hits + d.misses))
            touched = shards_of(ds, later)
            if w == 0:
                touched |= shards_of(ds, assigned_spans(ds, args.seed, peer, 0, *window, pages=pages))
            shards_bytes.append(sum(shard_bytes[i] for i in touched - held))
            held |= touched
            trained += args.inner_steps * args.batch_size * (args.seq_len + 1) * built.manifest.token_bytes
    gets = store.counts.get("get", 0) - before.get("get", 0)
    return {
        "pages": pages,
        "sequences_per_page": -(-args.inner_steps * args.batch_size // min(pages, args.inner_steps * args.batch_size)),
        "bytes_per_peer_per_window": statistics.mean(blocks_bytes),
        "requests_per_peer_per_window": statistics.mean(requests),
        "whole_shards_bytes_per_peer_per_window": statistics.mean(shards_bytes),
        "trained_bytes_per_peer_per_window": trained / (args.peers * args.windows),
        "hit_rate": statistics.mean(hit_rates),
        "store_gets": gets,
        "per_window_bytes": blocks_bytes,
    }


def shards_of(ds: TokenDataset, spans: list[tuple[int, int]]) -> set[int]:
    """The train shards the token ranges ``spans`` touch."""
    return {i for a, n in spans for i, _, _ in ds.train.pieces(a, n)}


def render(out: dict[str, Any], console: Console) -> None:
    t = Table(title=out["summary"])
    for col in (
        "pages",
        "seq / page",
        "blocks: B / window",
        "requests / window",
        "whole shards: B / window",
        "× less",
        "B trained / window",
        "hit rate",
    ):
        t.add_column(col, justify="right")
    for r in out["results"]:
        ratio = r["whole_shards_bytes_per_peer_per_window"] / max(1.0, r["bytes_per_peer_per_window"])
        t.add_row(
            str(r["pages"]),
            str(r["sequences_per_page"]),
            f"{r['bytes_per_peer_per_window']:,.0f}",
            f"{r['requests_per_peer_per_window']:.1f}",
            f"{r['whole_shards_bytes_per_peer_per_window']:,.0f}",
            f"{ratio:.1f}",
            f"{r['trained_bytes_per_peer_per_window']:,.0f}",
            f"{r['hit_rate']:.2f}",
        )
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        built, store = build(args, work)
        m = built.manifest
        log.log(
            f"built {len(m.shards)} shards, {sum(s.tokens for s in m.shards):,} tokens in {time.perf_counter() - t0:.1f} s"
        )
        results = []
        for pages in (int(p) for p in args.pages.split(",") if p):
            results.append(measure(built, store, pages, args, work))
            log.log(f"pages {pages}: {results[-1]['bytes_per_peer_per_window']:,.0f} B per peer per window")
        MemoryStore.forget(store.name)
    summary = (
        f"{args.corpus}: {sum(s.tokens for s in m.split('train')):,} train tokens in {len(m.split('train'))} shards of ≤ "
        f"{args.shard_tokens:,} tokens, blocks of {m.block_tokens} tokens; {args.peers} peers × {args.windows} windows "
        f"of H = {args.inner_steps}, {args.batch_size} × {args.seq_len} tokens"
    )
    out = {"config": {**vars(args), "block_tokens": m.block_tokens}, "summary": summary, "results": results}
    if args.json:
        print(json.dumps(out))
    else:
        render(out, Console(width=180))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
