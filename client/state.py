"""The peer's local state directory: everything a restart needs, and nothing pickled.

A peer that is killed (Ctrl-C, OOM, reboot) and started again resumes where it stopped, with the
same key, the same error-feedback buffer and the same inner optimizer::

    <state>/
      key.pem                       Ed25519 key (mode 0600) unless ``--key`` points elsewhere
      progress.json                 the commit record: window, base, fingerprint, the staged window,
                                    the optimizer's scalars, file names + sha256
      feedback-<tag>.safetensors    error-feedback buffer e (4 bytes per parameter)
      moments-<tag>.safetensors     the inner optimizer's tensors: AdamW moments (8 bytes per parameter)
      pending-<tag>.bin             a signed contribution staged for upload (write-ahead)
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

**What each commit writes.** :meth:`LocalState.save` rewrites only what changed; its flags say what:

* ``feedback=True``: e, together with the staged contribution it belongs to (write-ahead: the peer
  puts the bytes only after this commit, so a restart re-uploads exactly those bytes with exactly
  that e). e changes only when a contribution is staged or given back, so this is the one
  full-size file written every window; the peer writes it from a background thread while it
  trains the next window (:mod:`client.lane`), streamed tensor by tensor.
* ``moments=True``: the optimizer's tensors. The peer asks for this every ``peer.moments_every``
  windows and when it stops, not every window: the moments are twice the size of e. Every other
  commit records the optimizer's scalars (the global inner step that indexes the learning-rate
  schedule, the parameter groups) and keeps the last moments file. **The rule:** a restart resumes
  e and the schedule exactly as of the last commit, and the moments (with their per-parameter
  step counts) as of the last commit that wrote them — at most ``peer.moments_every`` windows
  older. The moments describe the local loss surface and carry nothing the swarm sees (no
  contribution, no aggregate and no θ depends on them being the newest), so older ones cost a few
  steps of re-adaptation, never correctness; e, which the swarm does see through Δ̂, is never
  older than the last staged contribution. A commit whose optimizer has tensors the last moments
  file lacks (the first window) writes the moments whatever the flag.
* neither: θ moved (an aggregate was applied) or the staged contribution was dropped; only
  ``progress.json`` is replaced.

Tensor files are written piece by piece (:func:`protocol.files.atomic_stream`) and read back
tensor by tensor, so a commit never holds a serialised copy of e or of the moments in memory.

Saving is crash-safe: the data files are written under new names first, then ``progress.json`` is
replaced atomically (:func:`protocol.files.atomic_write`) and only then are the old files removed.
A crash at any point leaves a ``progress.json`` whose files all exist and whose sha256 match.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from protocol.errors import ConfigError
from protocol.files import atomic_stream, atomic_write

STATE_VERSION = 2
_DATA_FILES = ("feedback-*.safetensors", "moments-*.safetensors", "pending-*.bin")
_TENSOR_TAG = "__tensor__"
_READ_CHUNK = 16 << 20
# torch dtype -> safetensors dtype name (the ones optimizer states and e are made of)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Snapshot:
    """What the peer holds at a window boundary.

    ``window`` is the window θ opens, ``fingerprint`` the sha256 of θ_window (after aggregate
    window−1) and ``base`` the digest of that aggregate (or of the genesis object). ``feedback`` is
    e, ``optimizer`` the inner optimizer's state_dict. ``pending`` is the window of the last signed
    contribution staged for upload and not yet known to be aggregated (``window`` or, with
    ``outer.delay = 1``, ``window + 1``), whose bytes are in :attr:`pending_blob`; ``feedback`` is
    the e adopted with it (it already includes that window's step).
    """

    run_hash: str
    window: int
    base: str
    fingerprint: str
    feedback: Mapping[str, Tensor] = field(default_factory=dict)
    optimizer: Any = None
    pending: int | None = None
    pending_blob: bytes | None = None


class LocalState:
    """A peer's state directory (see the module docstring for its layout and commit rule)."""

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
        optimizer = None
        if meta.get("optimizer_tree") is not None:
            moments = self._read_tensors(files["moments"]) if files.get("moments") else {}
            optimizer = unflatten(moments, meta["optimizer_tree"])
        return Snapshot(
            run_hash=run_hash,
            window=int(meta["window"]),
            base=str(meta["base"]),
            fingerprint=str(meta["fingerprint"]),
            feedback=self._read_tensors(files["feedback"]) if files.get("feedback") else {},
            optimizer=optimizer,
            pending=meta.get("pending"),
            pending_blob=self._read(files["pending"]) if files.get("pending") else None,
        )

    def save(self, snap: Snapshot, *, feedback: bool = True, moments: bool = True) -> None:
        """Commit ``snap`` atomically; remove the files no commit refers to any more afterwards.

        ``feedback=False`` promises that e equals the last commit's: its file is kept.
        ``moments=False`` keeps the last moments file and records only the optimizer's scalars
        (module docstring: the rule a restart follows), or, when the optimizer's tensors no longer
        fit that file, keeps the last scalars with it; it never reads a moment tensor's values.
        ``snap.optimizer`` None keeps both the last scalars and the moments.
        """
        previous = self._committed_meta()
        kept: dict[str, Any] = previous.get("files", {})
        tag = f"{snap.window}-{time.time_ns()}"
        files: dict[str, dict[str, str] | None] = {
            "pending": self._pending_file(snap, previous, tag),
            "feedback": kept.get("feedback"),
            "moments": kept.get("moments"),
        }
        if (feedback or files["feedback"] is None) and snap.feedback:
            files["feedback"] = self._write_tensors(f"feedback-{tag}.safetensors", snap.feedback)
        tree, paths = previous.get("optimizer_tree"), previous.get("moment_paths")
        moments_window = previous.get("moments_window")
        if snap.optimizer is not None:
            tensors, skeleton = flatten(snap.optimizer)
            digest = _paths_digest(tensors)
            if moments:
                files["moments"] = self._write_tensors(f"moments-{tag}.safetensors", tensors) if tensors else None
                tree, paths, moments_window = skeleton, digest, snap.window
            elif digest == paths:  # the last moments file still fits: record the new scalars
                tree = skeleton
            # else the last scalars and moments stay together: a commit without ``moments`` never
            # writes tensors (they may be changing meanwhile, see client/peer/uploads.py)
        meta = {
            "version": STATE_VERSION,
            "run_hash": snap.run_hash,
            "window": snap.window,
            "base": snap.base,
            "fingerprint": snap.fingerprint,
            "pending": snap.pending,
            "files": files,
            "optimizer_tree": tree,
            "moment_paths": paths,
            "moments_window": moments_window,
            "saved_at": time.time(),
        }
        atomic_write(self.root / "progress.json", json.dumps(meta, indent=1).encode())
        new = {f["file"] for f in files.values() if f}
        # The previous commit's files, and any left by a save that crashed before its commit.
        leftovers = {p.name for pattern in _DATA_FILES for p in self.root.glob(pattern)}
        for name in leftovers - new:
            (self.root / name).unlink(missing_ok=True)

    def moments_window(self) -> int | None:
        """The window of the commit that last wrote the moments (None: never)."""
        window = self._committed_meta().get("moments_window")
        return int(window) if window is not None else None

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
        ok = isinstance(meta, dict) and meta.get("version") == STATE_VERSION and isinstance(meta.get("files"), dict)
        return meta if ok else {}

    def _pending_file(self, snap: Snapshot, previous: Mapping[str, Any], tag: str) -> dict[str, str] | None:
        """The staged bytes' file: the last commit's when it staged the same window (one signed
        contribution per window), else a new one."""
        if not snap.pending_blob:
            return None
        kept = previous.get("files", {}).get("pending")
        if kept and previous.get("pending") == snap.pending:
            return dict(kept)
        return self._write(f"pending-{tag}.bin", snap.pending_blob)

    def _write(self, name: str, data: bytes) -> dict[str, str]:
        atomic_write(self.root / name, data)
        return {"file": name, "sha256": hashlib.sha256(data).hexdigest()}

    def _write_tensors(self, name: str, tensors: Mapping[str, Tensor]) -> dict[str, str]:
        """``tensors`` as a safetensors file, written and hashed one tensor at a time (a CUDA
        tensor is copied to the host alone); no serialised copy of the whole set is ever held."""
        header: dict[str, Any] = {}
        offset = 0
        for key, t in tensors.items():
            if t.dtype not in _ST_DTYPES:
                raise ConfigError(f"cannot store a {t.dtype} tensor in the peer state ({key})")
            size = t.numel() * t.element_size()
            header[key] = {
                "dtype": _ST_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        digest = hashlib.sha256()
        with atomic_stream(self.root / name) as f:
            for piece in (struct.pack("<Q", len(text)), text):
                f.write(piece)
                digest.update(piece)
            for t in tensors.values():
                if t.numel():
                    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
                    f.write(raw)
                    digest.update(raw)
        return {"file": name, "sha256": digest.hexdigest()}

    def _verified_path(self, ref: Mapping[str, str]) -> Path:
        """The file ``ref`` names, after checking its sha256 (read in chunks)."""
        path = self.root / ref["file"]
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise ConfigError(f"state file {path} is missing: {exc.strerror or exc}") from exc
        if digest.hexdigest() != ref["sha256"]:
            raise ConfigError(f"state file {path} is damaged (sha256 mismatch)")
        return path

    def _read(self, ref: Mapping[str, str]) -> bytes:
        return self._verified_path(ref).read_bytes()

    def _read_tensors(self, ref: Mapping[str, str]) -> dict[str, Tensor]:
        path = self._verified_path(ref)
        try:
            with safe_open(str(path), framework="pt") as f:
                return {key: f.get_tensor(key) for key in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"state file {path} is not safetensors: {exc}") from exc


def _paths_digest(tensors: Mapping[str, Tensor]) -> str:
    """Names, shapes and dtypes of a moments file's tensors, hashed: a commit writes the moments
    whenever these change (a file that lacks a tensor the optimizer has cannot be kept)."""
    listing = sorted(f"{k}|{t.dtype}|{tuple(t.shape)}" for k, t in tensors.items())
    return hashlib.sha256("\n".join(listing).encode()).hexdigest()


# ---------------------------------------------------------------------- trees <-> safetensors
def flatten(tree: Any, prefix: str = "") -> tuple[dict[str, Tensor], Any]:
    """Split a nested dict/list of tensors and JSON scalars into (tensors by path, JSON skeleton).

    Used for optimizer state dicts: safetensors holds the tensors, the skeleton (with
    ``{"__tensor__": path}`` placeholders) goes to JSON. Dict keys become strings; int keys are
    kept as ``{"__int_keys__": ...}`` so the round trip is exact. The tensors are the tree's own
    (no copy, wherever they live).
    """
    tensors: dict[str, Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, Tensor):
            tensors[path] = node.detach()
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


def detached(tree: Any) -> Any:
    """A copy of a state_dict's structure (dicts, lists, scalars) holding the same tensors: what a
    commit on another thread reads while the live structure may still change."""
    tensors, skeleton = flatten(tree)
    return unflatten(tensors, skeleton)


def unflatten(tensors: Mapping[str, Tensor], skeleton: Any) -> Any:
    """Inverse of :func:`flatten`; ConfigError when the skeleton names a tensor ``tensors`` lacks."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _TENSOR_TAG in node:
                if node[_TENSOR_TAG] not in tensors:
                    raise ConfigError(f"the peer state's moments file lacks {node[_TENSOR_TAG]!r}")
                return tensors[node[_TENSOR_TAG]]
            if "__list__" in node:
                return [walk(v) for v in node["__list__"]]
            int_keys = set(node.get("__int_keys__", []))
            return {(int(k) if k in int_keys else k): walk(v) for k, v in node["__dict__"].items()}
        return node

    return walk(skeleton)


def tensors_equal(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    """Exact equality of two tensor dicts (same keys, shapes, dtypes and bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )
