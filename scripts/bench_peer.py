#!/usr/bin/env python
"""Peer memory and commit cost: how many full-size copies of θ a peer holds, and what its commits cost.

    python scripts/bench_peer.py                      # ≈ 13 M parameters on the CPU, 4 windows
    python scripts/bench_peer.py --json               # the same, one JSON object
    python scripts/bench_peer.py --dim 1024 --layers 8 --windows 6 --moments-every 3

Two ways to end a window, on the same model, data and windows (a full replica on the CPU, the
peer's own classes):

* ``before``: e′ computed as a value (:func:`protocol.feedback.compress_step` on a whole Δ, so Δ,
  e and e′ are alive at once, then e′ adopted), and every window committed with e *and* the AdamW
  moments, on the training thread;
* ``after`` (what :class:`client.peer.Peer` does): Δ formed tensor by tensor and folded into e in
  place (the replica's fold, :meth:`protocol.feedback.FeedbackBuffers.compress`), e committed every
  window and the moments every ``--moments-every`` windows (:mod:`client.state`), on a background
  lane (:mod:`client.lane`) while the next window trains.

Measured, in units of one full-size fp32 copy of θ (4 bytes × parameters):

* ``peer_state_copies``: the storages of every tensor alive after a window (θ, the working model, e,
  the moments, whatever else survived), counted once each — the steady state;
* ``peak_copies_fold``: the most the process held while the window was folded and committed (the
  resident high-water mark, with malloc's mmap threshold fixed at 64 KiB so a freed tensor goes back
  to the system at once), over the memory before the fold, plus the steady state;
* ``peak_copies_train``: the same over the inner steps (gradients are one more copy; activations
  come on top and do not scale with θ);
* ``peer_commit_seconds_per_param``: the commit's wall time per parameter, mean over windows;
  ``blocking_commit_seconds_per_param``: the part of it the training thread waits for.

Linux only (``/proc/self/status``, ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from client.lane import Lane
from client.replica import FullReplica
from client.state import LocalState, Snapshot, detached
from client.trainer import pseudo_gradient, snapshot
from client.window import Trained, WindowJob
from protocol.config import RunSpec
from protocol.feedback import FeedbackBuffers, compress_step

M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc)


@dataclass
class Result:
    mode: str
    params: int
    peer_state_copies: float
    peak_copies_fold: float
    peak_copies_train: float
    peer_commit_seconds_per_param: float
    blocking_commit_seconds_per_param: float
    commit_bytes_per_param: float


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_high_water() -> int:
    """Reset VmHWM to the current resident size; returns that size."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def _live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor the process still references, each counted once."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _spec(args: argparse.Namespace) -> RunSpec:
    return RunSpec.from_dict(
        {
            "name": "bench-peer",
            "model": {
                "dim": args.dim,
                "n_layers": args.layers,
                "n_heads": max(1, args.dim // 64),
                "ffn_dim": args.dim * 8 // 3 // 64 * 64 + 64,
                "max_seq_len": args.seq_len,
            },
            "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
            "inner": {"steps": args.steps, "warmup_steps": 1, "total_steps": 1000},
        }
    )


def run(mode: str, args: argparse.Namespace) -> Result:
    spec = _spec(args)
    replica = FullReplica(spec, data_key="bench", micro_batch_size=args.batch_size)
    theta = snapshot(replica.model)
    n = sum(t.numel() for t in theta.values())
    copy = 4 * n
    e = FeedbackBuffers({k: torch.zeros_like(v) for k, v in theta.items()})
    lane = Lane()
    steady: list[float] = []
    fold_peaks: list[float] = []
    train_peaks: list[float] = []
    commit_s: list[float] = []
    blocking_s: list[float] = []
    written: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        state = LocalState(Path(tmp))
        for window in range(args.windows):
            before_train = _live_tensor_bytes()
            base_rss = _reset_high_water()
            job = WindowJob(window, theta, "0" * 64, e.view(), report=lambda **_: None, should_stop=lambda: False)
            work = replica.train(job)
            del job  # its view of e is no copy while e stays, but would keep a replaced e alive
            assert isinstance(work, Trained)
            train_peaks.append((before_train + _status()["VmHWM"] - base_rss) / copy)
            before_fold = _live_tensor_bytes()
            base_rss = _reset_high_water()
            moments = mode == "before" or window % args.moments_every == 0
            if mode == "before":
                delta = pseudo_gradient(theta, replica.model)
                _, after = compress_step(e.view(), delta, beta=spec.outer.beta, cfg=spec.codec)
                del delta
                e.adopt(after)
                del after
            else:
                work.fold(e, {})
            optimizer = detached(work.optimizer_after)
            snap = Snapshot(spec.hash(), window + 1, "0" * 64, "0" * 64, feedback=e.state_dict(), optimizer=optimizer)
            tc = time.perf_counter()
            if mode == "before":
                state.save(snap, feedback=True, moments=True)
                blocking_s.append(time.perf_counter() - tc)
                commit_s.append(time.perf_counter() - tc)
            else:
                saved = lane.submit(_timed, state.save, snap, feedback=True, moments=moments)
                blocking_s.append(time.perf_counter() - tc)
                commit_s.append(saved.result())  # waited for here only to measure it
            del snap, optimizer, work
            fold_peaks.append((before_fold + _status()["VmHWM"] - base_rss) / copy)
            written.append(4 + (8 if moments else 0))
            for name, p in replica.model.named_parameters():  # the aggregate: θ ← θ_local (any change will do)
                theta[name].copy_(p.detach())
            steady.append(_live_tensor_bytes() / copy)
    lane.close()
    later = slice(1, None) if args.windows > 1 else slice(None)  # the first window allocates the moments
    return Result(
        mode=mode,
        params=n,
        peer_state_copies=round(max(steady[later]), 2),
        peak_copies_fold=round(max(fold_peaks[later]), 2),
        peak_copies_train=round(max(train_peaks[later]), 2),
        peer_commit_seconds_per_param=_per_param(commit_s[later], n),
        blocking_commit_seconds_per_param=_per_param(blocking_s[later], n),
        commit_bytes_per_param=round(sum(written[later]) / len(written[later]), 2),
    )


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def _per_param(seconds: list[float], n: int) -> float:
    return float(f"{sum(seconds) / len(seconds) / n:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="inner steps per window (H)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--moments-every", type=int, default=3, help="peer.moments_every of the 'after' mode")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("bench_peer.py measures resident memory through /proc: Linux only")
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16)  # freed tensors leave the heap at once
    torch.set_num_threads(args.threads)
    results = [run(mode, args) for mode in ("before", "after")]
    if args.json:
        print(json.dumps({"config": vars(args), "results": [r.__dict__ for r in results]}))
        return
    table = Table(title=f"peer memory and commits, {results[0].params:,} parameters, CPU")
    for column in (
        "mode",
        "steady copies",
        "peak copies (fold+commit)",
        "peak copies (train)",
        "commit s/param",
        "blocking s/param",
        "commit B/param",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.mode,
            f"{r.peer_state_copies:.2f}",
            f"{r.peak_copies_fold:.2f}",
            f"{r.peak_copies_train:.2f}",
            f"{r.peer_commit_seconds_per_param:.3g}",
            f"{r.blocking_commit_seconds_per_param:.3g}",
            f"{r.commit_bytes_per_param:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
