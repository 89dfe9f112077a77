#!/usr/bin/env python
"""Turn text into token shards (the format protocol/data.py memory-maps).

    python scripts/prepare_data.py --out data/stdlib builtin:stdlib
    python scripts/prepare_data.py --out data/mytext corpus/ notes.txt --tokenizer tokenizer.json
    python scripts/prepare_data.py --out data/fineweb --hf-dataset HuggingFaceFW/fineweb-edu \\
        --hf-config sample-10BT --max-docs 100000          # needs `datasets` and network access

Point a machine at the result with the local setting ``[local.data] source = "data/stdlib"``
(or ``SPARSELOCO_DATA_SOURCE=data/stdlib``). The printed digest identifies the
shards; every participant of a run should see the same one.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

from protocol.data import stdlib_documents, text_documents, write_shards
from protocol.errors import ConfigError
from protocol.tokenizer import load_tokenizer


def hf_documents(name: str, config: str | None, split: str, field: str) -> Iterator[tuple[str, bytes]]:
    """Stream a Hugging Face dataset's text field (imported lazily: an optional dependency)."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ConfigError("--hf-dataset needs the 'datasets' package: pip install 'sparseloco[hf]'") from exc
    for i, row in enumerate(datasets.load_dataset(name, config, split=split, streaming=True)):
        yield f"{name}/{split}/{i}", str(row[field]).encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="*", help="text files, directories, or builtin:stdlib")
    p.add_argument("--out", required=True, help="output shard directory (must not exist)")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' or a path to a tokenizer.json")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--hf-dataset", help="a Hugging Face dataset name (streamed)")
    p.add_argument("--hf-config")
    p.add_argument("--hf-split", default="train")
    p.add_argument("--hf-field", default="text")
    p.add_argument("--max-docs", type=int, default=0, help="stop after this many documents (0 = all)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        if out.exists():
            raise ConfigError(f"{out} exists; choose a new directory")
        if not args.sources and not args.hf_dataset:
            raise ConfigError("give at least one source or --hf-dataset")
        tokenizer = load_tokenizer(args.tokenizer)
        streams: list[Iterator[tuple[str, bytes]]] = []
        for src in args.sources:
            if src == "builtin:stdlib":
                streams.append(stdlib_documents())
            elif Path(src).exists():
                streams.append(text_documents(src))
            else:
                raise ConfigError(f"source not found: {src}")
        if args.hf_dataset:
            streams.append(hf_documents(args.hf_dataset, args.hf_config, args.hf_split, args.hf_field))
        docs: Iterator[tuple[str, bytes]] = itertools.chain(*streams)
        if args.max_docs:
            docs = itertools.islice(docs, args.max_docs)
        ds = write_shards(out, docs, tokenizer, args.val_fraction)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {len(ds.train):,} train + {len(ds.val):,} val tokens, vocab {ds.vocab_size}, digest {ds.digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
