"""The validator's durable state: where window t stands, every window; θ only now and then.

Two files in the state directory:

* ``state.json`` — the commit point, replaced atomically (temp file, fsync, rename) after every
  published aggregate: the window now open, the digest of the aggregate it trained from, when it
  opened, the run hash, the launch (the digest and time of the genesis manifest this chain grows
  from), the norm reference learned from accepted updates with its long-horizon baseline
  (:mod:`validator.reference`) and every peer's standing with its tenure
  (:mod:`validator.reputation`), folded once per window, so that neither a window
  nor a restart reads the contribution log's history. A few hundred bytes per peer.
* ``state.safetensors`` — θ at some window ``w₀ ≤ t`` (its metadata says which, and the base of
  ``w₀``): written at genesis and at every checkpoint window, when θ is published anyway, never
  every window (θ of a 1B model is 4 GB).

A restart loads θ_{w₀} (θ₀ from the RunSpec when there is no θ file yet) and applies the aggregates
``w₀ … t − 1`` from the store — the ones a peer joining at the last checkpoint applies too — checking
each against its signed fingerprint and the chain against ``state.json``'s base
(``Validator.resume``). ``state.json`` is written before θ, so θ's window never runs ahead of it; a
validator killed at any instant restarts either before or after a window, never in between; the
store tells which (an aggregate already published for the saved window is adopted, not recomputed).

A state directory written by an older version (``state.safetensors`` alone, θ of the open window
with the same metadata) loads as it is; its standings are folded from the log once.

With ``outer.recompress`` the validator also carries an error-feedback buffer ``e``
(:mod:`protocol.broadcast`). ``feedback-<window>.safetensors`` holds the ``e`` that opens
``window``, tagged with the digest of the aggregate it follows. The file for window t + 1 is
written *before* aggregate t is put (write-ahead) and the one for t stays until the state file has
moved to t + 1, so whichever way a restart finds the store, the buffer that matches it is on disk:
aggregate t not published → ``e_t`` (the window is decided again from it); published → the
``e_{t+1}`` whose tag is that aggregate's digest. Nothing is lost or applied twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from protocol.errors import ConfigError
from protocol.feedback import FeedbackState
from protocol.files import atomic_write
from validator.reference import NormReference
from validator.reputation import Standing

__all__ = [
    "PROGRESS_FILE",
    "STATE_FILE",
    "ValidatorState",
    "load_feedback",
    "load_state",
    "prune_feedback",
    "save_feedback",
    "save_state",
]

STATE_FILE = "state.safetensors"  # θ at the window in its metadata
PROGRESS_FILE = "state.json"  # where the validator stands: the commit point of every window
_STATE_VERSION = 1


@dataclass
class ValidatorState:
    """Window ``window`` is open; ``params`` is θ of ``params_window`` (None: of ``window``), which
    a loaded state may hold older than ``window`` until the aggregates since are replayed."""

    run_hash: str
    window: int  # the window now open
    base: str  # digest of aggregate window − 1, or the launch
    opened_at: float  # published_at of aggregate window − 1 (or of genesis)
    params: dict[str, torch.Tensor]
    launch: str  # digest of the genesis manifest: the base of window 0 and the root of the chain
    launched_at: float  # its published_at, so that the same genesis can be written again
    previous_base: str  # the base of window − 1 (window 0: the launch); accepted with outer.delay = 1
    reference: NormReference = field(default_factory=NormReference)  # empty: none learned yet
    standings: dict[str, Standing] | None = None  # before ``window``; None: not saved (older state)
    params_window: int | None = None  # the window ``params`` opens (None: ``window``); {} params: θ₀
    params_base: str | None = None  # the base of ``params_window`` (None: ``base``)

    @property
    def current(self) -> bool:
        """``params`` is θ of the open window."""
        return self.params_window is None or self.params_window == self.window


def save_state(directory: str | Path, state: ValidatorState, *, params: bool = True) -> None:
    """Write ``state.json`` and then, with ``params``, θ (which must be current): θ's file never
    names a window after the one ``state.json`` does."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    progress = {
        "version": _STATE_VERSION,
        "run_hash": state.run_hash,
        "window": state.window,
        "base": state.base,
        "opened_at": state.opened_at,
        "launch": state.launch,
        "launched_at": state.launched_at,
        "previous_base": state.previous_base,
        "reference": state.reference.to_json(),
        "standings": None if state.standings is None else _standings_json(state.standings),
    }
    atomic_write(d / PROGRESS_FILE, json.dumps(progress, sort_keys=True, separators=(",", ":")).encode())
    if not params:
        return
    if not state.current:
        raise ValueError("θ can be saved only for the open window")
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
    """The saved state, or None when there is none. Its ``params`` may be θ of an earlier window
    (``params_window``; ``{}`` when only θ₀ is known). A state of another run is a ConfigError
    (the operator pointed ``--state`` at the wrong directory)."""
    d = Path(directory)
    progress, theta = d / PROGRESS_FILE, d / STATE_FILE
    if not progress.exists() and not theta.exists():
        return None
    try:
        params, meta = _load_params(theta) if theta.exists() else ({}, None)
        if progress.exists():
            raw = json.loads(progress.read_bytes())
            state = _from_progress(raw, params, meta)
        elif meta is not None:  # an older state directory: θ of the open window, with its place
            state = _from_meta(meta, params)
        else:  # unreachable: one of the two files exists
            return None
    except (SafetensorError, KeyError, ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"validator state in {d} is unreadable: {exc}") from exc
    if state.run_hash != run_hash:
        raise ConfigError(f"validator state in {d} belongs to run {state.run_hash[:16]}…, not {run_hash[:16]}…")
    if meta is not None and meta["run_hash"] != run_hash:
        raise ConfigError(f"{theta} belongs to run {meta['run_hash'][:16]}…, not {run_hash[:16]}…")
    if state.params_window is not None and state.params_window > state.window:
        raise ConfigError(f"{theta} holds θ of window {state.params_window}, after the saved window {state.window}")
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


def _load_params(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return dict(st_load(path.read_bytes())), meta


def _from_meta(meta: dict[str, str], params: dict[str, torch.Tensor]) -> ValidatorState:
    return ValidatorState(
        run_hash=meta["run_hash"],
        window=int(meta["window"]),
        base=meta["base"],
        opened_at=float(meta["opened_at"]),
        params=params,
        launch=meta["launch"],
        launched_at=float(meta["launched_at"]),
        previous_base=meta.get("previous_base", meta["base"]),  # older files: only the base is accepted
        reference=NormReference.from_json(meta.get("reference", "{}")),
    )


def _from_progress(raw: Any, params: dict[str, torch.Tensor], meta: dict[str, str] | None) -> ValidatorState:
    if not isinstance(raw, dict) or raw.get("version") != _STATE_VERSION:
        raise ValueError(f"{PROGRESS_FILE} is not a state this version writes")
    standings = raw["standings"]
    return ValidatorState(
        run_hash=str(raw["run_hash"]),
        window=int(raw["window"]),
        base=str(raw["base"]),
        opened_at=float(raw["opened_at"]),
        params=params,
        launch=str(raw["launch"]),
        launched_at=float(raw["launched_at"]),
        previous_base=str(raw["previous_base"]),
        reference=NormReference.from_json(str(raw["reference"])),
        standings=None if standings is None else _standings_of(standings),
        params_window=int(meta["window"]) if meta is not None else 0,
        params_base=meta["base"] if meta is not None else str(raw["launch"]),
    )


def _standings_json(standings: dict[str, Standing]) -> dict[str, list[float | int]]:
    return {
        p: [s.reputation, s.failures, s.excluded_until, s.windows, s.passes, s.tenure]
        for p, s in sorted(standings.items())
    }


def _standings_of(raw: Any) -> dict[str, Standing]:
    if not isinstance(raw, dict):
        raise ValueError("standings are a JSON object")
    out = {}
    for peer, v in raw.items():
        # five fields: written before tenure was kept (no peer is senior until it uploads again)
        if not (isinstance(v, list) and len(v) in (5, 6)):
            raise ValueError(
                f"standing of {peer!r} is not [reputation, failures, excluded_until, windows, passes, tenure]"
            )
        tenure = int(v[5]) if len(v) == 6 else 0
        out[str(peer)] = Standing(float(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), tenure)
    return out
