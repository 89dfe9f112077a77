"""The validator's durable state: θ_t and where window t stands, and its error-feedback buffer.

``state.safetensors`` holds the parameters that open the current window plus metadata
(window, the digest of the aggregate it trained from and of the one before it, when the window
opened, the run hash, the launch: the digest and time of the genesis manifest this chain grows
from, and the norm reference learned from accepted updates, :mod:`validator.reference`). It is
replaced atomically (temp file, fsync, rename) after every published aggregate, so a validator
killed at any instant restarts either before or after a window, never in between; the store tells
which (an aggregate already published for the saved window is adopted, not recomputed).

With ``outer.recompress`` the validator also carries an error-feedback buffer ``e``
(:mod:`protocol.broadcast`). ``feedback-<window>.safetensors`` holds the ``e`` that opens
``window``, tagged with the digest of the aggregate it follows. The file for window t + 1 is
written *before* aggregate t is put (write-ahead) and the one for t stays until the state file has
moved to t + 1, so whichever way a restart finds the store, the buffer that matches it is on disk:
aggregate t not published → ``e_t`` (the window is decided again from it); published → the
``e_{t+1}`` whose tag is that aggregate's digest. Nothing is lost or applied twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from protocol.errors import ConfigError
from protocol.feedback import FeedbackState
from protocol.files import atomic_write
from validator.reference import NormReference

__all__ = [
    "STATE_FILE",
    "ValidatorState",
    "load_feedback",
    "load_state",
    "prune_feedback",
    "save_feedback",
    "save_state",
]

STATE_FILE = "state.safetensors"


@dataclass
class ValidatorState:
    run_hash: str
    window: int  # the window now open; ``params`` = θ_window
    base: str  # digest of aggregate window − 1, or the launch (window 0)
    opened_at: float  # published_at of aggregate window − 1 (or of genesis)
    params: dict[str, torch.Tensor]
    launch: str  # digest of the genesis manifest: the base of window 0 and the root of the chain
    launched_at: float  # its published_at, so that the same genesis can be written again
    previous_base: str  # the base of window − 1 (window 0: the launch); accepted with outer.delay = 1
    reference: NormReference = field(default_factory=NormReference)  # empty: none learned yet


def save_state(directory: str | Path, state: ValidatorState) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {
        "run_hash": state.run_hash,
        "window": str(state.window),
        "base": state.base,
        "opened_at": repr(state.opened_at),
        "launch": state.launch,
        "launched_at": repr(state.launched_at),
        "previous_base": state.previous_base,
        "reference": state.reference.to_json(),
    }
    blob = st_save({n: t.detach().to("cpu").contiguous() for n, t in state.params.items()}, metadata=meta)
    atomic_write(d / STATE_FILE, blob)


def load_state(directory: str | Path, run_hash: str) -> ValidatorState | None:
    """The saved state, or None when there is none. A state of another run is a ConfigError (the
    operator pointed ``--state`` at the wrong directory)."""
    path = Path(directory) / STATE_FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        params = st_load(path.read_bytes())
        state = ValidatorState(
            run_hash=meta["run_hash"],
            window=int(meta["window"]),
            base=meta["base"],
            opened_at=float(meta["opened_at"]),
            params=dict(params),
            launch=meta["launch"],
            launched_at=float(meta["launched_at"]),
            previous_base=meta["previous_base"],
            reference=NormReference.from_json(meta.get("reference", "{}")),
        )
    except (SafetensorError, KeyError, ValueError, OSError) as exc:
        raise ConfigError(f"validator state {path} is unreadable: {exc}") from exc
    if state.run_hash != run_hash:
        raise ConfigError(f"validator state {path} belongs to run {state.run_hash[:16]}…, not {run_hash[:16]}…")
    return state


# ---------------------------------------------------------------------- error feedback
def _feedback_path(directory: str | Path, window: int) -> Path:
    return Path(directory) / f"feedback-{window:08d}.safetensors"


def save_feedback(directory: str | Path, window: int, base: str, state: FeedbackState) -> None:
    """Write the buffer that opens ``window``, which follows the aggregate with digest ``base``
    (call it before that aggregate is put)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    blob = st_save(state.state_dict(), metadata={"window": str(window), "base": base})
    atomic_write(_feedback_path(d, window), blob)


def load_feedback(directory: str | Path, window: int, base: str) -> FeedbackState | None:
    """The buffer that opens ``window`` after aggregate ``base``; None when no file was written for
    exactly that (the aggregate was published by an attempt whose buffer is gone, or never was)."""
    path = _feedback_path(directory, window)
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        buffers = st_load(path.read_bytes())
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"validator error-feedback file {path} is unreadable: {exc}") from exc
    if meta.get("window") != str(window) or meta.get("base") != base:
        return None
    return FeedbackState.from_state_dict(buffers)


def prune_feedback(directory: str | Path, before: int) -> None:
    """Remove the buffers of windows before ``before`` (the state file has moved past them)."""
    for path in Path(directory).glob("feedback-*.safetensors"):
        stem = path.name[len("feedback-") : -len(".safetensors")]
        if stem.isdigit() and int(stem) < before:
            path.unlink(missing_ok=True)
