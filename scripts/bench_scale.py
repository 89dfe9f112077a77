#!/usr/bin/env python
"""Scale benchmark: what one validator window costs as peers and history grow, projected to a 1B model.

Everything runs in one process on the CPU, through the real code:

* **Peers.** The real :class:`validator.node.Validator` (memory store) gathers, checks, scores,
  aggregates and publishes window 1 of N ∈ {4, 16, 64, 256} signed contributions of the ``tiny``
  model (P = 3.3 M parameters, the run's codec: 1.56 % of the values kept). The peers are
  established (their standings are in the validator's state) and their updates are synthetic: a
  direction they share plus their own, so that two honest uploads overlap on ~12 % of their
  positions. Window 0 (not timed) sets the norm reference. ``validator_growth_exponent`` is x
  fitted to seconds ∝ N^x.
* **Copies, baseline.** The same window's contributions through the one-pass copy scan and through
  the pairwise comparison it replaced (every peer against every earlier one; at N = 256 the
  pairwise time is extrapolated from a sample of pairs).
* **History.** A contribution log of T ∈ {10, 1 000, 10 000} windows × 256 synthetic rows: the log
  and state work of one window (previous window's rows, first-seen times, the window's rows,
  standings folded and saved), against the full-history fold (the standings re-read from the whole
  log, as every window did before and a restart still did).
* **Peer.** A real peer (:class:`client.peer.Peer`, full replica) for two windows against the
  validator: full-size θ copies it holds between windows (every tensor reachable from it, in units
  of 4·P bytes) and the time of its state commit per parameter.
* **Followers.** With several validators (:mod:`protocol.quorum`) every validator that did not
  lead a window re-checks the leader's proposal (:meth:`validator.follow.Follower.judge`): it reads
  the proposal, matches every named contribution by digest (fetched unless it read it during its
  own intake), screens it, checks the stated norm reference, and recomputes Δ̄ and θ_{t+1} bit for
  bit (no scoring, no copy scan). The window the validator above decided is proposed as a leader
  would (the aggregate with the view and the reference's digest, its real clip caps, the
  reference after the window) and judged by a follower holding θ_t, the buffer and the norm
  reference from before the window and the bytes the validator read; the verdict must be an
  endorsement. The screening is timed again alone, and once more fetching every contribution.
  Beside it, the bytes of several signatures: a proposal over its aggregate (the caps table, per
  contributor, and the reference), and a certificate over the aggregate for m of n ∈ {3 of 4,
  5 of 7} (real endorsements and certificates through :mod:`protocol.wire.quorum`).
* **Projection.** Per-unit costs measured on one layer of the 1B model (51 M parameters:
  screening, decoding again, clipping, summing), the copy scan and agreement per sampled entry,
  θ operations per parameter and the aggregate's encoding per value, scaled to 1B parameters ×
  256 peers; the parallel phases divided by the stated CPU cores, loss scoring at a stated GPU
  throughput.

Times are CPU seconds: of the whole process (every thread, the worker pool's too) for a window,
of the measuring thread (torch runs one intra-op thread) for everything else, the least of
:data:`REPEATS` runs for the per-unit costs. The machine this runs on may be shared, and wall time
there measures the other processes too; the wall seconds are reported beside them.

    python scripts/bench_scale.py                # the table
    python scripts/bench_scale.py --json         # one JSON object on stdout, the table on stderr
    python scripts/bench_scale.py --quick        # N ≤ 64, history ≤ 1 000 windows (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from rss_peak import RssPeak

from protocol import codec, layout
from protocol.aggregate import NormLimit, SparseDict, SparseSum, apply_outer, clip_to_limits, sparse_of
from protocol.broadcast import plain
from protocol.caps import object_caps, proposal_bytes
from protocol.config import OuterConfig, RunSpec
from protocol.feedback import FeedbackState
from protocol.identity import Identity
from protocol.model import fingerprint, param_schema
from protocol.outcomes import encode_outcomes, outcomes_digest
from protocol.settings import LocalSettings
from protocol.store.memory import MemoryStore
from protocol.wire import (
    Announcement,
    Contribution,
    decode_aggregate,
    decode_contribution,
    encode_announcement,
    encode_contribution,
)
from protocol.wire.quorum import (
    Endorsement,
    TensorCaps,
    caps_of,
    certificate_bytes,
    decode_certificate,
    decode_proposal,
    encode_certificate,
    encode_endorsement,
    encode_proposal,
)
from validator import checks
from validator.consensus import agreement
from validator.copies import CopyRule, scan
from validator.decide import WindowDecision
from validator.follow import Follower
from validator.held import clipped_entries, decode
from validator.log import CheckRow, ContributionLog, ContributionRecord, WindowRecord
from validator.node import Validator
from validator.publish import encode_window_aggregate
from validator.reputation import Standing, standings
from validator.sketch import Sketcher, expected_nnz, global_entries, offsets, sample_every
from validator.state import ValidatorState, load_state, save_state

torch.set_num_threads(1)

MODEL = {"preset": "tiny", "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_dim": 688, "max_seq_len": 128}
ONE_B = {"preset": "1b", "dim": 2048, "n_layers": 16, "n_heads": 16, "ffn_dim": 5632, "max_seq_len": 2048}
PEERS = (4, 16, 64, 256)
HISTORY = (10, 1_000, 10_000)
HISTORY_PEERS = 256
TEMPLATE_WINDOWS = 32  # windows of synthetic rows; the longer logs repeat them
CORES = 16  # CPU cores of the projected validator (one H100-class GPU beside them)
GPU_TOKENS_PER_S = 40_000.0  # forward tokens/s of a 1B model on that GPU (fp32/TF32 evaluation)
SEQ_LEN_1B = 2048
PAIR_SAMPLE = 300  # pairs timed to extrapolate the pairwise baseline at the largest N
REPEATS = 3  # runs of each per-unit cost; the least is kept
FOLD_SAMPLE = 1_000  # windows of log folded to extrapolate the full-history baseline beyond them
QUORUMS = ((4, 3), (7, 5))  # (n validators, m signatures) whose certificates are measured
FETCH_BITS_PER_S = 10e9  # a follower's link when it fetches the named contributions again (projection)


def bench_spec(vkey: Identity, n: int) -> RunSpec:
    # The steady state: every window at codec.k (no Top-k warm-up, whose first windows keep more).
    return RunSpec().replace(
        model=MODEL,
        data={"seq_len": 64, "batch_size": 4},
        inner={"steps": 2, "lr": 1e-3, "warmup_steps": 1},
        outer={"warmup_k": 0},
        windows={"upload_deadline_s": 600.0, "gather_grace_s": 0.05, "checkpoint_every": 1000},
        validator={
            "public_keys": [vkey.public_key_hex],
            "eval_sequences": 8,
            "max_contributors": max(n, 1),
            "max_contribution_bytes": 1 << 24,
        },
    )


@contextmanager
def timed(out: dict[str, float], key: str) -> Iterator[None]:
    """Add the CPU seconds this thread spends in the block to ``out[key]``. CPU time, not wall
    time: the machine this runs on may be shared, and its wall time then measures the other
    processes as much as this one (torch runs one intra-op thread here, so the thread's time is
    all the work)."""
    t0 = time.thread_time()
    yield
    out[key] = out.get(key, 0.0) + time.thread_time() - t0


def least(repeats: int, key: str, fn: Callable[[], object]) -> float:
    """The smallest CPU time of ``repeats`` runs of ``fn`` (the run least disturbed)."""
    best = math.inf
    for _ in range(repeats):
        out: dict[str, float] = {}
        with timed(out, key):
            fn()
        best = min(best, out[key])
    return best


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """x of y ∝ N^x, least squares in log-log."""
    lx, ly = np.log(np.asarray(xs)), np.log(np.asarray(ys))
    return float(np.polyfit(lx, ly, 1)[0])


# ---------------------------------------------------------------------------- synthetic uploads
def synthetic_updates(
    schema: dict[str, tuple[int, ...]], n: int, cfg: Any, seed: int
) -> Iterator[dict[str, codec.Encoded]]:
    """N encoded updates sharing a direction (honest-like overlap of their positions)."""
    g = torch.Generator().manual_seed(seed)
    shared = {name: torch.randn(shape, generator=g) for name, shape in schema.items()}
    for _ in range(n):
        yield {name: codec.encode((s + torch.randn(s.shape, generator=g)) * 1e-3, cfg) for name, s in shared.items()}


class Swarm:
    def __init__(self, spec: RunSpec, n: int, seed: int) -> None:
        self.spec, self.run_hash = spec, spec.hash()
        self.run = layout.run_id(self.run_hash)
        self.name = f"scale-{uuid.uuid4().hex[:8]}"
        self.store = MemoryStore(self.name)
        self.schema = param_schema(spec.model)
        self.peers = [Identity.generate() for _ in range(n)]
        self.updates = list(synthetic_updates(self.schema, n, spec.codec, seed))
        for p in self.peers:
            ann = encode_announcement(Announcement(self.run_hash, 0, "bench", "cpu"), p)
            self.store.put(layout.peer_key(self.run, p.peer_id), ann)

    def upload_all(self, window: int, base: str) -> dict[str, bytes]:
        blobs = {}
        for p, enc in zip(self.peers, self.updates):
            blob = encode_contribution(Contribution(self.run_hash, window, base, self.spec.codec, enc, {}), p)
            self.store.put(layout.contrib_key(self.run, window, p.peer_id), blob)
            blobs[p.peer_id] = blob
        return blobs

    def close(self) -> None:
        MemoryStore.forget(self.name)


def established_validator(sw: Swarm, vkey: Identity, state_dir: str, local: LocalSettings) -> Validator:
    """A validator whose state says every peer of ``sw`` is past probation."""
    v = Validator(sw.spec, MemoryStore(sw.name), vkey, state_dir, local=local)
    st = v.resume()
    known = {p.peer_id: Standing(reputation=0.1, windows=3, passes=3) for p in sw.peers}
    save_state(state_dir, replace(st, standings=known), params=False)
    v.close()
    v = Validator(sw.spec, MemoryStore(sw.name), vkey, state_dir, local=local)
    v.resume()
    return v


# ---------------------------------------------------------------------------- peers: one window
def window_costs(n: int, seed: int) -> dict[str, Any]:
    vkey = Identity.generate()
    spec = bench_spec(vkey, n)
    sw = Swarm(spec, n, seed)
    state_dir = tempfile.mkdtemp(prefix="bench-scale-")
    local = LocalSettings(poll_interval_s=0.05)
    try:
        v = established_validator(sw, vkey, state_dir, local)
        assert v.state is not None
        sw.upload_all(0, v.state.base)
        assert v.run_window() is not None  # window 0: the norm reference starts
        blobs = sw.upload_all(1, v.state.base)
        before = Before.of(v)
        decisions = captured_decisions(v)
        gc.collect()
        with RssPeak() as rss:
            t0, c0 = time.perf_counter(), time.process_time()
            report = v.run_window()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0  # all threads: the pool's too
        assert report is not None and len(decisions) == 1
        agg_blob = sw.store.get(layout.aggregate_key(sw.run, 1), max_bytes=1 << 30)
        agg = decode_aggregate(agg_blob, run_hash=sw.run_hash, max_bytes=len(agg_blob), allowed_signers=None)
        rows = v.log.rows(windows=(1, 1))
        overlaps = [r.overlap for r in rows if r.overlap is not None]
        p_total = sum(math.prod(s) for s in sw.schema.values())
        out = {
            "n": n,
            "seconds": cpu,
            "wall_seconds": wall,
            "phases": dict(report.seconds),
            "accepted": report.accepted,
            "rejected": report.rejected,
            "reasons": dict(report.reasons),
            "aggregate_bytes": len(agg_blob),
            "aggregate_nnz": agg.value.nnz,
            "params": p_total,
            "mean_best_overlap": float(np.mean(overlaps)) if overlaps else 0.0,
            "held_mb": rss.peak / 2**20,
        }
        out["copies"] = copy_baseline(sw, blobs, v)
        out["follower"], proposed = follower_costs(sw, v, vkey, before, decisions[0], blobs)
        out["certificates"] = certificate_sizes(proposed, sw.run_hash, 1, vkey, object_caps(spec).aggregate)
        v.close()
        return out
    finally:
        sw.close()
        shutil.rmtree(state_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- followers
@dataclass(frozen=True)
class Before:
    """What a follower holds when a window's proposal arrives: θ_t, the error-feedback buffer and
    the norm reference from before the window, and the chain's head."""

    state: ValidatorState
    params: dict[str, torch.Tensor]
    feedback: FeedbackState

    @classmethod
    def of(cls, v: Validator) -> Before:
        st = v.state
        assert st is not None
        params = {n: p.detach().clone() for n, p in st.params.items()}
        feedback = FeedbackState({n: b.detach().clone() for n, b in v.committer.feedback.buffers.items()})
        return cls(st, params, feedback)


def captured_decisions(v: Validator) -> list[WindowDecision]:
    """The decisions ``v`` takes from now on (the window's clip caps are in them)."""
    out: list[WindowDecision] = []
    decide = v.decider.decide

    def capture(*args: Any, **kwargs: Any) -> WindowDecision:
        d = decide(*args, **kwargs)
        out.append(d)
        return d

    v.decider.decide = capture  # type: ignore[method-assign]
    return out


def follower_costs(
    sw: Swarm,
    v: Validator,
    vkey: Identity,
    before: Before,
    d: WindowDecision,
    blobs: dict[str, bytes],
) -> tuple[dict[str, Any], bytes]:
    """A follower's judgement of the window ``v`` decided, proposed as its leader would
    (:mod:`validator.agreement`: the aggregate with the view and the reference's digest, the real
    clip caps, the reference after the window): read the proposal, screen the named contributions
    (the ones it read itself during its intake are not fetched again), recompute Δ̄ and θ_{t+1}. With the aggregate as the leader proposes it."""
    window = d.window
    outcomes = outcomes_digest(encode_outcomes(sw.run_hash, window, [r.outcome() for r in d.rows]))
    agg_blob = v.committer._encode(before.state, d, outcomes, time.time(), view=0)
    live = {p: d.caps.get(p) for p in d.accepted}
    caps = caps_of(live)
    ref = d.reference.to_json().encode()
    blob = encode_proposal(0, caps, agg_blob, window, sw.run_hash, vkey, ref)
    bare = encode_proposal(0, {}, agg_blob, window, sw.run_hash, vkey)
    no_caps = encode_proposal(0, {}, agg_blob, window, sw.run_hash, vkey, ref)
    follower = Follower(sw.spec, MemoryStore(sw.name), v.decider.aggregator)
    keys = [vkey.public_key_hex]
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    proposal = decode_proposal(
        blob,
        run_hash=sw.run_hash,
        max_bytes=proposal_bytes(sw.spec),
        allowed_signers=keys,
        window=window,
        schema=sw.schema,
    )
    read_wall, read_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    verdict = follower.judge(
        proposal,
        base=before.state.base,
        previous_base=before.state.previous_base,
        params=before.params,
        feedback=before.feedback,
        reference=before.state.reference,
        read=blobs,
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0  # all threads: the pool's too
    assert verdict.endorsed, verdict.reasons  # the same bits as the leader's Δ̄ and θ_{t+1}
    # the screening alone, once more (the rest of the judgement is the recomputation)
    t0, c0 = time.perf_counter(), time.process_time()
    held, reasons = follower.contributions(proposal.value.aggregate.value, before.state.previous_base, blobs)
    screen_wall, screen_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert not reasons and len(held) == len(d.accepted)
    # a follower that read none of them itself: every named contribution fetched by digest
    t0, c0 = time.perf_counter(), time.process_time()
    held, reasons = follower.contributions(proposal.value.aggregate.value, before.state.previous_base)
    fetch_wall, fetch_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert not reasons and len(held) == len(d.accepted)
    return {
        "judge_s": cpu,
        "judge_wall_s": wall,
        "read_proposal_s": read_cpu,
        "read_proposal_wall_s": read_wall,
        "screen_s": screen_cpu,
        "screen_wall_s": screen_wall,
        "fetch_screen_s": fetch_cpu,
        "fetch_screen_wall_s": fetch_wall,
        "named_bytes": sum(len(blobs[p]) for p in d.accepted),
        "contributors": len(d.accepted),
        "aggregate_bytes": len(agg_blob),
        "proposal_bytes": len(blob),
        "proposal_frame_bytes": len(bare) - len(agg_blob),
        "reference_bytes": len(no_caps) - len(bare),
        "caps_bytes": len(blob) - len(no_caps),
        "caps": caps_census(caps, sw.schema),
        "tensors": len(sw.schema),
    }, agg_blob


def caps_census(caps: dict[str, dict[str, TensorCaps] | None], schema: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """How much of a caps table is per-tensor and how much per row: the share of the matrix rows
    of the capped contributions listed with their own cap (what grows with the model)."""
    listed = possible = tensors = 0
    for per_tensor in caps.values():
        for name, c in (per_tensor or {}).items():
            tensors += 1
            listed += len(c.rows)
            if c.row_len > 0:
                possible += math.prod(schema[name]) // c.row_len
    return {
        "tensors": tensors,
        "rows_listed": listed,
        "row_share": listed / possible if possible else 0.0,
        "clipped_contributions": sum(1 for c in caps.values() if c is not None),
    }


def certificate_sizes(agg_blob: bytes, run_hash: str, window: int, vkey: Identity, cap: int) -> dict[str, Any]:
    """Real endorsements and certificates of ``agg_blob`` (signed by ``vkey``) for m of n
    validators: the bytes a peer reads at the aggregate key beyond the plain aggregate."""
    digest = hashlib.sha256(agg_blob).hexdigest()
    out: dict[str, Any] = {}
    for n, m in QUORUMS:
        keys = [vkey] + [Identity.generate() for _ in range(n - 1)]
        ends = [encode_endorsement(Endorsement(run_hash, window, 0, vkey.peer_id, digest), k) for k in keys[:m]]
        cert = encode_certificate(agg_blob, ends, window, run_hash, keys[-1])
        checked = decode_certificate(
            cert,
            run_hash=run_hash,
            max_bytes=certificate_bytes(cap, n),
            allowed_signers=[k.public_key_hex for k in keys],
            quorum=m,
            window=window,
        )
        assert len(checked.value.signers) == m and checked.value.aggregate.digest == digest
        out[f"{m}_of_{n}"] = {
            "n": n,
            "m": m,
            "endorsement_bytes": len(ends[0]),
            "extra_bytes": len(cert) - len(agg_blob),
            "cap_extra_bytes": certificate_bytes(cap, n) - cap,
        }
    return out


def projected_caps_bytes(census: Mapping[str, float], vkey: Identity) -> int:
    """The caps of one clipped contributor of the 1B model, encoded: every tensor's norm and row
    caps, and the measured share of each matrix's rows listed with their own cap."""
    schema = param_schema(RunSpec().replace(model=ONE_B).model)
    per_tensor: dict[str, TensorCaps] = {}
    for name, shape in schema.items():
        if len(shape) < 2:
            per_tensor[name] = TensorCaps(1.0, 0.0, 0)
            continue
        rows, listed = shape[0], round(census["row_share"] * shape[0])
        step = rows / listed if listed else 0
        per_tensor[name] = TensorCaps(
            1.0, 0.5, math.prod(shape[1:]), tuple((int(i * step), 0.25) for i in range(listed))
        )
    peer = Identity.generate().peer_id
    one = encode_proposal(0, {peer: per_tensor}, b"", 0, "ab" * 32, vkey)
    return len(one) - len(encode_proposal(0, {}, b"", 0, "ab" * 32, vkey))


def copy_baseline(sw: Swarm, blobs: dict[str, bytes], v: Validator) -> dict[str, Any]:
    """The one-pass scan and the pairwise comparison on the same window's index sets."""
    offs = offsets(sw.schema)
    entries = {p: global_entries(_sparse(b), offs) for p, b in blobs.items()}
    read_at = {p: float(i) for i, p in enumerate(entries)}
    t0 = time.thread_time()
    scan(entries, read_at, CopyRule())
    one_pass = time.thread_time() - t0
    t0 = time.thread_time()
    agreement(entries, set(entries), np.array(sorted(offs.values()), dtype=np.int64))
    agree = time.thread_time() - t0
    peers = list(entries)
    pairs = len(peers) * (len(peers) - 1) // 2
    if pairs <= PAIR_SAMPLE:
        t0 = time.thread_time()
        pairwise_scan(entries, read_at)
        pairwise, estimated = time.thread_time() - t0, False
    else:
        rng = np.random.default_rng(0)
        sample = [tuple(rng.choice(len(peers), 2, replace=False)) for _ in range(PAIR_SAMPLE)]
        t0 = time.thread_time()
        for i, j in sample:
            _overlap(entries[peers[int(i)]][0], entries[peers[int(j)]][0])
        pairwise, estimated = (time.thread_time() - t0) / PAIR_SAMPLE * pairs, True
    values = sum(len(e[0]) for e in entries.values())
    return {
        "one_pass_s": one_pass,
        "pairwise_s": pairwise,
        "pairwise_estimated": estimated,
        "agreement_s": agree,
        "entries": values,
    }


def _sparse(blob: bytes) -> SparseDict:
    return sparse_of(decode_contribution(blob, run_hash=None, max_bytes=len(blob)).value.tensors)


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) == 0 or len(b) == 0:
        return 0.0
    return np.intersect1d(a, b, assume_unique=True).size / min(len(a), len(b))


def pairwise_scan(entries: dict[str, tuple[np.ndarray, np.ndarray]], read_at: dict[str, float]) -> None:
    """The copy check this code had before the one-pass scan: each upload against every earlier one."""
    originals: list[str] = []
    for peer in sorted(entries, key=lambda p: read_at[p]):
        if not any(_overlap(entries[peer][0], entries[o][0]) >= 0.6 for o in originals):
            originals.append(peer)


# ---------------------------------------------------------------------------- history
def synthetic_rows(window: int, peers: list[str], rng: np.random.Generator) -> list[ContributionRecord]:
    names = checks.CHECK_ORDER
    out = []
    for p in peers:
        accepted = rng.random() > 0.1
        passed = names[: names.index("stable") + 1] if accepted else names[: names.index("score")]
        rows = tuple(CheckRow(c, True) for c in passed) + (() if accepted else (CheckRow("score", False, "harmful"),))
        scored = rng.random() < 0.05
        out.append(
            ContributionRecord(
                window=window,
                peer=p,
                received_at=1e9 + window,
                bytes=int(rng.integers(1 << 20, 1 << 21)),
                digest=hashlib.sha256(f"{window}{p}".encode()).hexdigest(),
                accepted=accepted,
                reason=None if accepted else "harmful",
                detail=None if accepted else "own loss 3.1000 -> 3.1200",
                norm=float(rng.random()),
                overlap=float(rng.random() * 0.3),
                loss_own_before=3.1 if scored else None,
                loss_own_after=3.0 if scored else None,
                loss_random_before=3.2 if scored else None,
                loss_random_after=3.19 if scored else None,
                score=0.09 if scored else None,
                reputation=0.5,
                weight=1.0 if accepted else 0.0,
                checks=rows,
            )
        )
    return out


def replicate_windows(path: Path, have: int, want: int) -> None:
    """Fill windows ``have`` … ``want − 1`` of the log at ``path`` with copies of the rows of
    windows ``0 … have − 1`` (doubling, in SQL: millions of rows in seconds)."""
    db = sqlite3.connect(path)
    cols = [c[1] for c in db.execute("PRAGMA table_info(contributions)") if c[1] != "window"]
    names = ", ".join(cols)
    n = have
    while n < want:
        k = min(n, want - n)
        db.execute(
            f"INSERT INTO contributions (window, {names}) SELECT window + ?, {names} FROM contributions WHERE window < ?",
            (n, k),
        )
        db.commit()
        n += k
    db.close()


def history_costs(windows: int, vkey: Identity) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="bench-history-"))
    try:
        spec = bench_spec(vkey, HISTORY_PEERS)
        cfg = spec.validator
        rng = np.random.default_rng(windows)
        peers = sorted(Identity.generate().peer_id for _ in range(HISTORY_PEERS))
        t = windows - 1
        path = d / "contributions.sqlite"
        templates = [synthetic_rows(w, peers, rng) for w in range(min(t, TEMPLATE_WINDOWS))]
        log = ContributionLog(path)
        log.record_rows([r for rows in templates for r in rows])
        log.close()
        replicate_windows(path, len(templates), t)  # window w repeats the rows of w mod TEMPLATE_WINDOWS
        # the state a validator at window t + 1 saved: standings folded window by window
        folded: dict[str, Standing] = {}
        for w in range(t):
            rows = templates[w % len(templates)]
            folded = standings((replace(r.outcome(), window=w) for r in rows), cfg, start=folded)
        last = synthetic_rows(t, peers, rng)
        folded = standings(map(ContributionRecord.outcome, last), cfg, start=folded)
        log = ContributionLog(path)
        log.record_window(WindowRecord(window=t, status="published", opened_at=1.0), last)
        rows_now = log.rows(windows=(t, t))
        n_rows = windows * HISTORY_PEERS
        params = {"w": torch.zeros(4)}
        state = ValidatorState(spec.hash(), t + 1, "ab" * 32, 1.0, params, "cd" * 32, 0.5, "ef" * 32, standings=folded)
        save_state(d, state)
        log.close()
        size = sum(f.stat().st_size for f in d.glob("contributions.sqlite*"))
        out: dict[str, float] = {}
        with timed(out, "restart_s"):  # what a restarted validator reads before its first window
            log = ContributionLog(d / "contributions.sqlite")
            loaded = load_state(d, spec.hash())
        assert loaded is not None and loaded.standings == folded
        w = t + 1
        new_rows = synthetic_rows(w, peers, rng)
        w0 = time.perf_counter()
        with timed(out, "window_s"):  # the log and state work of one window
            prev = log.rows(windows=(w - 1, w - 1))
            log.window(w - 1)
            for r in new_rows:
                log.note_received(w, r.peer, received_at=2e9, nbytes=r.bytes, digest=r.digest)
            log.record_window(WindowRecord(window=w), new_rows)
            log.mark_published(w, digest="ef" * 32, published_at=2e9)
            log.rows(windows=(w - 1, w - 1))  # late uploads of the previous window
            decided = log.rows(windows=(w, w))
            nxt = standings(map(ContributionRecord.outcome, decided), cfg, start=loaded.standings)
            save_state(d, replace(loaded, window=w + 1, standings=nxt), params=False)
        out["window_wall_s"] = time.perf_counter() - w0  # with the log's fsyncs
        # the baseline: the standings from the whole log (beyond FOLD_SAMPLE windows, the fold of
        # the last FOLD_SAMPLE windows scaled to all: it reads and folds every row once)
        folded_windows = min(w + 1, FOLD_SAMPLE)
        with timed(out, "full_fold_s"):
            base = standings(map(ContributionRecord.outcome, log.rows(windows=(w + 1 - folded_windows, w))), cfg)
        out["full_fold_s"] *= (w + 1) / folded_windows
        out["full_fold_estimated"] = float(folded_windows < w + 1)
        assert folded_windows < w + 1 or base == nxt
        assert len(prev) == len(rows_now) == HISTORY_PEERS
        log.close()
        out["log_bytes_per_contribution"] = size / n_rows
        out["rows"] = n_rows
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------- a peer
def peer_costs() -> dict[str, Any]:
    """A peer's steady θ-size copies and commit cost per parameter, measured by
    ``scripts/bench_peer.py`` on the peer's own end of a window (Δ folded into e in place, the
    commit on its background lane), 13 M parameters."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_peer

    args = argparse.Namespace(dim=512, layers=4, seq_len=64, batch_size=2, steps=2, windows=4, moments_every=3)
    r = bench_peer.run("after", args)
    return {
        "state_copies": r.peer_state_copies,
        "commit_s_per_param": r.peer_commit_seconds_per_param,
        "params": r.params,
    }


def unit_costs(seed: int) -> dict[str, float]:
    """Per-value costs of the phases that scale with N × nnz, on one layer of the 1B model."""
    full = param_schema(RunSpec().replace(model=ONE_B).model)
    layer = {n: s for n, s in full.items() if n.startswith("blocks.0.")}
    cfg = RunSpec().codec
    peer = Identity.generate()
    (enc,) = synthetic_updates(layer, 1, cfg, seed)
    blob = encode_contribution(Contribution("ab" * 32, 0, "cd" * 32, cfg, enc, {}), peer)
    nnz = sum(e.nnz for e in enc.values())
    every = sample_every(expected_nnz(full, cfg))
    sk = Sketcher(offsets(full), every, key=b"bench")
    ctx = checks.Context(
        run_hash="ab" * 32,
        window=0,
        expected_base="cd" * 32,
        codec=cfg,
        schema=full,
        max_bytes=1 << 30,
        registered=frozenset({peer.peer_id}),
        sketch=sk,
    )
    out: dict[str, float] = {}
    s = checks.screen(peer.peer_id, blob, ctx)
    assert s.reason is None and s.held is not None
    h = s.held
    out["screen"] = least(REPEATS, "screen", lambda: checks.screen(peer.peer_id, blob, ctx))
    limits = {
        n: NormLimit(norm=h.norms.tensors[n].norm * 0.5, row=h.norms.tensors[n].row * 0.5, row_len=shape[-1])
        if len(shape) == 2
        else NormLimit(norm=h.norms.tensors[n].norm * 0.5)
        for n, shape in layer.items()
    }
    sparse = decode(h, full, cfg)
    out["decode"] = least(REPEATS, "decode", lambda: decode(h, full, cfg))
    (clipped,) = clip_to_limits([sparse], limits)
    out["clip"] = least(REPEATS, "clip", lambda: clip_to_limits([sparse], limits))
    total = SparseSum(full)
    with timed(out, "sum_alloc"):  # the window's sum arrays, allocated once (counted per parameter)
        total.add([clipped])
    out["sum"] = least(REPEATS, "sum", lambda: total.add([clipped]))
    out["clipped_sample"] = least(REPEATS, "clipped_sample", lambda: clipped_entries(h, limits, sk, full))
    layer_params = sum(math.prod(s) for s in layer.values())
    per = {k: v / nnz for k, v in out.items() if k != "sum_alloc"}
    per["sum_alloc_per_param"] = max(0.0, out["sum_alloc"] - out["sum"]) / layer_params
    per["sampled_share"] = len(h.sketch[0]) / nnz
    per["bytes_per_value"] = len(blob) / nnz
    # θ work per parameter (clone, finiteness, load, fingerprint), on 64 M parameters
    theta = {"w": torch.randn(1 << 26)}
    t: dict[str, float] = {}
    with timed(t, "clone"):
        nxt = {k: p.clone() for k, p in theta.items()}
    with timed(t, "finite"):
        all(bool(torch.isfinite(p).all()) for p in nxt.values())
    with timed(t, "fingerprint"):
        fingerprint(nxt)
    idx = torch.arange(0, 1 << 26, 4, dtype=torch.int64)
    with timed(t, "apply"):
        apply_outer(nxt, {"w": (idx, torch.ones(len(idx)))}, 1.0)
    per["theta_per_param"] = (t["clone"] + t["finite"] + t["fingerprint"]) / (1 << 26) + per["sum_alloc_per_param"]
    per["apply_per_value"] = t["apply"] / len(idx)
    return per


def aggregate_encode_cost(vkey: Identity) -> dict[str, float]:
    """Seconds and bytes per value of the signed aggregate (its plain published form: coded index
    sets, bfloat16 values), on a 4 M-value Δ̄."""
    shapes = {"w": (4096, 4096)}
    idx = torch.arange(0, 4096 * 4096, 4, dtype=torch.int64)
    delta = {"w": (idx, torch.randn(len(idx)))}
    t0 = time.thread_time()
    blob = encode_window_aggregate(
        run_hash="ab" * 32,
        window=0,
        base="cd" * 32,
        alpha=1.0,
        tensors=dict(plain(delta, shapes)),
        manifest=[],
        fingerprint_next="ef" * 32,
        published_at=1.0,
        metadata={},
        identity=vkey,
    )
    hashlib.sha256(blob).hexdigest()
    encode_s = time.thread_time() - t0
    t0 = time.thread_time()  # what a follower (and every peer) spends reading it back
    decode_aggregate(
        blob, run_hash="ab" * 32, max_bytes=len(blob), allowed_signers=[vkey.public_key_hex], schema=shapes
    )
    decode_s = time.thread_time() - t0
    return {
        "seconds_per_value": encode_s / len(idx),
        "decode_seconds_per_value": decode_s / len(idx),
        "bytes_per_value": len(blob) / len(idx),
    }


# ---------------------------------------------------------------------------- projection
def projection(
    units: dict[str, float], window: dict[str, Any], history: dict[str, Any], agg: dict[str, float]
) -> dict[str, Any]:
    """Minutes of one window at 1B parameters × 256 peers, per phase."""
    spec = RunSpec().replace(model=ONE_B)
    schema = param_schema(spec.model)
    p = sum(math.prod(s) for s in schema.values())
    nnz = expected_nnz(schema, spec.codec)
    n = 256
    values = n * nnz
    sampled = values * units["sampled_share"]
    cp = window["copies"]
    density = window["aggregate_nnz"] / window["params"]  # Δ̄'s share of θ at N = 256, measured
    delta_values = density * p
    v = spec.validator
    tokens = (3 * v.eval_peers_per_window + 1) * v.eval_sequences * SEQ_LEN_1B  # own before/after, random
    phases_s = {
        "screen (decode, checks, norms, sample)": values * units["screen"] / CORES,
        "copies (one-pass scan of the samples)": sampled * cp["one_pass_s"] / cp["entries"],
        "agreement (clipped samples)": sampled * (units["clipped_sample"] / units["sampled_share"] / CORES)
        + sampled * cp["agreement_s"] / cp["entries"],
        "scoring (GPU forward + 8 decodes)": tokens / GPU_TOKENS_PER_S
        + v.eval_peers_per_window * nnz * (units["decode"] + units["clip"]),
        "aggregate (decode again, clip, sum)": values * (units["decode"] + units["clip"] + units["sum"]) / CORES,
        "θ (clone, finite, fingerprint, apply, val loss)": p * units["theta_per_param"]
        + delta_values * units["apply_per_value"]
        + v.eval_sequences * SEQ_LEN_1B / GPU_TOKENS_PER_S,
        "publish (encode + sign Δ̄)": delta_values * agg["seconds_per_value"],
        "log + state": history["window_s"],
    }
    single = dict(phases_s)
    single["screen (decode, checks, norms, sample)"] *= CORES
    single["aggregate (decode again, clip, sum)"] *= CORES
    minutes = {k: round(s / 60.0, 3) for k, s in phases_s.items()}
    return {
        **minutes,
        "total": round(sum(phases_s.values()) / 60.0, 2),
        "total_single_core": round(sum(single.values()) / 60.0, 2),
        "assumptions": (
            f"1B preset ({p / 1e9:.2f} G params), {n} peers × {nnz / 1e6:.1f} M values each; screening, "
            f"decoding and clipping on {CORES} CPU cores (the worker pool), everything else from per-unit "
            f"costs measured here on one core; loss scoring {v.eval_peers_per_window} units × 3 + 1 "
            f"evaluations of {v.eval_sequences} × {SEQ_LEN_1B} tokens and the validation loss at "
            f"{GPU_TOKENS_PER_S:,.0f} tokens/s forward on one H100-class GPU; Δ̄ density {density:.3f} "
            "(measured at N = 256); downloads not counted (they overlap the upload deadline)"
        ),
        "aggregate_bytes": int(delta_values * agg["bytes_per_value"]),
    }


def follower_projection(
    units: dict[str, float], window: dict[str, Any], agg: dict[str, float], caps_bytes: int, reference_bytes: int
) -> dict[str, Any]:
    """Minutes of one follower's judgement at 1B parameters × 256 peers, per phase, from the same
    per-unit costs as the leader's (:func:`projection`). The follower screens the named
    contributions on the worker pool (``Follower.contributions``), and decodes, clips and sums
    them again there, as the leader does (``total_one_thread``: the screening on one thread, for
    comparison). Contributions it
    read itself during its intake are not fetched again; what one that read none would fetch is
    counted apart."""
    spec = RunSpec().replace(model=ONE_B)
    schema = param_schema(spec.model)
    p = sum(math.prod(s) for s in schema.values())
    nnz = expected_nnz(schema, spec.codec)
    n = 256
    values = n * nnz
    delta_values = window["aggregate_nnz"] / window["params"] * p
    fetched = values * units["bytes_per_value"]
    phases_s = {
        "read the proposal (decode Δ̄, caps)": delta_values * agg["decode_seconds_per_value"],
        "screen the named contributions (worker pool)": values * units["screen"] / CORES,
        "aggregate (decode again, clip, sum)": values * (units["decode"] + units["clip"] + units["sum"]) / CORES,
        "θ (clone, finite, fingerprint, apply)": p * units["theta_per_param"] + delta_values * units["apply_per_value"],
    }
    minutes = {k: round(s / 60.0, 3) for k, s in phases_s.items()}
    fetch_s = fetched * 8 / FETCH_BITS_PER_S
    serial = dict(phases_s)
    serial["screen the named contributions (worker pool)"] *= CORES
    return {
        **minutes,
        "total": round(sum(phases_s.values()) / 60.0, 2),
        "total_one_thread": round(sum(serial.values()) / 60.0, 2),
        "fetch_again_bytes": int(fetched),
        "fetch_again_minutes": round(fetch_s / 60.0, 3),
        "proposal_extra_bytes_per_contributor": caps_bytes,
        "proposal_reference_bytes": reference_bytes,
        "proposal_extra_bytes": caps_bytes * n + reference_bytes,
        "assumptions": (
            f"the leader's per-unit costs; screening, decoding, clipping and summing on {CORES} cores; no scoring, no copy scan; the contributions are the ones the "
            f"follower read during its own intake (one that read none fetches {fetched / 1e9:.2f} GB, at "
            f"{FETCH_BITS_PER_S / 1e9:.0f} Gbit/s counted apart); caps of every contributor at the measured "
            "share of listed rows; the reference scaled by the number of tensors"
        ),
    }


# ---------------------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    ap.add_argument("--quick", action="store_true", help="N ≤ 64 and history ≤ 1 000 windows")
    args = ap.parse_args()
    started = time.monotonic()
    peers = [n for n in PEERS if not args.quick or n <= 64]
    history_windows = [w for w in HISTORY if not args.quick or w <= 1_000]
    windows = {}
    for i, n in enumerate(peers):
        windows[n] = window_costs(n, seed=i)
        print(f"N = {n}: {windows[n]['seconds']:.2f} s", file=sys.stderr)
    vkey = Identity.generate()
    history = {}
    for w in history_windows:
        history[w] = history_costs(w, vkey)
        print(f"history {w}: {history[w]['window_s']:.3f} s", file=sys.stderr)
    peer = peer_costs()
    recompressed = recompressed_sizes([n for n in peers if n >= 16])
    units = unit_costs(seed=7)
    agg = aggregate_encode_cost(vkey)
    proj = projection(units, windows[max(peers)], history[max(history_windows)], agg)
    largest = windows[max(peers)]
    caps_bytes = projected_caps_bytes(largest["follower"]["caps"], vkey)
    lf = largest["follower"]
    ref_1b = round(lf["reference_bytes"] / lf["tensors"] * len(param_schema(RunSpec().replace(model=ONE_B).model)))
    follow = follower_projection(units, largest, agg, caps_bytes, ref_1b)
    follow["proposal_extra_bytes_per_contributor_every_row"] = projected_caps_bytes({"row_share": 1.0}, vkey)
    result = report(peers, windows, history_windows, history, peer, units, proj)
    result.update(followers(peers, windows, follow, proj, recompressed))
    for key in ("aggregate_bytes_per_param", "peer_download_bytes_per_param"):
        for n, size in recompressed.items():
            result[key][str(n)]["recompressed"] = round(size, 4)
    result["seconds"] = round(time.monotonic() - started, 1)
    console = Console(file=sys.stderr if args.json else sys.stdout, width=200)
    for t in tables(result):
        console.print(t)
    if args.json:
        print(json.dumps(result, indent=1))


def recompressed_sizes(peers: list[int]) -> dict[int, float]:
    """Bytes per parameter of the re-compressed aggregate (``outer.recompress`` at its default k)
    of N contributions of the same model, from ``scripts/bench_aggregate.py``'s synthetic
    contributions with the measured honest Top-k overlap; what a peer then downloads per window."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_aggregate

    k = OuterConfig().recompress_k
    argv = ["--model", "tiny", "--n", ",".join(map(str, peers)), "--recompress-k", str(k)]
    out = bench_aggregate.measure(bench_aggregate.parse_args(argv), Console(stderr=True))
    return {int(row["n"]): float(row["recompressed"][str(k)]["aggregate_bytes_per_param"]) for row in out["rows"]}


def report(
    peers: list[int],
    windows: dict[int, dict[str, Any]],
    history_windows: list[int],
    history: dict[int, dict[str, Any]],
    peer: dict[str, Any],
    units: dict[str, float],
    proj: dict[str, Any],
) -> dict[str, Any]:
    secs = {str(n): round(windows[n]["seconds"], 3) for n in peers}
    # the phases are timed on the wall clock: scoring's share of the wall time, taken off the CPU time
    without_scoring = {
        str(n): round(
            windows[n]["seconds"] * (1.0 - windows[n]["phases"].get("scoring", 0.0) / windows[n]["wall_seconds"]), 3
        )
        for n in peers
    }
    p = windows[peers[0]]["params"]
    return {
        "params": p,
        "timing": (
            "seconds are CPU seconds (the process's for a window, all threads; the thread's for the "
            "rest), wall seconds beside them: this machine is shared"
        ),
        "validator_seconds_per_window": secs,
        "validator_growth_exponent": round(fit_exponent(peers, [windows[n]["seconds"] for n in peers]), 3),
        "validator_wall_seconds_per_window": {str(n): round(windows[n]["wall_seconds"], 3) for n in peers},
        "validator_wall_growth_exponent": round(fit_exponent(peers, [windows[n]["wall_seconds"] for n in peers]), 3),
        "validator_seconds_without_scoring": without_scoring,
        "validator_growth_exponent_without_scoring": round(
            fit_exponent(peers, [max(1e-6, float(v)) for v in without_scoring.values()]), 3
        ),
        "validator_phases": {str(n): windows[n]["phases"] for n in peers},
        "validator_held_mb": {str(n): round(windows[n]["held_mb"], 1) for n in peers},
        "accepted": {str(n): windows[n]["accepted"] for n in peers},
        "rejections": {str(n): windows[n]["reasons"] for n in peers},
        "mean_best_overlap": {str(n): round(windows[n]["mean_best_overlap"], 3) for n in peers},
        "copies_one_pass_seconds": {str(n): round(windows[n]["copies"]["one_pass_s"], 3) for n in peers},
        "copies_pairwise_seconds_baseline": {str(n): round(windows[n]["copies"]["pairwise_s"], 3) for n in peers},
        "copies_pairwise_estimated": [str(n) for n in peers if windows[n]["copies"]["pairwise_estimated"]],
        "history_seconds": {str(w): round(history[w]["window_s"], 4) for w in history_windows},
        "history_wall_seconds": {str(w): round(history[w]["window_wall_s"], 4) for w in history_windows},
        "history_restart_seconds": {str(w): round(history[w]["restart_s"], 4) for w in history_windows},
        "history_full_fold_seconds_baseline": {str(w): round(history[w]["full_fold_s"], 3) for w in history_windows},
        "history_full_fold_estimated": [str(w) for w in history_windows if history[w]["full_fold_estimated"]],
        "log_bytes_per_contribution": round(history[history_windows[-1]]["log_bytes_per_contribution"], 1),
        "aggregate_bytes_per_param": {
            str(n): {"plain": round(windows[n]["aggregate_bytes"] / p, 4), "recompressed": None}
            for n in peers
            if n >= 16
        },
        "peer_download_bytes_per_param": {
            str(n): {"plain": round(windows[n]["aggregate_bytes"] / p, 4), "recompressed": None}
            for n in peers
            if n >= 16
        },
        "recompressed_note": (
            "plain: the validator's own aggregates in this run; recompressed: outer.recompress at its default k "
            "on scripts/bench_aggregate.py's synthetic contributions of the same model"
        ),
        "peer_state_copies": round(peer["state_copies"], 2),
        "peer_commit_seconds_per_param": peer["commit_s_per_param"],
        "unit_costs_ns_per_value_1b_layer": {
            k: round(v * 1e9, 2) for k, v in units.items() if k not in ("sampled_share", "bytes_per_value")
        },
        "sampled_share_1b": units["sampled_share"],
        "projection_1b_256_minutes": proj,
    }


def followers(
    peers: list[int],
    windows: dict[int, dict[str, Any]],
    follow: dict[str, Any],
    proj: dict[str, Any],
    recompressed: dict[int, float],
) -> dict[str, Any]:
    """The follower's figures beside the leader's, and the bytes of several signatures."""
    f = {n: windows[n]["follower"] for n in peers}
    largest = windows[max(peers)]
    p1b = sum(math.prod(s) for s in param_schema(RunSpec().replace(model=ONE_B).model).values())
    small = recompressed.get(max(peers))
    certs = {}
    for key, c in largest["certificates"].items():
        certs[key] = {
            **c,
            "share_of_aggregate_bench": round(c["extra_bytes"] / largest["follower"]["aggregate_bytes"], 6),
            "share_of_projected_aggregate_1b": c["extra_bytes"] / proj["aggregate_bytes"],
            "share_of_recompressed_aggregate_1b": None if small is None else c["extra_bytes"] / (small * p1b),
        }
    return {
        "follower_seconds_per_window": {str(n): round(f[n]["judge_s"] + f[n]["read_proposal_s"], 3) for n in peers},
        "follower_wall_seconds_per_window": {
            str(n): round(f[n]["judge_wall_s"] + f[n]["read_proposal_wall_s"], 3) for n in peers
        },
        "follower_growth_exponent": round(
            fit_exponent(peers, [f[n]["judge_s"] + f[n]["read_proposal_s"] for n in peers]), 3
        ),
        "follower_phases_seconds": {
            str(n): {
                "read_proposal": round(f[n]["read_proposal_s"], 3),
                "screen": round(f[n]["screen_s"], 3),
                "recompute": round(max(0.0, f[n]["judge_s"] - f[n]["screen_s"]), 3),
                "fetch_and_screen_unread": round(f[n]["fetch_screen_s"], 3),
            }
            for n in peers
        },
        "follower_named_bytes": {str(n): f[n]["named_bytes"] for n in peers},
        "proposal_bytes": {
            str(n): {
                "aggregate": f[n]["aggregate_bytes"],
                "proposal": f[n]["proposal_bytes"],
                "frame": f[n]["proposal_frame_bytes"],
                "reference": f[n]["reference_bytes"],
                "caps": f[n]["caps_bytes"],
                "contributors": f[n]["contributors"],
                "caps_per_contributor": round(f[n]["caps_bytes"] / max(1, f[n]["contributors"]), 1),
                **f[n]["caps"],
            }
            for n in peers
        },
        "certificate_bytes": certs,
        "projection_follower_1b_256_minutes": follow,
    }


def tables(r: dict[str, Any]) -> list[Table]:
    out = []
    t = Table(title=f"validator window 1, P = {r['params'] / 1e6:.1f} M parameters, established peers")
    for c in ("N", "CPU s", "without scoring", "wall s", "gather", "checks", "scoring", "aggregate", "publish"):
        t.add_column(c, justify="right")
    t.add_column("held MB", justify="right")
    t.add_column("copies: one pass / pairwise (baseline) s", justify="right")
    t.add_column("aggregate B/param: plain / re-compressed", justify="right")
    for n, s in r["validator_seconds_per_window"].items():
        ph = r["validator_phases"][n]
        pair = r["copies_pairwise_seconds_baseline"][n]
        est = " (est.)" if n in r["copies_pairwise_estimated"] else ""
        sizes = r["aggregate_bytes_per_param"].get(n, {})
        agg, small = sizes.get("plain"), sizes.get("recompressed")
        t.add_row(
            n,
            f"{s:.2f}",
            f"{r['validator_seconds_without_scoring'][n]:.2f}",
            f"{r['validator_wall_seconds_per_window'][n]:.2f}",
            *(f"{ph.get(k, 0.0):.2f}" for k in ("gather", "checks", "scoring", "aggregate", "publish")),
            f"{r['validator_held_mb'][n]:.0f}",
            f"{r['copies_one_pass_seconds'][n]:.3f} / {pair:.2f}{est}",
            "–" if agg is None else f"{agg:.3f} / " + ("–" if small is None else f"{small:.4f}"),
        )
    t.caption = (
        f"growth exponent {r['validator_growth_exponent']} (without scoring "
        f"{r['validator_growth_exponent_without_scoring']}; wall {r['validator_wall_growth_exponent']}); "
        "phases in wall seconds; copies in CPU seconds"
    )
    out.append(t)
    h = Table(title="history: the log and state work of one window (256 peers per window)")
    for c in ("windows of log", "one window CPU s", "wall s", "restart s", "full-history fold s (baseline)"):
        h.add_column(c, justify="right")
    for w, s in r["history_seconds"].items():
        est = " (est.)" if w in r["history_full_fold_estimated"] else ""
        h.add_row(
            w,
            f"{s:.4f}",
            f"{r['history_wall_seconds'][w]:.4f}",
            f"{r['history_restart_seconds'][w]:.4f}",
            f"{r['history_full_fold_seconds_baseline'][w]:.3f}{est}",
        )
    h.caption = f"log: {r['log_bytes_per_contribution']:.0f} bytes per contribution"
    out.append(h)
    proj = r["projection_1b_256_minutes"]
    pt = Table(title="projection: one window at 1B parameters × 256 peers")
    pt.add_column("phase")
    pt.add_column("minutes", justify="right")
    for k, v in proj.items():
        if k not in ("assumptions", "aggregate_bytes", "total", "total_single_core"):
            pt.add_row(k, f"{v:.3f}")
    pt.add_row("total", f"{proj['total']:.2f}")
    pt.add_row("total, screening and aggregation on one core", f"{proj['total_single_core']:.2f}")
    pt.caption = proj["assumptions"]
    out.append(pt)
    ft = Table(title="followers: the leader's window and a follower's judgement of its proposal")
    for c in (
        "N",
        "leader CPU s",
        "without scoring",
        "follower CPU s",
        "wall s",
        "read proposal",
        "screen",
        "recompute Δ̄, θ",
        "fetch + screen, none read",
        "named MB",
        "proposal − aggregate B",
        "reference B",
        "caps B / contributor",
        "rows listed",
    ):
        ft.add_column(c, justify="right")
    for n, s in r["follower_seconds_per_window"].items():
        ph, pb = r["follower_phases_seconds"][n], r["proposal_bytes"][n]
        ft.add_row(
            n,
            f"{r['validator_seconds_per_window'][n]:.2f}",
            f"{r['validator_seconds_without_scoring'][n]:.2f}",
            f"{s:.2f}",
            f"{r['follower_wall_seconds_per_window'][n]:.2f}",
            f"{ph['read_proposal']:.3f}",
            f"{ph['screen']:.2f}",
            f"{ph['recompute']:.2f}",
            f"{ph['fetch_and_screen_unread']:.2f}",
            f"{r['follower_named_bytes'][n] / 1e6:.1f}",
            f"{pb['proposal'] - pb['aggregate']:,}",
            f"{pb['reference']:,}",
            f"{pb['caps_per_contributor']:.0f}",
            f"{pb['rows_listed']} ({pb['row_share']:.2%})",
        )
    ft.caption = (
        f"CPU seconds (the process's, all threads); follower growth exponent {r['follower_growth_exponent']}; "
        "recompute = the judgement less the screening; the follower read the contributions during its intake "
        "(fetch + screen, none read: a follower that fetches every named one)"
    )
    out.append(ft)
    ct = Table(title="certificates: what a peer reads beyond the aggregate for m signatures")
    for c in ("m of n", "endorsement B", "extra B", "≈ m × endorsement", "cap extra B", "share of 1B aggregate"):
        ct.add_column(c, justify="right")
    for c in r["certificate_bytes"].values():
        small = c["share_of_recompressed_aggregate_1b"]
        ct.add_row(
            f"{c['m']} of {c['n']}",
            str(c["endorsement_bytes"]),
            str(c["extra_bytes"]),
            str(c["m"] * c["endorsement_bytes"]),
            f"{c['cap_extra_bytes']:,}",
            f"{c['share_of_projected_aggregate_1b']:.2e}" + ("" if small is None else f", {small:.2e} re-compressed"),
        )
    out.append(ct)
    fp = r["projection_follower_1b_256_minutes"]
    pf = Table(title="projection: a follower's judgement at 1B parameters × 256 peers, beside the leader's window")
    pf.add_column("phase")
    pf.add_column("minutes", justify="right")
    for k, v in fp.items():
        if isinstance(v, float) and k not in ("total", "total_one_thread", "fetch_again_minutes"):
            pf.add_row(k, f"{v:.3f}")
    pf.add_row("total (follower)", f"{fp['total']:.2f}")
    pf.add_row("total, screening on one thread instead", f"{fp['total_one_thread']:.2f}")
    pf.add_row("leader's window (table above)", f"{proj['total']:.2f}")
    pf.add_row(
        f"fetching every named contribution, none read ({fp['fetch_again_bytes'] / 1e9:.2f} GB)",
        f"{fp['fetch_again_minutes']:.3f}",
    )
    pf.add_row(
        f"proposal − aggregate: {fp['proposal_extra_bytes_per_contributor']:,} B per contributor"
        f" + {fp['proposal_reference_bytes']:,} B reference",
        f"{fp['proposal_extra_bytes'] / 1e6:.2f} MB",
    )
    pf.add_row(
        "  with every row's cap listed (row caps binding everywhere)",
        f"{fp['proposal_extra_bytes_per_contributor_every_row'] * 256 / 1e6:.2f} MB",
    )
    pf.caption = fp["assumptions"]
    out.append(pf)
    peer = Table(title="peer")
    peer.add_column("θ-size copies held")
    peer.add_column("commit s / param")
    peer.add_row(f"{r['peer_state_copies']:.2f}", f"{r['peer_commit_seconds_per_param']:.3g}")
    out.append(peer)
    return out


if __name__ == "__main__":
    main()
