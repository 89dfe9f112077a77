"""Creating a run from a corpus: ``sparseloco-validator init``.

One command takes an operator from text to a run peers can join::

    sparseloco-validator init --corpus corpus/ --corpus builtin:stdlib --store s3://bucket/runs \\
        --key validator.pem [--tokenizer tokenizer.json] [--preset demo | --spec base.toml] --out run.toml

1. tokenize the corpus once into content-addressed shards (:mod:`validator.dataset`);
2. build the RunSpec: the base (a preset or ``--spec``) with the dataset digest and the tokenizer
   digest in ``data``, this key among ``validator.public_keys`` and ``model.vocab_size`` at least
   the tokenizer's. The dataset digest is the hash of the manifest's body, so it exists before the
   run hash, which covers it;
3. put the tokenizer file, the shards and the manifest, signed for that run hash, under
   ``<run>/data/`` of the store;
4. write ``run.toml``: the RunSpec, and a ``[local]`` table with the store (and the base's own
   ``[local]`` table).

The validator publishes the genesis checkpoint (θ₀, which opens window 0) when it first starts
(``sparseloco-validator run``, after ``--wait-for-peers`` if given): a window opens when its
validator is there to gather it. Every step can be repeated: objects are content-addressed or
created once. ``run.toml`` itself is never overwritten.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import protocol
from protocol import layout
from protocol.config import MODEL_PRESETS, RunSpec
from protocol.data.assignment import assigned_starts, random_batches, validation_batches
from protocol.data.tokenizer import HFTokenizer, load_tokenizer
from protocol.errors import ConfigError
from protocol.files import atomic_write
from protocol.identity import Identity
from protocol.settings import StoreSettings, local_table, local_table_toml
from protocol.store import open_from_settings
from validator.dataset import (
    DEFAULT_SHARD_TOKENS,
    BuiltDataset,
    Progress,
    build_dataset,
    corpus_bytes,
    publish_dataset,
)

__all__ = ["PRESETS", "InitResult", "InitSteps", "base_spec", "init_run"]

PRESETS = Path(protocol.__file__).parent / "presets"


@dataclass(frozen=True)
class InitResult:
    """The run ``init`` created: its RunSpec and identity, and what its dataset holds."""

    spec: RunSpec
    run_id: str
    run_hash: str
    dataset: str
    shards: int
    train_tokens: int
    val_tokens: int
    data_bytes: int
    documents: int
    out: Path


class InitSteps(Protocol):
    """Where ``init`` reports its progress: each step gets its total and returns the callback it
    reports processed bytes to (or None)."""

    def tokenizing(self, total_bytes: int) -> Progress | None: ...

    def uploading(self, total_bytes: int) -> Progress | None: ...


class _Quiet:
    def tokenizing(self, total_bytes: int) -> Progress | None:
        return None

    def uploading(self, total_bytes: int) -> Progress | None:
        return None


def base_spec(preset: str | None, spec_path: str | None) -> tuple[RunSpec, dict[str, Any]]:
    """The RunSpec a run starts from and its ``[local]`` table: ``--spec FILE``, ``--preset NAME``
    (a file of ``protocol/presets/`` or a model preset on the default RunSpec), or the default."""
    if preset is not None and spec_path is not None:
        raise ConfigError("give --preset or --spec, not both")
    if spec_path is not None:
        return RunSpec.load(spec_path), local_table(spec_path)
    if preset is None:
        return RunSpec.default(), {}
    path = PRESETS / f"{preset}.toml"
    if path.is_file():
        return RunSpec.load(path), local_table(path)
    if preset in MODEL_PRESETS:
        return RunSpec.default().replace(model={"preset": preset, **MODEL_PRESETS[preset]}), {}
    known = sorted({p.stem for p in PRESETS.glob("*.toml")} | set(MODEL_PRESETS))
    raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(known)}")


def init_run(
    corpus: Sequence[str],
    *,
    base: RunSpec,
    local: Mapping[str, Any],
    store: StoreSettings,
    identity: Identity,
    out: str | Path,
    tokenizer: str = "bytes",
    name: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    text_field: str = "text",
    steps: InitSteps | None = None,
) -> InitResult:
    """Create the run (see the module docstring) in ``store`` (credentials come from the
    environment). ``local``: the ``[local]`` table written to ``out``, which names that store."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: init writes a new run.toml")
    steps = steps or _Quiet()
    tok = load_tokenizer(tokenizer) if tokenizer == "bytes" else HFTokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sparseloco-init-", dir=out.parent) as work:
        built = build_dataset(
            corpus,
            tok,
            val_fraction=base.data.val_fraction,
            work=Path(work),
            shard_tokens=shard_tokens,
            text_field=text_field,
            progress=steps.tokenizing(corpus_bytes(corpus)),
        )
        spec = _run_spec(base, built, identity, name)
        _check_fits(spec, built)
        run_hash = spec.hash()
        run = layout.run_id(run_hash)
        with open_from_settings(store, identity=identity, validator_keys=spec.validator.public_keys) as objects:
            publish_dataset(objects, run, run_hash, built, identity, progress=steps.uploading(built.total_bytes()))
    atomic_write(out, (spec.to_toml() + local_table_toml(local)).encode(), exclusive=True)
    m = built.manifest
    return InitResult(
        spec=spec,
        run_id=run,
        run_hash=run_hash,
        dataset=built.digest,
        shards=len(m.shards),
        train_tokens=sum(s.tokens for s in m.split("train")),
        val_tokens=sum(s.tokens for s in m.split("val")),
        data_bytes=built.total_bytes(),
        documents=built.documents,
        out=out,
    )


def _run_spec(base: RunSpec, built: BuiltDataset, identity: Identity, name: str | None) -> RunSpec:
    """The base RunSpec with the dataset, its tokenizer and this validator key."""
    m = built.manifest
    keys = sorted(set(base.validator.public_keys) | {identity.public_key_hex})
    return base.replace(
        name=name or base.name,
        model={"vocab_size": max(base.model.vocab_size, m.vocab_size)},
        data={"tokenizer": m.tokenizer, "dataset": built.digest},
        validator={"public_keys": keys},
    )


def _check_fits(spec: RunSpec, built: BuiltDataset) -> None:
    """ConfigError unless the dataset feeds at least one peer a window, the validator's random
    reference sequences and one validation sequence (better at init than at the first window)."""
    d, ds = spec.data, built.local
    assigned_starts(ds, spec.seed, 0, 0, spec.inner.steps, d.batch_size, d.seq_len, pages=d.pages)
    random_batches(ds, 0, -(-spec.validator.eval_sequences // d.batch_size), d.batch_size, d.seq_len)
    validation_batches(ds, 1, d.batch_size, d.seq_len)
