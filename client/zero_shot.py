"""Zero-shot benchmark tasks through lm-evaluation-harness, on an exported model (``sparseloco eval``).

lm-eval is optional and never installed by this project; its tasks read their data from the
Hugging Face cache. Both are looked for, never fetched: lm-eval runs with the Hub and ``datasets``
offline, and a task whose data is not on this machine is reported as skipped, with the reason::

    results = run_tasks("out/hf", ["arc_easy", "hellaswag"], device="cpu")
    for r in results:
        r.task, r.metrics or r.skipped        # {"acc": 0.27, "acc_norm": 0.26} / "lm_eval is not installed …"

The model is the ``transformers`` directory :func:`client.export.export_hf` writes, loaded by
lm-eval's own ``hf`` model (``LlamaForCausalLM``): what is measured is what users download.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TASKS", "TaskResult", "lm_eval_available", "run_tasks"]

DEFAULT_TASKS = ("arc_easy", "hellaswag", "piqa")
NOT_INSTALLED = "lm_eval is not installed (pip install lm-eval)"
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class TaskResult:
    """One task: its metrics (``acc``, ``acc_norm`` …, standard errors left out), or why it was skipped."""

    task: str
    metrics: dict[str, float] | None = None
    skipped: str | None = None


def lm_eval_available() -> bool:
    """Whether lm-eval can be imported (checked without importing it)."""
    return importlib.util.find_spec("lm_eval") is not None


def run_tasks(
    model_dir: str | Path,
    tasks: Sequence[str],
    *,
    device: str = "cpu",
    batch_size: int = 8,
    limit: int | None = None,
) -> list[TaskResult]:
    """Evaluate the exported model in ``model_dir`` zero-shot on each task, one at a time, offline."""
    if not tasks:
        return []
    if not lm_eval_available():
        return [TaskResult(t, skipped=NOT_INSTALLED) for t in tasks]
    with _offline():
        lm_eval: Any = importlib.import_module("lm_eval")
        return [_run_one(lm_eval, str(model_dir), t, device, batch_size, limit) for t in tasks]


def _run_one(lm_eval: Any, model_dir: str, task: str, device: str, batch_size: int, limit: int | None) -> TaskResult:
    try:
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": model_dir, "dtype": "float32"},
            tasks=[task],
            num_fewshot=0,
            batch_size=batch_size,
            device=device,
            limit=limit,
        )
    except Exception as exc:  # lm-eval and datasets raise many types for a missing task or missing data
        return TaskResult(
            task, skipped=f"task data not available locally or task unknown ({type(exc).__name__}: {exc})"
        )
    results = (out or {}).get("results", {}).get(task)
    if not results:
        return TaskResult(task, skipped="lm-eval returned no results for this task")
    return TaskResult(task, metrics=_metrics(results))


def _metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"acc,none": 0.3, "acc_stderr,none": 0.01, "alias": …}`` -> ``{"acc": 0.3}``."""
    out = {}
    for key, value in results.items():
        name = key.split(",", 1)[0]
        if "stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name] = float(value)
    return out


@contextmanager
def _offline() -> Iterator[None]:
    """The Hub and ``datasets`` offline for the duration (task data comes from the local cache only)."""
    saved = {k: os.environ.get(k) for k in _OFFLINE}
    os.environ.update(_OFFLINE)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
