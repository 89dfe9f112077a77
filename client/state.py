"""The peer's local state directory: everything a restart needs, and nothing pickled.

A peer that is killed (Ctrl-C, OOM, reboot) and started again resumes where it stopped, with the
same key, the same error-feedback buffer and the same inner optimizer moments::

    <state>/
      key.pem                       Ed25519 key (mode 0600) unless ``--key`` points elsewhere
      progress.json                 the commit record: window, base, fingerprint, file names + sha256
      feedback-<w>.safetensors      error-feedback buffer e
      optimizer-<w>.safetensors     inner AdamW state (tensors; its scalars live in progress.json)
      pending-<w>.bin               a signed contribution staged for upload (write-ahead)
      windows.jsonl                 one JSON object per applied aggregate (below)

``windows.jsonl`` is the peer's own account of the chain, appended as each aggregate is applied::

    {"window": 3, "aggregate": "<sha256 of the signed aggregate>", "fingerprint": "<θ after it>",
     "included": true, "weight": 1.0, "accepted": true, "reason": null, "score": 0.012,
     "reputation": 0.19, "time": 1738324803.1}

``fingerprint`` equal to the aggregate's signed fingerprint means this peer holds the swarm's θ
(``sparseloco status --run run.toml`` compares the last record with the store);
``accepted``/``reason``/``score``/``reputation`` are the validator's published outcome for this
peer's contribution to that window (None when it did not upload to it).

θ is not stored: a restart rebuilds it from the store's newest checkpoint and the aggregates after
it, which is also how the peer proves it holds the swarm's θ.

Saving is crash-safe: the data files are written under new names first, then ``progress.json`` is
replaced atomically (:func:`protocol.files.atomic_write`) and only then are the old files removed.
A crash at any point leaves a ``progress.json`` whose files all exist and whose sha256 match.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from protocol.errors import ConfigError
from protocol.files import atomic_write

STATE_VERSION = 1
_DATA_FILES = ("feedback-*.safetensors", "optimizer-*.safetensors", "pending-*.bin")
_TENSOR_TAG = "__tensor__"


@dataclass(frozen=True)
class Snapshot:
    """What the peer holds at a window boundary.

    ``window`` is the next window to train, ``fingerprint`` the sha256 of θ_window (after aggregate
    window−1) and ``base`` the digest of that aggregate (or of the genesis object). ``feedback`` is
    e, ``optimizer`` the inner optimizer's state_dict. ``pending`` is the window of a signed
    contribution staged for upload, whose bytes are in :attr:`pending_blob`; ``feedback`` and
    ``optimizer`` are the ones adopted with it (they already include that window's step).
    """

    run_hash: str
    window: int
    base: str
    fingerprint: str
    feedback: dict[str, Tensor] = field(default_factory=dict)
    optimizer: Any = None
    pending: int | None = None
    pending_blob: bytes | None = None


class LocalState:
    """A peer's state directory (see the module docstring for its layout)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".*.tmp"):  # a write interrupted by a crash; never committed
            stale.unlink(missing_ok=True)

    @property
    def key_path(self) -> Path:
        return self.root / "key.pem"

    @property
    def log_path(self) -> Path:
        return self.root / "windows.jsonl"

    # ------------------------------------------------------------------ snapshot
    def load(self, run_hash: str) -> Snapshot | None:
        """The last committed snapshot, or None for a fresh directory.

        A snapshot of another run is a :class:`ConfigError` (one state directory per run); a
        damaged one (missing file, wrong sha256) is too, because silently starting over would throw
        away the error feedback the operator expects to keep.
        """
        progress_file = self.root / "progress.json"
        if not progress_file.exists():
            return None
        try:
            meta = json.loads(progress_file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{progress_file} is unreadable: {exc}") from exc
        if meta.get("version") != STATE_VERSION:
            raise ConfigError(f"{progress_file}: unsupported state version {meta.get('version')!r}")
        if meta["run_hash"] != run_hash:
            raise ConfigError(
                f"state directory {self.root} belongs to run {meta['run_hash'][:16]}…, not {run_hash[:16]}…; "
                "use another --state directory"
            )
        files = meta["files"]
        pending_blob = self._read(files["pending"]) if files.get("pending") else None
        return Snapshot(
            run_hash=run_hash,
            window=int(meta["window"]),
            base=str(meta["base"]),
            fingerprint=str(meta["fingerprint"]),
            feedback=st_load(self._read(files["feedback"])) if files.get("feedback") else {},
            optimizer=unflatten(st_load(self._read(files["optimizer"])), meta["optimizer_tree"])
            if files.get("optimizer")
            else None,
            pending=meta.get("pending"),
            pending_blob=pending_blob,
        )

    def save(self, snap: Snapshot, *, tensors_unchanged: bool = False) -> None:
        """Commit ``snap`` atomically; remove the files of the previous commit afterwards.

        ``tensors_unchanged=True`` promises that ``feedback`` and ``optimizer`` equal the last
        commit's: their files are kept instead of rewritten (the commit after applying an aggregate
        only moves the window, and rewriting tens of MB per window would cost compute time).
        """
        previous = self._committed_meta()
        old = {f["file"] for f in previous.get("files", {}).values() if f}
        tag = f"{snap.window}-{time.time_ns()}"
        files: dict[str, dict[str, str] | None] = {
            "feedback": None,
            "optimizer": None,
            "pending": self._write(f"pending-{tag}.bin", snap.pending_blob) if snap.pending_blob else None,
        }
        tree: Any = None
        if tensors_unchanged and previous:
            files["feedback"] = previous["files"].get("feedback")
            files["optimizer"] = previous["files"].get("optimizer")
            tree = previous.get("optimizer_tree")
        else:
            if snap.feedback:
                files["feedback"] = self._write(f"feedback-{tag}.safetensors", st_save(_contiguous(snap.feedback)))
            if snap.optimizer is not None:
                tensors, tree = flatten(snap.optimizer)
                files["optimizer"] = self._write(f"optimizer-{tag}.safetensors", st_save(_contiguous(tensors)))
        meta = {
            "version": STATE_VERSION,
            "run_hash": snap.run_hash,
            "window": snap.window,
            "base": snap.base,
            "fingerprint": snap.fingerprint,
            "pending": snap.pending,
            "files": files,
            "optimizer_tree": tree,
            "saved_at": time.time(),
        }
        atomic_write(self.root / "progress.json", json.dumps(meta, indent=1).encode())
        new = {f["file"] for f in files.values() if f}
        # The previous commit's files, and any left by a save that crashed before its commit.
        leftovers = {p.name for pattern in _DATA_FILES for p in self.root.glob(pattern)}
        for name in (old | leftovers) - new:
            (self.root / name).unlink(missing_ok=True)

    def record(self, entry: dict[str, Any]) -> None:
        """Append one finished-window record to ``windows.jsonl``."""
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        lines = self.log_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    # ------------------------------------------------------------------ files
    def _committed_meta(self) -> dict[str, Any]:
        progress_file = self.root / "progress.json"
        if not progress_file.exists():
            return {}
        try:
            meta = json.loads(progress_file.read_text())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) and isinstance(meta.get("files"), dict) else {}

    def _write(self, name: str, data: bytes) -> dict[str, str]:
        atomic_write(self.root / name, data)
        return {"file": name, "sha256": hashlib.sha256(data).hexdigest()}

    def _read(self, ref: dict[str, str]) -> bytes:
        path = self.root / ref["file"]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"state file {path} is missing: {exc.strerror or exc}") from exc
        if hashlib.sha256(data).hexdigest() != ref["sha256"]:
            raise ConfigError(f"state file {path} is damaged (sha256 mismatch)")
        return data


# ---------------------------------------------------------------------- trees <-> safetensors
def flatten(tree: Any, prefix: str = "") -> tuple[dict[str, Tensor], Any]:
    """Split a nested dict/list of tensors and JSON scalars into (tensors by path, JSON skeleton).

    Used for optimizer state dicts: safetensors holds the tensors, the skeleton (with
    ``{"__tensor__": path}`` placeholders) goes to JSON. Dict keys become strings; int keys are
    kept as ``{"__int_keys__": ...}`` so the round trip is exact.
    """
    tensors: dict[str, Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, Tensor):
            tensors[path] = node.detach().cpu()
            return {_TENSOR_TAG: path}
        if isinstance(node, dict):
            int_keys = [k for k in node if isinstance(k, int)]
            out = {str(k): walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
            return {"__dict__": out, "__int_keys__": [str(k) for k in int_keys]}
        if isinstance(node, (list, tuple)):
            return {"__list__": [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise ConfigError(f"cannot store a {type(node).__name__} in the peer state ({path})")

    return tensors, walk(tree, prefix)


def unflatten(tensors: dict[str, Tensor], skeleton: Any) -> Any:
    """Inverse of :func:`flatten`."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _TENSOR_TAG in node:
                return tensors[node[_TENSOR_TAG]]
            if "__list__" in node:
                return [walk(v) for v in node["__list__"]]
            int_keys = set(node.get("__int_keys__", []))
            return {(int(k) if k in int_keys else k): walk(v) for k, v in node["__dict__"].items()}
        return node

    return walk(skeleton)


def _contiguous(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def tensors_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Exact equality of two tensor dicts (same keys, shapes, dtypes and bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )
