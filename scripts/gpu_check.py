#!/usr/bin/env python
"""One prepared GPU check: what the 1B peer and the validator's scoring do on one card.

    bash scripts/gpu_check.sh                 # one GPU, a CUDA build of torch: ≤ 8 minutes
    bash scripts/gpu_check.sh --dry-run       # the same steps on the CPU, tiny model, < 1 minute
    bash scripts/gpu_check.sh --steps 8       # H = 8 inner steps instead of 4

Four sections, each through the project's own code and each on its own time budget (a section
that runs past it is stopped and recorded as failed; the run as a whole stays under
``--budget`` seconds):

* ``micro_batch``: the automatic micro-batch (:func:`client.memory.auto_micro_batch`) of the run's
  model with the model on the device, beside the footprint's suggestion
  (:func:`client.footprint.suggest_micro_batch`) and the free memory both start from.
* ``scoring``: the validator's scoring forward, :func:`protocol.model.eval_loss` (eval mode, bf16
  autocast on CUDA) over ``--score-sequences`` × ``--score-seq-len`` tokens, the figure
  ``scripts/bench_scale.py`` assumes (40,000 tokens/s forward for the 1B model).
* ``train_window``: one window of a peer — :class:`client.replica.FullReplica` (micro-batch
  automatic), H inner AdamW steps on its assigned batches of the local built-in corpus, then the
  fold of Δ into e (:meth:`client.window.Trained.fold`, on the CPU as in a GPU peer). Tokens/s over
  the window and over its steps after the first; the device's peak (``max_memory_allocated``) in
  units of 4·P bytes (one fp32 copy of θ); and ``peer_state_copies`` as ``scripts/bench_peer.py``
  defines it — every tensor alive after the window (θ and e on the host, the working model and the
  two AdamW moments on the device), against the 5 copies BENCHMARKS.md states.
* ``codec``: random heavy-tailed pseudo-gradients (and error-feedback buffers) shaped like every
  parameter of the model, encoded on the device — :func:`protocol.codec.encode` + ``pack``, and
  :func:`protocol.feedback.compress_step` — timed; then the same tensors on the CPU, compared byte
  for byte (``pack`` of each tensor) and bit for bit (e′), tensors of distinct shapes first, until
  ``--codec-cpu-seconds`` are spent (the JSON says how many tensors and parameters were compared).

Progress goes to stderr; a table, then one JSON object as the last line, to stdout. The exit
status is 0 when every section passed, 1 otherwise (a failed section's error is in the JSON).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:  # a machine without the project's dependencies still gets its JSON line (main)
    from client.footprint import available_memory, footprint, suggest_micro_batch
    from client.memory import TRAINING_BYTES_PER_PARAM, activation_bytes_per_sequence, auto_micro_batch
    from client.replica import FullReplica
    from client.trainer import snapshot
    from client.window import Trained, WindowJob
    from protocol.codec import encode, pack
    from protocol.config import RunSpec
    from protocol.feedback import FeedbackBuffers, FeedbackState, compress_step
    from protocol.model import build_model, eval_loss, param_schema
except ImportError as exc:
    IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    IMPORT_ERROR = None

CLAIM_COPIES = 5.0  # fp32 copies of θ a peer holds between windows (BENCHMARKS.md, bench_peer.py)
ASSUMED_SCORING_TOKENS_PER_S = 40_000.0  # scripts/bench_scale.py's GPU_TOKENS_PER_S
SECTIONS = ("micro_batch", "scoring", "train_window", "codec")
M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc)


class SectionTimeout(Exception):
    """A section ran past its time budget."""


@dataclass(frozen=True)
class Plan:
    device: torch.device
    preset: str
    seq_len: int
    batch_size: int
    steps: int
    score_sequences: int
    score_seq_len: int
    score_rows: int
    score_repeats: int
    codec_tensors: int  # 0: every parameter tensor of the model
    codec_cpu_seconds: float
    budget: float
    budgets: dict[str, float]

    def spec(self) -> RunSpec:
        return RunSpec.from_dict(
            {
                "name": "gpu-check",
                "model": {"preset": self.preset, "max_seq_len": max(self.seq_len, self.score_seq_len)},
                "data": {"seq_len": self.seq_len, "batch_size": self.batch_size},
                "inner": {"steps": self.steps, "warmup_steps": 1, "total_steps": 1000},
            }
        )


# ---------------------------------------------------------------------- helpers
T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[gpu_check {time.monotonic() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def live_cpu_tensor_bytes() -> int:
    """Bytes of the storages of every CPU tensor still referenced, each counted once
    (``scripts/bench_peer.py``'s measure)."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, value = line.split(":", 1)
                if name == key:
                    return int(value.split()[0]) * 1024
    except OSError:
        pass
    return None


def reset_high_water() -> int | None:
    """Reset VmHWM to the current resident size (Linux); returns that size, None if unsupported."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_status("VmRSS")


def fix_mmap_threshold() -> None:
    """glibc: tensors of 64 KiB and more get their own mappings, so that a freed one leaves the
    process at once and the resident high-water mark measures what a phase allocates
    (``scripts/bench_peer.py`` does the same)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16)
    except (OSError, AttributeError):
        pass


def n_params(spec: RunSpec) -> int:
    return sum(math.prod(shape) for shape in param_schema(spec.model).values())


def rate(x: float, seconds: float) -> float:
    return float(f"{x / max(seconds, 1e-9):.4g}")


@dataclass
class Clock:
    """A section's deadline (monotonic seconds)."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _on_alarm(signum: int, frame: Any) -> None:
    raise SectionTimeout("the section ran past its time budget")


def run_section(name: str, budget: float, fn: Callable[[Clock], dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """Run one section under ``budget`` seconds (SIGALRM stops it); its figures, ``ok`` and
    ``error``. Whatever the section leaves behind is freed before the next one."""
    left = plan.budget - (time.monotonic() - T0)
    budget = min(budget, left - 1.0)
    if budget < 2.0:
        progress(f"{name}: skipped, the run's time budget is spent")
        return {"ok": False, "error": "skipped: the run's time budget was spent", "seconds": 0.0}
    progress(f"{name}: start (budget {budget:.0f} s)")
    t0 = time.monotonic()
    out: dict[str, Any]
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        out = fn(Clock(t0 + budget))
        out.setdefault("ok", "error" not in out)
        out.setdefault("error", None)
    except Exception as exc:  # a failed section is recorded; the next one still runs
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb[-4:])[-2000:]}
        del exc, tb
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    out["seconds"] = round(time.monotonic() - t0, 2)
    free_memory(plan.device)
    state = "ok" if out["ok"] else f"FAILED: {out['error']}"
    progress(f"{name}: {state} ({out['seconds']} s)")
    return out


# ---------------------------------------------------------------------- sections
def section_micro_batch(plan: Plan, ctx: dict[str, Any], clock: Clock) -> dict[str, Any]:
    spec, dev = plan.spec(), plan.device
    p = n_params(spec)
    t0 = time.monotonic()
    model = build_model(spec.model)
    build_s = time.monotonic() - t0
    progress(f"micro_batch: {p / 1e6:.1f} M-parameter model built on the CPU in {build_s:.1f} s")
    model = model.to(dev)
    sync(dev)
    ctx["model"] = model  # the scoring section reuses it
    auto = auto_micro_batch(spec.model, spec.data, dev)
    out: dict[str, Any] = {
        "preset": plan.preset,
        "params": p,
        "seq_len": spec.data.seq_len,
        "batch_size": spec.data.batch_size,
        "auto_micro_batch": auto,
        "sequences_per_pass": auto or spec.data.batch_size,
        "activation_bytes_per_sequence": activation_bytes_per_sequence(spec.model, spec.data.seq_len),
        "reserved_training_bytes": TRAINING_BYTES_PER_PARAM * p,
        "model_build_s": round(build_s, 2),
    }
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        out |= {"device_free_bytes": int(free), "device_total_bytes": int(total)}
    fp = footprint(spec, dev.type)
    suggestion = suggest_micro_batch(fp, spec.data.batch_size, available_memory(str(dev)))
    out["footprint_suggestion"] = suggestion  # 0: the whole batch; None: not even one sequence fits
    out["footprint_activation_bytes_per_sequence"] = fp.activations_per_sequence
    return out


def section_scoring(plan: Plan, ctx: dict[str, Any], clock: Clock) -> dict[str, Any]:
    spec, dev = plan.spec(), plan.device
    model = ctx.pop("model", None)
    if model is None:
        model = build_model(spec.model).to(dev)
    gen = torch.Generator().manual_seed(1)
    rows = max(1, min(plan.score_rows, plan.score_sequences))
    batches: list[torch.Tensor] = []
    left = plan.score_sequences
    while left > 0:
        n = min(rows, left)
        batches.append(torch.randint(0, spec.model.vocab_size, (n, plan.score_seq_len + 1), generator=gen))
        left -= n
    tokens = plan.score_sequences * plan.score_seq_len
    t0 = time.monotonic()
    first = eval_loss(model, batches, dev)  # warm-up: kernels, allocator
    warm_s = time.monotonic() - t0
    times: list[float] = []
    loss = first
    while len(times) < plan.score_repeats and (not times or clock.left() > 2 * max(times) + 1.0):
        t0 = time.perf_counter()
        loss = eval_loss(model, batches, dev)  # float(loss) inside: synchronised
        times.append(time.perf_counter() - t0)
    total = sum(times)
    out: dict[str, Any] = {
        "sequences": plan.score_sequences,
        "seq_len": plan.score_seq_len,
        "rows_per_forward": rows,
        "repeats": len(times),
        "warmup_s": round(warm_s, 3),
        "seconds_per_evaluation": round(total / len(times), 4),
        "tokens_per_s": rate(tokens * len(times), total),
        "assumed_tokens_per_s": ASSUMED_SCORING_TOKENS_PER_S,
        "loss": round(loss, 4),
        "autocast": "bf16" if dev.type == "cuda" else "off (fp32)",
    }
    out["vs_assumed"] = round(out["tokens_per_s"] / ASSUMED_SCORING_TOKENS_PER_S, 3)
    if not math.isfinite(loss):
        out["error"] = f"the scoring loss is not finite ({loss})"
    return out


def section_train(plan: Plan, ctx: dict[str, Any], clock: Clock) -> dict[str, Any]:
    spec, dev = plan.spec(), plan.device
    p = n_params(spec)
    copy = 4 * p
    cuda = dev.type == "cuda"
    device_before = torch.cuda.memory_allocated(dev) if cuda else 0
    t0 = time.monotonic()
    replica = FullReplica(spec, data_key="gpu-check", device=dev, micro_batch_size=0)
    setup_s = time.monotonic() - t0
    micro = replica.trainer.micro_batch_size
    progress(f"train_window: replica on {dev} in {setup_s:.1f} s, micro-batch {micro or spec.data.batch_size}")
    theta = snapshot(replica.model)
    e = FeedbackBuffers({k: torch.zeros_like(v) for k, v in theta.items()})
    stamps: list[tuple[int, float]] = []

    def report(**fields: Any) -> None:
        sync(dev)  # the step's optimizer update included
        stamps.append((int(fields.get("step", 0)), time.perf_counter()))
        progress(f"train_window: step {fields.get('step')}/{fields.get('steps')} loss {fields.get('loss', 0.0):.4f}")

    host_train = live_cpu_tensor_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base_rss = None
    else:
        base_rss = reset_high_water()
    job = WindowJob(0, theta, "0" * 64, e.view(), report=report, should_stop=lambda: False)
    t_start = time.perf_counter()
    work = replica.train(job)
    sync(dev)
    del job
    if not isinstance(work, Trained):
        return {"error": f"the window was skipped: {work.reason}"}
    train_wall = time.perf_counter() - t_start
    if cuda:
        device_peak = torch.cuda.max_memory_allocated(dev) - device_before
        device_peak_reserved = torch.cuda.max_memory_reserved(dev)
        peak_total = device_peak + host_train
    else:  # the device is the host: the process's resident high-water mark over the window
        hwm = proc_status("VmHWM")
        peak_total = host_train + (hwm - base_rss) if hwm is not None and base_rss is not None else host_train
        device_peak = device_peak_reserved = peak_total
    stats = work.stats
    tokens_per_step = spec.data.batch_size * spec.data.seq_len
    steady_rate = None
    if len(stamps) >= 2:
        steady_rate = rate(tokens_per_step * (stamps[-1][0] - stamps[0][0]), stamps[-1][1] - stamps[0][1])
    t_fold = time.perf_counter()
    encoded = work.fold(e, {})
    fold_s = time.perf_counter() - t_fold
    payload = sum(len(pack(enc)) for enc in encoded.values())
    del encoded, work
    sync(dev)
    host_steady = live_cpu_tensor_bytes()
    device_steady = (torch.cuda.memory_allocated(dev) - device_before) if cuda else host_steady
    steady = (device_steady + host_steady if cuda else host_steady) / copy
    out: dict[str, Any] = {
        "preset": plan.preset,
        "params": p,
        "device": str(dev),
        "memory": "CUDA allocator + host tensors" if cuda else "host only (the device is the host)",
        "inner_steps": stamps[-1][0] if stamps else spec.inner.steps,
        "batch_size": spec.data.batch_size,
        "seq_len": spec.data.seq_len,
        "micro_batch_size": micro,
        "sequences_per_pass": micro or spec.data.batch_size,
        "replica_setup_s": round(setup_s, 2),
        "inner_s": round(stats.inner_s, 3),
        "train_wall_s": round(train_wall, 3),
        "tokens": stats.tokens,
        "tokens_per_s": rate(stats.tokens, stats.inner_s),
        "tokens_per_s_after_first_step": steady_rate,
        "model_tflops_6p": rate(6 * p * stats.tokens, stats.inner_s * 1e12),
        "loss_first": round(stats.loss_first, 4),
        "loss_last": round(stats.loss_last, 4),
        "fold_s": round(fold_s, 3),
        "payload_bytes": payload,
        "payload_bits_per_param": round(8 * payload / p, 4),
        "device_peak_bytes": device_peak,
        "device_peak_reserved_bytes": device_peak_reserved,
        "peak_device_copies": round(device_peak / copy, 2),
        "peak_copies_train": round(peak_total / copy, 2),
        "device_steady_copies": round(device_steady / copy, 2),
        "host_steady_copies": round(host_steady / copy, 2),
        "peer_state_copies": round(steady, 2),
        "claim_copies": CLAIM_COPIES,
        "steady_matches_claim": abs(steady - CLAIM_COPIES) <= 0.25,
    }
    # What client.memory's choice assumed the window would take on the device.
    assumed = copy + TRAINING_BYTES_PER_PARAM * p
    assumed += (micro or spec.data.batch_size) * activation_bytes_per_sequence(spec.model, spec.data.seq_len)
    out["memory_estimate_bytes"] = assumed
    if cuda:
        out["peak_over_estimate"] = round(device_peak / assumed, 3)
    if not (math.isfinite(stats.loss_first) and math.isfinite(stats.loss_last)):
        out["error"] = "the training loss is not finite"
    del replica, theta, e
    return out


def _student_t(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Student-t ν = 3 values × 1e-3 (heavy tails, like pseudo-gradients), generated on ``device``."""
    z = torch.randn(shape, generator=gen, device=device)
    chi2 = torch.zeros(shape, device=device)
    for _ in range(3):
        chi2.add_(torch.randn(shape, generator=gen, device=device).square_())
    return z.mul_(chi2.div_(3.0).rsqrt_()).mul_(1e-3)


def _distinct_shapes_first(schema: dict[str, tuple[int, ...]]) -> list[str]:
    seen: set[tuple[int, ...]] = set()
    first, rest = [], []
    for name, shape in schema.items():
        (rest if shape in seen else first).append(name)
        seen.add(shape)
    return first + rest


def section_codec(plan: Plan, ctx: dict[str, Any], clock: Clock) -> dict[str, Any]:
    spec, dev = plan.spec(), plan.device
    cfg, beta = spec.codec, spec.outer.beta
    schema = param_schema(spec.model)
    if plan.codec_tensors:
        schema = dict(list(schema.items())[: plan.codec_tensors])
    total = sum(math.prod(s) for s in schema.values())
    gen = torch.Generator(device=dev).manual_seed(2)
    delta = {n: _student_t(s, gen, dev) for n, s in schema.items()}
    old = {n: _student_t(s, gen, dev) for n, s in schema.items()}
    sync(dev)
    progress(f"codec: {len(schema)} tensors, {total / 1e6:.1f} M values on {dev}")
    # Warm-up on the smallest 2-D tensor (kernels, allocator): not timed.
    warm = min((n for n, s in schema.items() if len(s) == 2), key=lambda n: math.prod(schema[n]), default=None)
    if warm is not None:
        pack(encode(delta[warm], cfg))
        compress_step(FeedbackState({warm: old[warm]}), {warm: delta[warm]}, beta=beta, cfg=cfg)
        sync(dev)
    t0 = time.perf_counter()
    enc = {n: encode(x, cfg) for n, x in delta.items()}
    sync(dev)
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blobs = {n: pack(x) for n, x in enc.items()}
    pack_s = time.perf_counter() - t0
    del enc
    t0 = time.perf_counter()
    sent, after = compress_step(FeedbackState(old), delta, beta=beta, cfg=cfg)
    sync(dev)
    step_s = time.perf_counter() - t0
    step_blobs = {n: pack(x) for n, x in sent.items()}
    del sent
    payload = sum(len(b) for b in step_blobs.values())
    progress(
        f"codec: {dev} encode {encode_s:.2f} s, pack {pack_s:.2f} s, compress_step {step_s:.2f} s; comparing on the CPU"
    )
    # The same inputs on the CPU, distinct shapes first, until the CPU budget is spent.
    cpu_deadline = min(time.monotonic() + plan.codec_cpu_seconds, clock.deadline - 3.0)
    compared = compared_params = 0
    cpu_encode_s = cpu_step_s = 0.0
    differ: list[str] = []
    e_differ: list[str] = []
    max_e_diff = 0.0
    for name in _distinct_shapes_first(schema):
        if compared and time.monotonic() > cpu_deadline:
            break
        d, o = delta[name].cpu(), old[name].cpu()
        t0 = time.perf_counter()
        cpu_blob = pack(encode(d, cfg))
        cpu_encode_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        cpu_sent, cpu_after = compress_step(FeedbackState({name: o}), {name: d}, beta=beta, cfg=cfg)
        cpu_step_blob = pack(cpu_sent[name])
        cpu_step_s += time.perf_counter() - t0
        if cpu_blob != blobs[name] or cpu_step_blob != step_blobs[name]:
            differ.append(name)
        mine, theirs = after.buffers[name].cpu(), cpu_after.buffers[name]
        if not torch.equal(mine, theirs):
            e_differ.append(name)
            max_e_diff = max(max_e_diff, float((mine - theirs).abs().max()))
        compared += 1
        compared_params += d.numel()
        del d, o, cpu_sent, cpu_after, mine, theirs
    out: dict[str, Any] = {
        "device": str(dev),
        "tensors_total": len(schema),
        "params_total": total,
        "k_per_4096": cfg.k,
        "encode_s": round(encode_s, 3),
        "pack_s": round(pack_s, 3),
        "compress_step_s": round(step_s, 3),
        "encode_mparams_per_s": rate(total / 1e6, encode_s),
        "compress_step_mparams_per_s": rate(total / 1e6, step_s),
        "payload_bytes": payload,
        "payload_bits_per_param": round(8 * payload / total, 4),
        "cpu_threads": torch.get_num_threads(),
        "tensors_compared": compared,
        "params_compared": compared_params,
        "compared": "all" if compared == len(schema) else "subset (distinct shapes first, then model order)",
        "cpu_encode_s": round(cpu_encode_s, 3),
        "cpu_encode_mparams_per_s": rate(compared_params / 1e6, cpu_encode_s),
        "cpu_compress_step_s": round(cpu_step_s, 3),
        "bytes_identical": not differ,
        "bytes_differ": differ[:8],
        "feedback_identical": not e_differ,
        "feedback_differ": e_differ[:8],
        "feedback_max_abs_diff": max_e_diff,
    }
    if differ:
        out["error"] = f"packed bytes differ from the CPU's on {len(differ)} of {compared} tensors"
    del delta, old, after, blobs, step_blobs
    return out


# ---------------------------------------------------------------------- report
HEADLINES = {
    "micro_batch": ["auto_micro_batch", "sequences_per_pass", "footprint_suggestion", "device_free_bytes"],
    "scoring": ["tokens_per_s", "vs_assumed", "seconds_per_evaluation", "rows_per_forward"],
    "train_window": [
        "tokens_per_s",
        "tokens_per_s_after_first_step",
        "sequences_per_pass",
        "peak_device_copies",
        "peak_copies_train",
        "peer_state_copies",
        "fold_s",
    ],
    "codec": [
        "encode_mparams_per_s",
        "compress_step_s",
        "payload_bits_per_param",
        "bytes_identical",
        "feedback_identical",
        "tensors_compared",
        "compared",
    ],
}


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def table(result: dict[str, Any]) -> str:
    head = (
        f"GPU check on {result['device']} ({result['device_name']}), torch {result['torch']}, "
        f"preset {result['preset']} ({result['params'] / 1e6:.1f} M parameters)"
        + (", dry run" if result["dry_run"] else "")
    )
    rows: list[tuple[str, str, str]] = [("section", "figure", "value")]
    for name in SECTIONS:
        sec = result["sections"][name]
        status = "ok" if sec["ok"] else "FAILED"
        rows.append((name, "status", f"{status} in {sec['seconds']} s"))
        if not sec["ok"]:
            rows.append(("", "error", str(sec["error"])[:100]))
        for key in HEADLINES[name]:
            if key in sec:
                rows.append(("", key, _fmt(sec[key])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [head, ""]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        f"{'all sections passed' if result['ok'] else 'FAILED: ' + ', '.join(result['failed'])} in {result['seconds']} s"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------- main
def make_plan(args: argparse.Namespace) -> Plan:
    dry = args.dry_run
    device = torch.device(args.device or ("cpu" if dry else "cuda"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # torch.cuda's memory calls want an index
    budgets = (
        {"micro_batch": 10.0, "scoring": 10.0, "train_window": 30.0, "codec": 20.0}
        if dry
        else {"micro_batch": 60.0, "scoring": 60.0, "train_window": 150.0, "codec": 150.0}
    )

    def pick(value: Any, dry_value: Any, gpu_value: Any) -> Any:
        return value if value is not None else (dry_value if dry else gpu_value)

    return Plan(
        device=device,
        preset=pick(args.preset, "tiny", "1b"),
        seq_len=pick(args.seq_len, 64, 2048),
        batch_size=pick(args.batch_size, 2, 16),
        steps=pick(args.steps, 2, 4),
        score_sequences=pick(args.score_sequences, 2, 16),
        score_seq_len=pick(args.score_seq_len, 64, 2048),
        score_rows=pick(args.score_rows, 2, 16),
        score_repeats=pick(args.score_repeats, 2, 3),
        codec_tensors=pick(args.codec_tensors, 6, 0),
        codec_cpu_seconds=pick(args.codec_cpu_seconds, 15.0, 90.0),
        budget=pick(args.budget, 90.0, 460.0),
        budgets=budgets,
    )


def describe(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU with the tiny model, < 1 minute")
    p.add_argument("--device", default=None, help="cuda (default), cuda:1, cpu (the default of --dry-run)")
    p.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --dry-run)")
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (default 2048)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per inner step (default 16)")
    p.add_argument("--steps", type=int, default=None, help="inner steps H of the window (default 4)")
    p.add_argument("--score-sequences", type=int, default=None, help="scoring sequences (default 16)")
    p.add_argument("--score-seq-len", type=int, default=None, help="scoring sequence length (default 2048)")
    p.add_argument("--score-rows", type=int, default=None, help="sequences per scoring forward (default 16)")
    p.add_argument("--score-repeats", type=int, default=None, help="timed scoring evaluations (default 3)")
    p.add_argument("--codec-tensors", type=int, default=None, help="codec on the first N tensors (0: all; default all)")
    p.add_argument("--codec-cpu-seconds", type=float, default=None, help="CPU time for the comparison (default 90)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 460)")
    args = p.parse_args(argv)
    global T0
    T0 = time.monotonic()  # the run's budget counts from here
    if IMPORT_ERROR is not None:
        why = f"the project does not import: {IMPORT_ERROR}"
        progress(why)
        failed = {name: {"ok": False, "error": why, "seconds": 0.0} for name in SECTIONS}
        print(
            json.dumps(
                {
                    "check": "gpu_check",
                    "dry_run": args.dry_run,
                    "torch": torch.__version__,
                    "sections": failed,
                    "failed": list(SECTIONS),
                    "ok": False,
                }
            )
        )
        return 1
    plan = make_plan(args)
    dev = plan.device
    spec = plan.spec()
    progress(f"device {dev}, preset {plan.preset}, {n_params(spec) / 1e6:.1f} M parameters, H = {plan.steps}")
    result: dict[str, Any] = {
        "check": "gpu_check",
        "dry_run": args.dry_run,
        "device": str(dev),
        "device_name": describe(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "preset": plan.preset,
        "params": n_params(spec),
        "plan": {
            "seq_len": plan.seq_len,
            "batch_size": plan.batch_size,
            "steps": plan.steps,
            "score": f"{plan.score_sequences} x {plan.score_seq_len}",
            "codec_tensors": plan.codec_tensors or "all",
            "codec_cpu_seconds": plan.codec_cpu_seconds,
            "budget_s": plan.budget,
            "section_budgets_s": plan.budgets,
        },
    }
    sections: dict[str, dict[str, Any]] = {}
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        sections = {name: {"ok": False, "error": why, "seconds": 0.0} for name in SECTIONS}
        progress(why)
    else:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            torch.zeros(1, device=dev)  # the CUDA context, before any section's clock starts
        else:
            fix_mmap_threshold()
        ctx: dict[str, Any] = {}
        funcs: dict[str, Callable[[Plan, dict[str, Any], Clock], dict[str, Any]]] = {
            "micro_batch": section_micro_batch,
            "scoring": section_scoring,
            "train_window": section_train,
            "codec": section_codec,
        }
        for name in SECTIONS:
            fn = funcs[name]
            sections[name] = run_section(name, plan.budgets[name], lambda clock, fn=fn: fn(plan, ctx, clock), plan)
            if name == "scoring":
                ctx.clear()
    result["sections"] = sections
    result["failed"] = [name for name in SECTIONS if not sections[name]["ok"]]
    result["ok"] = not result["failed"]
    result["seconds"] = round(time.monotonic() - T0, 1)
    print(table(result), flush=True)
    print(json.dumps(result, default=str), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
