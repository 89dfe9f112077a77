"""RunSpec: the frozen dataclass tree that defines a run, loaded from TOML.

A run is everything participants must agree on: model, data shape and tokenizer, inner and outer
optimisers, codec, window timing, validator policy and keys, pipeline. Its canonical hash
(:meth:`RunSpec.hash`) names the run; every signed object carries it, so objects of another run or
another version are rejected.

What one machine decides for itself (where the store is and how to reach it, where its data
cache lives, poll interval, device, threads …) is *not* here: those are local settings
(:mod:`protocol.settings`), read from ``run.toml``'s ``[local]`` table among other places and never
hashed. Two participants whose files differ only in ``[local]`` are in the same run.

The hash is taken over normalised values: floats are floats (``lr = 1`` and ``lr = 1.0`` are the
same run), validator keys are lower-case, sorted and unique.

Each component receives only its own subtree (``spec.codec``, ``spec.inner`` ...). Unknown keys in
the TOML are errors, and there are no defaults scattered at call sites: the defaults live here.

    spec = RunSpec.load("run.toml")          # or RunSpec.default() / RunSpec.from_dict({...})
    spec.hash()                              # 64 hex chars
    spec.replace(inner={"steps": 30})        # a modified copy (tests, sweeps)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    # Installed only on Python < 3.11; absent when a newer interpreter checks for 3.10.
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from protocol.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


@dataclass(frozen=True)
class ModelConfig:
    """LLaMA-style decoder shape. ``preset`` is informational once the fields are resolved."""

    preset: str = "tiny"
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 688
    max_seq_len: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    init_seed: int = 0

    def __post_init__(self) -> None:
        _require(self.dim % self.n_heads == 0, "model.dim must be divisible by model.n_heads")
        _require((self.dim // self.n_heads) % 2 == 0, "model head dim must be even (RoPE)")
        _require(min(self.vocab_size, self.dim, self.n_layers, self.ffn_dim) > 0, "model sizes must be > 0")


# Named sizes. `512m` is the paper's model (hidden 1536, 12 layers, 12 heads, FFN 5440, ctx 2048).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=256, n_layers=4, n_heads=4, ffn_dim=688, max_seq_len=256),
    "small": dict(dim=512, n_layers=8, n_heads=8, ffn_dim=1376, max_seq_len=512),
    "150m": dict(dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=1024, vocab_size=32000),
    "512m": dict(dim=1536, n_layers=12, n_heads=12, ffn_dim=5440, max_seq_len=2048, vocab_size=32000),
    "1b": dict(dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, max_seq_len=2048, vocab_size=32000),
}


@dataclass(frozen=True)
class DataConfig:
    """The run's dataset and how its tokens are cut into batches.

    ``dataset``: the digest of the run's signed dataset manifest (``<run>/data/manifest`` in the
    run's store, :mod:`protocol.wire.dataset`), written by ``sparseloco-validator init``; every
    peer and the validator read the same shards from the store. Empty only for in-process runs on
    local data (the simulator, tests), which the commands refuse. ``tokenizer``: ``bytes`` or
    ``hf:<sha256 of the tokenizer.json>`` (in the store next to the shards); a path to a
    tokenizer.json serves local data only. ``batch_size`` sequences of ``seq_len`` tokens per inner
    step per replica; ``val_fraction``: the share of the corpus ``init`` holds out for validation.
    ``pages``: how many places of the whole dataset a peer's sequences of one window come from
    (runs of consecutive sequences, :mod:`protocol.data.assignment`): more pages, more diverse
    replicas and batches, at one ranged read of the store each.
    """

    tokenizer: str = "bytes"
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.02
    dataset: str = ""
    pages: int = 64

    def __post_init__(self) -> None:
        _require(self.seq_len > 1 and self.batch_size > 0, "data.seq_len > 1 and data.batch_size > 0")
        _require(0.0 < self.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")
        _require(1 <= self.pages <= 4096, "data.pages must be in [1, 4096]")
        _require(
            self.dataset == "" or re.fullmatch(r"[0-9a-f]{64}", self.dataset) is not None,
            "data.dataset must be the 64 lowercase hex digest of the run's dataset manifest",
        )


@dataclass(frozen=True)
class InnerConfig:
    """Inner AdamW (per replica): H steps per window, warm-up then cosine to ``min_lr_ratio``."""

    steps: int = 15
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 30
    total_steps: int = 3000  # length of the cosine schedule, in inner steps
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _require(self.steps > 0, "inner.steps must be > 0")
        _require(self.lr > 0, "inner.lr must be > 0")


@dataclass(frozen=True)
class CodecConfig:
    """Chunk-wise Top-k + quantization of pseudo-gradients.

    2-D tensors are cut in ``block``×``block`` tiles (largest divisor ≤ block per dimension when a
    dimension is not a multiple), 1-D in contiguous chunks of ≤ ``chunk_1d``. ``k`` values are kept
    per 4096 values, scaled for smaller chunks. ``value_bits``: 2, the only value width the codec
    has (2-bit sign + level codes). ``index_coding``: ``rice`` (compact, near the information bound)
    or ``packed12`` (baseline).
    """

    block: int = 64
    chunk_1d: int = 4096
    k: int = 64
    value_bits: int = 2
    index_coding: str = "rice"

    def __post_init__(self) -> None:
        _require(self.block > 0 and self.chunk_1d > 0, "codec.block and codec.chunk_1d must be > 0")
        _require(0 < self.k <= 4096, "codec.k must be in 1..4096")
        _require(self.value_bits == 2, "codec.value_bits must be 2 (2-bit codes are the only value mode)")
        _require(self.index_coding in ("rice", "packed12"), "codec.index_coding must be rice|packed12")


@dataclass(frozen=True)
class OuterConfig:
    """Outer step: θ ← θ − α·Δ̄, with Δ̄ the aggregate of the contributions (α applied once).

    ``recompress``: the validator publishes Δ̄ of at least ``recompress_from`` contributions
    compressed like a contribution — chunk-wise Top-k of ``recompress_k`` values per 4096 (times
    the window's k over ``codec.k`` in a Top-k warm-up) and 2-bit codes (``codec``'s chunking and
    index coding) — of its own error-feedback buffer
    ``e ← recompress_beta·e + Δ̄``, so that every peer downloads a contribution-sized object instead
    of the union of all Top-k sets. Δ̄ of fewer contributions, or with ``recompress`` off, travels
    with bfloat16 values (:mod:`protocol.broadcast`). Either way every participant applies exactly
    what was signed. The defaults are the best measured points (BENCHMARKS.md): re-compressing cost
    loss at 4 contributors and gained it at 16 and 32, with a download that no longer grows with
    the swarm; at k = 64 and 128 every decay > 0 tried ended at a higher loss than none (what the
    buffer sends late, the peers have partly learned again by then), so by default what Top-k
    leaves out is dropped and no buffer is kept.

    ``delay``: 0 is the synchronous schedule (a peer waits for aggregate t−1 before it trains
    window t). 1 overlaps a peer's training of window t with the gathering, scoring and publishing
    of window t−1: the peer starts from the newest θ it holds (θ_t−1) and, when aggregate t−1
    arrives, applies it to θ and to its working model alike and trains on; its Δ is then taken
    against θ_t. ``overlap`` bounds how much of a window is trained before that aggregate has
    arrived: a peer that has taken ``overlap``·H inner steps without it waits for it there (0.0 is
    the synchronous schedule again). With ``overlap = 1.0`` a window may end before the aggregate
    arrives; its Δ is then taken against θ_t−1 and the validator applies it to θ_t one window late
    (a one-window-delayed outer step: it accepts a ``base`` one aggregate old whenever ``delay`` is
    1). θ itself changes only by signed aggregates, so every participant stays bit-identical.
    ``eager`` (delay 1; nothing with delay 0): until the aggregate arrives, the peer trains from θ_t−1 − α·Δ̄′, where Δ̄′
    is the aggregate forecast from the window's contributions already in the store (its own
    included, by the validator's aggregation rule: :mod:`client.forecast`); when the validator
    accepts those, Δ̄′ is Δ̄ and the working model is exactly where a synchronous peer's would be.
    ``forecast_wait`` (eager): before its first inner step a peer waits until the forecast holds a
    contribution of every peer of the last aggregate (or the aggregate itself is out), for at most
    this share of the time its own inner steps of a window take; 0 starts at once. Inner steps
    trained from a forecast of the peer's own contribution alone cost 0.7–2.0 % of final loss at
    10 % of a window (its R² against the aggregate was 0.28 at 4 peers); waiting for the others'
    uploads costs the spread of their upload times, not the validator's gather, scoring and publish
    that the overlap hides (BENCHMARKS.md).

    ``warmup_k``, ``warmup_windows``: a Top-k warm-up. Window w's contributions keep
    :meth:`k_at` values per 4096 — ``warmup_k`` at window 0, falling linearly (integer arithmetic)
    to ``codec.k`` at window ``warmup_windows``, ``codec.k`` from there on — so that the first
    windows, where the pseudo-gradients are largest and the error feedback has not built up, send
    more of them. Peers compress window w with :meth:`RunSpec.codec_at` (w), contributions carry that
    codec, the validator checks it, and the read caps allow the largest k (:mod:`protocol.caps`).
    The default, 512 falling to 64 over 4 windows (512, 400, 288, 176, then ``codec.k``), took
    SparseLoCo from 0.12 nats behind DiLoCo to 0.03–0.04 ahead at H = 30 over 12 windows, for 1.9×
    the bytes of those 12 windows; at H = 15 SparseLoCo ends level with and without it. Final
    validation loss without → with it: 2.0904 → 2.0386 at the ``quick`` point of
    ``scripts/bench_quality.py``, 2.3872 → 2.3764 on an unseen Perl corpus (BENCHMARKS.md).
    ``warmup_k = 0``: no warm-up, ``codec.k`` in every window.
    """

    alpha: float = 1.0
    beta: float = 0.9  # error-feedback decay (0.9 against 0.95: 0.03–0.08 nats better, BENCHMARKS.md)
    aggregation: str = "contributors"  # contributors | all  (mean over contributors / over all R)
    clip: str = "median"  # median | none
    momentum: float = 0.9  # Nesterov momentum of the DiLoCo baseline (client/simulator.py) only
    recompress: bool = True
    recompress_from: int = 8  # contributions from which Δ̄ is re-compressed (when ``recompress``)
    recompress_k: int = 128  # values per 4096 the validator's Top-k keeps (× the window's k / codec.k in a warm-up)
    recompress_beta: float = 0.0  # decay of the validator's error-feedback buffer (0: none kept)
    delay: int = 1  # 0: synchronous; 1: train window t while aggregate t−1 is in flight
    overlap: float = 0.5  # delay 1: share of a window's inner steps trained before aggregate t−1 must be in
    eager: bool = True  # delay 1: train from θ − α·(forecast of that aggregate) until it arrives
    forecast_wait: float = 0.1  # eager: longest wait for the others' uploads (share of a window's inner steps)
    warmup_k: int = 512  # Top-k warm-up: codec k (values per 4096) of window 0; 0 = none (codec.k throughout)
    warmup_windows: int = 4  # windows over which k goes linearly from warmup_k to codec.k (512, 400, 288, 176)

    def __post_init__(self) -> None:
        _require(self.aggregation in ("contributors", "all"), "outer.aggregation must be contributors|all")
        _require(self.clip in ("median", "none"), "outer.clip must be median|none")
        _require(0 < self.recompress_k <= 4096, "outer.recompress_k must be in 1..4096")
        _require(self.recompress_from >= 1, "outer.recompress_from must be >= 1")
        _require(0.0 <= self.recompress_beta <= 1.0, "outer.recompress_beta must be in [0, 1]")
        _require(self.delay in (0, 1), "outer.delay must be 0 (synchronous) or 1 (overlapped)")
        _require(0.0 <= self.overlap <= 1.0, "outer.overlap must be in [0, 1]")
        _require(0.0 <= self.forecast_wait <= 1.0, "outer.forecast_wait must be in [0, 1]")
        _require(0 <= self.warmup_k <= 4096, "outer.warmup_k must be in 0..4096 (0 = no Top-k warm-up)")
        _require(self.warmup_windows >= 0, "outer.warmup_windows must be >= 0")
        _require(self.warmup_k == 0 or self.warmup_windows > 0, "outer.warmup_k needs outer.warmup_windows > 0")

    def k_at(self, window: int, k: int) -> int:
        """Values kept per 4096 in ``window`` for a codec of ``k``: ``warmup_k`` at window 0, then
        linearly (integer arithmetic, so every participant gets the same value) to ``k`` at window
        ``warmup_windows`` and ``k`` from there on; ``k`` throughout without a warm-up."""
        if self.warmup_k == 0 or window >= self.warmup_windows:
            return k
        return self.warmup_k - (self.warmup_k - k) * max(window, 0) // self.warmup_windows

    def max_k(self, k: int) -> int:
        """The largest k of any window (what caps on contribution size must allow)."""
        return max(k, self.warmup_k)

    def overlap_steps(self, steps: int) -> int:
        """Inner steps of a window a peer may train before the aggregate in flight has arrived
        (0 with the synchronous schedule)."""
        return int(self.overlap * steps) if self.delay else 0


@dataclass(frozen=True)
class WindowConfig:
    """Window timing. A window opens when aggregate t−1 is published (or at genesis)."""

    upload_deadline_s: float = 600.0  # after the window opens
    gather_grace_s: float = 5.0  # validator waits this long past the deadline for slow listings
    checkpoint_every: int = 5


@dataclass(frozen=True)
class ValidatorConfig:
    """Who may sign aggregates and how contributions are checked and scored."""

    public_keys: tuple[str, ...] = ()  # hex Ed25519 public keys allowed to sign aggregates/checkpoints
    # Read caps of signed objects; 0 = derived from the model size, the codec, max_contributors and
    # the aggregate's encoding (protocol.caps), which is what peers and the validator both use.
    max_contribution_bytes: int = 0
    max_aggregate_bytes: int = 0
    eval_peers_per_window: int = 8  # loss-scoring budget
    # Of those, the slots reserved for identities on probation (more when fewer established
    # peers need scoring): a flood of new identities cannot crowd out the scoring of known ones.
    eval_probation_peers: int = 4
    eval_sequences: int = 16
    eval_scale: float = 1.0  # update scale applied when measuring loss after
    # An update that raises the loss on held-out random data by more than this fraction is harmful.
    eval_harm_tolerance: float = 0.002
    # An update that lowers the loss on its own data by less than this share of what the
    # established peers' updates achieve in the same window is ineffective.
    eval_min_gain_ratio: float = 0.25
    # The three harm/effect verdicts reject only when the evidence clears the noise of the loss
    # estimate: by this many standard errors of the paired per-sequence differences
    # (validator/significance.py). 0: the rule without error bars.
    eval_confidence_z: float = 3.0
    # A verdict the point estimate fails but the error bar does not is measured again on this many
    # own and random sequences (0 or <= eval_sequences: never).
    eval_borderline_sequences: int = 64
    # Norms are compared with the validator's reference (per tensor, from accepted updates of
    # earlier windows; validator/reference.py): above norm_max_ratio × it in any tensor is an
    # outlier, a total below norm_min_ratio × it too small to count.
    norm_max_ratio: float = 10.0
    norm_min_ratio: float = 0.1
    reference_step: float = 2.0  # the reference moves by at most this factor per window
    # Only the clipped norms of senior peers move the reference: established for at least this many
    # windows in which they uploaded (new or recently established keys cannot move it).
    reference_seniority: int = 2
    # The reference stays within this factor of its long-horizon baseline, a geometric moving
    # average of the reference over about reference_horizon windows: however many windows a group
    # pushes, it drifts by at most this factor plus what the slow baseline follows.
    reference_epoch_factor: float = 2.0
    reference_horizon: int = 16
    clip_headroom: float = 2.0  # clip caps lie between the reference and headroom × it
    row_clip: bool = True  # cap every row of a matrix too, not only the whole tensor
    # A contribution with a row above this × the row's typical change in the window (as sent,
    # validator/concentration.py) is concentrated: scored whenever up to eval_peers_per_window more
    # slots allow, its row caps without clip_headroom when it is not. 0: off.
    row_excess_ratio: float = 4.0
    # A scored update that raises the held-out binary log-loss of the tokens whose rows it moves most
    # by more than this share (+ eval_confidence_z standard errors) is targeted. 0: off.
    eval_target_tolerance: float = 0.5
    copy_overlap_threshold: float = 0.6
    # A later upload sharing this share of an earlier one's rare positions (selected by few
    # others), with signs agreeing at least copy_sign_agreement, is a copy.
    copy_rare_threshold: float = 0.3
    copy_sign_agreement: float = 0.8
    # Below the copy thresholds a later upload's weight in the aggregate falls linearly from 1 at
    # these lower bounds (above what honest peers share; scripts/bench_copy_similarity.py) to 0
    # at copy_overlap_threshold / copy_rare_threshold (validator/copies.py). A bound at or above
    # its threshold: full weight up to the threshold.
    copy_overlap_lower: float = 0.57
    copy_rare_lower: float = 0.28
    reputation_decay: float = 0.9
    exclude_after_failures: int = 3
    exclude_windows: int = 5
    # A new identity is on probation until this many of its updates were scored and accepted:
    # until then only its scored, helpful updates count. Accepted windows in which it was not
    # scored neither count as a pass nor clear a failure.
    probation_passes: int = 3
    # An identity on probation with a pass and no scored failure since counts in windows it is
    # not scored in too, at this share of the newcomer caps (≤ the reference); 0: it does not
    # (BENCHMARKS.md: it lets noise that once passed a score in).
    probation_partial: float = 0.0
    max_contributors: int = 64
    # Several validators (protocol/quorum.py): an aggregate counts once this many distinct keys of
    # public_keys signed its digest. 0: a majority of the keys (1 of 1, 2 of 3, 3 of 4). Every two
    # quorums must share a validator (2 × quorum > number of keys), or two aggregates of one window
    # could both count without any fault.
    quorum: int = 0
    # How long the validators wait for the leader of a view to propose before the next key in the
    # rotation proposes (seconds after a validator closed the window's intake). 0: derived,
    # max(10, upload_deadline_s / 2) (protocol/quorum.py).
    handover_s: float = 0.0

    @property
    def signing_quorum(self) -> int:
        """m: how many distinct validator keys must sign one aggregate (``quorum``, or a majority)."""
        return self.quorum or len(self.public_keys) // 2 + 1

    def __post_init__(self) -> None:
        _require(self.max_contribution_bytes >= 0, "validator.max_contribution_bytes must be >= 0 (0 = derived)")
        _require(self.max_aggregate_bytes >= 0, "validator.max_aggregate_bytes must be >= 0 (0 = derived)")
        _require(
            math.isfinite(self.eval_confidence_z) and self.eval_confidence_z >= 0,
            "validator.eval_confidence_z must be a finite number >= 0 (0 = no error bars)",
        )
        _require(self.eval_borderline_sequences >= 0, "validator.eval_borderline_sequences must be >= 0")
        for name in ("copy_overlap_lower", "copy_rare_lower"):
            value = getattr(self, name)
            _require(math.isfinite(value) and 0.0 <= value <= 1.0, f"validator.{name} must be in [0, 1]")
        _require(0.0 <= self.probation_partial <= 1.0, "validator.probation_partial must be in [0, 1]")
        _require(self.reference_seniority >= 0, "validator.reference_seniority must be >= 0")
        _require(
            math.isfinite(self.reference_epoch_factor) and self.reference_epoch_factor >= 1.0,
            "validator.reference_epoch_factor must be a finite number >= 1",
        )
        _require(self.reference_horizon >= 1, "validator.reference_horizon must be >= 1")
        _require(
            math.isfinite(self.row_excess_ratio) and self.row_excess_ratio >= 0,
            "validator.row_excess_ratio must be a finite number >= 0 (0 = off)",
        )
        _require(
            math.isfinite(self.eval_target_tolerance) and self.eval_target_tolerance >= 0,
            "validator.eval_target_tolerance must be a finite number >= 0 (0 = off)",
        )
        # One run, one hash: key order, duplicates and hex letter case do not make another run.
        keys = tuple(sorted({k.lower() for k in self.public_keys}))
        bad = [k for k in keys if not _HEX_KEY.fullmatch(k)]
        _require(not bad, f"validator.public_keys must be 64 hex characters each, got {bad!r}")
        object.__setattr__(self, "public_keys", keys)
        _check_quorum(len(keys), self.quorum)
        _require(
            math.isfinite(self.handover_s) and self.handover_s >= 0, "validator.handover_s must be >= 0 (0 = derived)"
        )


def _check_quorum(n: int, quorum: int) -> None:
    """Reject a quorum that cannot be met, or under which two different aggregates of one window
    could both be signed by a quorum with every validator honest (two quorums that need not share
    a validator: a handover race alone forks the run). What a safe quorum tolerates is
    :func:`protocol.quorum.tolerance`."""
    _require(quorum >= 0, "validator.quorum must be >= 0 (0 = a majority of validator.public_keys)")
    if n == 0 or quorum == 0:
        return
    _require(
        quorum <= n,
        f"validator.quorum = {quorum} needs more signatures than the {n} keys of validator.public_keys can give",
    )
    _require(
        2 * quorum > n,
        f"validator.quorum = {quorum} of {n} keys is unsafe: two groups of {quorum} validators need not "
        f"share one, so two different aggregates of a window could both be signed (a fork) even when "
        f"every validator is honest; use at least {n // 2 + 1} (a majority; docs/JOINING.md, "
        "section Several validators, says what each choice tolerates)",
    )


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline replicas (stages of small GPUs) and subspace compression of their activations.

    ``enabled``: pipeline replicas may join this run. Activations crossing a stage boundary are
    projected on a fixed rank-k subspace, k = model.dim // ``compression_ratio`` (1 = uncompressed).
    ``selective``: only pipeline replicas compress (the paper's choice); false makes full replicas
    train under the same constraint with virtual boundaries after every ``stages``-way split.
    ``micro_batches`` per inner step (GPipe); ``timeout_s`` bounds every wait on another stage once
    the stages have met, ``rendezvous_timeout_s`` how long they wait for each other at a window start.
    """

    enabled: bool = False
    compression_ratio: int = 32
    selective: bool = True
    stages: int = 2
    micro_batches: int = 4
    timeout_s: float = 60.0
    rendezvous_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _require(self.compression_ratio >= 1, "pipeline.compression_ratio must be >= 1")
        _require(self.stages >= 2, "pipeline.stages must be >= 2")
        _require(self.micro_batches >= 1, "pipeline.micro_batches must be >= 1")
        _require(self.timeout_s > 0, "pipeline.timeout_s must be > 0")


@dataclass(frozen=True)
class RunSpec:
    name: str = "local"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    windows: WindowConfig = field(default_factory=WindowConfig)
    validator: ValidatorConfig = field(default_factory=ValidatorConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    # ---------------------------------------------------------------- construction
    @classmethod
    def default(cls) -> RunSpec:
        return cls()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunSpec:
        raw = dict(raw)
        model = raw.get("model")
        if isinstance(model, Mapping):
            raw["model"] = resolve_model_preset(model)
        return from_table(cls, raw)

    @classmethod
    def loads(cls, text: str) -> RunSpec:
        """The RunSpec of a run.toml text; its ``[local]`` table is not part of it (see
        :func:`protocol.settings.local_table`)."""
        raw = parse_toml(text)
        raw.pop(LOCAL_TABLE, None)
        return cls.from_dict(raw)

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"RunSpec file not found: {p}")
        return cls.loads(p.read_text())

    # ---------------------------------------------------------------- identity
    def to_dict(self) -> dict[str, Any]:
        plain: dict[str, Any] = _to_plain(self)
        return plain

    def canonical_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def hash(self) -> str:
        """sha256 of the canonical JSON form; names the run in every signed object."""
        return hashlib.sha256(self.canonical_json()).hexdigest()

    def to_toml(self) -> str:
        return _dict_to_toml(self.to_dict())

    def codec_at(self, window: int) -> CodecConfig:
        """The codec of ``window`` (``outer.warmup_k``: a larger k in the first windows)."""
        return codec_at(self.codec, self.outer, window)

    def replace(self, **sections: Any) -> RunSpec:
        """Copy with some fields replaced. Section values may be dicts of field overrides."""
        raw = self.to_dict()
        for key, value in sections.items():
            if key not in raw:
                raise ConfigError(f"unknown RunSpec field {key!r}")
            if isinstance(value, Mapping) and isinstance(raw[key], dict):
                raw[key] = {**raw[key], **value}
            elif dataclasses.is_dataclass(value):
                raw[key] = _to_plain(value)
            else:
                raw[key] = value
        return from_table(RunSpec, raw)


def codec_at(codec: CodecConfig, outer: OuterConfig, window: int) -> CodecConfig:
    """The codec of ``window``: ``codec`` with the k of :meth:`OuterConfig.k_at` (the Top-k
    warm-up). Peers compress with it, contributions carry it and the validator checks it, so it is
    a function of the RunSpec and the window only."""
    k = outer.k_at(window, codec.k)
    return codec if k == codec.k else dataclasses.replace(codec, k=k)


def resolve_model_preset(model: Mapping[str, Any]) -> dict[str, Any]:
    """Expand ``preset = "small"`` into its fields; explicit fields override the preset."""
    model = dict(model)
    name = model.get("preset", "tiny")
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    return {**MODEL_PRESETS[name], **model, "preset": name}


def model_config(preset: str, **overrides: Any) -> ModelConfig:
    return from_table(ModelConfig, resolve_model_preset({"preset": preset, **overrides}), prefix="model.")


# -------------------------------------------------------------------- helpers
#: The table of run.toml that holds local settings (protocol.settings), never part of the RunSpec.
LOCAL_TABLE = "local"

_HEX_KEY = re.compile(r"[0-9a-f]{64}")

# Keys that used to be RunSpec fields and are local settings now: a run.toml written for an older
# version gets told where each one went instead of a bare "unknown key".
_MOVED = {
    "storage": "[local.store] (url, s3_endpoint, s3_region, dht_bootstrap)",
    "data.source": "nothing (the run's dataset lies in its store: sparseloco-validator init)",
    "data.micro_batch_size": "[local.compute] micro_batch_size",
    "windows.poll_interval_s": "[local] poll_interval_s",
    "windows.max_windows": "[local] max_windows",
    "validator.max_gather_concurrency": "[local.validator] gather_concurrency",
    "validator.active_windows": "nothing (the validator now waits for the peers that uploaded last window)",
    "validator.announcement_ttl_s": "nothing (the validator now waits for the peers that uploaded last window)",
}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def parse_toml(text: str) -> dict[str, Any]:
    """``text`` as TOML; ConfigError when it does not parse."""
    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"TOML does not parse: {exc}") from exc
    return raw


def from_table(cls: type[T], raw: Mapping[str, Any], *, prefix: str = "", table: str = "RunSpec") -> T:
    """Build the frozen dataclass ``cls`` from a TOML table: unknown keys are errors, values are
    checked against the field types (ints become floats where a float is due). ``prefix`` names
    the table's position (``"model."``) and ``table`` the file part it comes from, in messages."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or table} must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        names = [_moved_hint(prefix + k) if table == "RunSpec" else prefix + k for k in unknown]
        raise ConfigError(f"unknown key(s) in {table}: {', '.join(names)}")
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name, table)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad {table} section {prefix or 'root'}: {exc}") from exc


def _moved_hint(key: str) -> str:
    return f"{key} (a local setting now: {_MOVED[key]})" if key in _MOVED else key


def _coerce(tp: Any, value: Any, where: str, table: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        return from_table(tp, value, prefix=where + ".", table=table)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be an array")
        args = typing.get_args(tp)
        item_tp = args[0]
        if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:
            return tuple(_coerce(item_tp, v, where, table) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{where} must have {len(args)} items")
        return tuple(_coerce(a, v, where, table) for a, v in zip(args, value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be finite, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    return value


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def toml_value(v: Any) -> str:
    """One TOML value (bool, number, string or array of them)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to TOML")


def _dict_to_toml(d: Mapping[str, Any]) -> str:
    lines = [f"{k} = {toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            lines.extend(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
    return "\n".join(lines) + "\n"
