"""Validate signed object files and describe them in one line each (``sparseloco inspect``).

    for r in inspect_paths(["swarm/ab12/aggregate"]):
        print(r.line)          # OK aggregate window=3 sender=… bytes=… or INVALID <path> <reason>: …

Checks signature and structure of every object (including every tensor payload); the run hash and
the aggregate signer are checked only when given, since an operator may inspect any run's files.

The files come from anywhere, so what they make it print is treated as hostile too: every line is
one line of printable text (control characters, escape sequences and bidirectional overrides in
names, metadata, messages or paths are shown escaped, ``\x1b`` …), so an object can never make its
line, or another, read as something else — an INVALID object never shows as ``OK``. Objects larger
than ``max_bytes`` (default :data:`DEFAULT_MAX_BYTES`, ``--max-bytes``) are refused from their size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from protocol.errors import PayloadTooLarge, ProtocolError
from protocol.wire import (
    Aggregate,
    Announcement,
    CheckpointFile,
    CheckpointManifest,
    Contribution,
    DatasetManifest,
    SignedObject,
    Verified,
    dataset_digest,
    decode_object,
)

#: Far above any object a run accepts (contributions and aggregates are capped at tens of MiB).
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class InspectResult:
    path: str
    ok: bool
    line: str
    reason: str = ""
    obj: Verified[SignedObject] | None = None


def describe(verified: Verified[SignedObject]) -> str:
    """The fields after ``OK <kind>`` for a decoded object."""
    obj = verified.value
    if isinstance(obj, DatasetManifest):  # a whole run's: window 0, the body's digest names it
        tokens = {split: sum(s.tokens for s in obj.split(split)) for split in ("train", "val")}
        return (
            f"window=0 sender={verified.sender} bytes={verified.size} tokenizer={obj.tokenizer} "
            f"shards={len(obj.shards)} train_tokens={tokens['train']} val_tokens={tokens['val']} "
            f"dataset={_short(dataset_digest(obj))} digest={_short(verified.digest)}"
        )
    head = f"window={obj.window} sender={verified.sender} bytes={verified.size}"
    if isinstance(obj, Contribution):
        tail = f"base={_short(obj.base)} tensors={len(obj.tensors)} nnz={obj.nnz}"
    elif isinstance(obj, Aggregate):
        tail = (
            f"base={_short(obj.base)} tensors={len(obj.tensors)} nnz={obj.nnz} manifest={len(obj.manifest)}"
            f" alpha={obj.alpha:g} fingerprint={_short(obj.fingerprint)}"
        )
    elif isinstance(obj, CheckpointManifest):
        size = sum(f.size for f in obj.files)
        tail = f"aggregate={_short(obj.aggregate)} files={len(obj.files)} files_bytes={size}"
    else:
        assert isinstance(obj, Announcement)
        role = f" role={obj.role.group}:{obj.role.stage}/{obj.role.stages}" if obj.role else ""
        tail = f"version={json.dumps(obj.client_version)} hardware={json.dumps(obj.hardware)}{role}"
    return f"{head} {tail} digest={_short(verified.digest)}"


def _short(hexstr: str) -> str:
    return hexstr[:16]


def inspect_bytes(
    data: bytes,
    path: str = "-",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
) -> InspectResult:
    try:
        obj = decode_object(data, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed_signers)
    except ProtocolError as exc:
        return _invalid(path, exc.reason, exc.args[0] if exc.args else "")
    except Exception as exc:
        return _invalid(path, "internal_error", f"{type(exc).__name__}: {exc}")
    kind = type(obj.value).__name__.lower().replace("checkpointmanifest", "checkpoint").replace("manifest", "")
    return InspectResult(path, True, printable(f"OK {kind} {describe(obj)} path={path}"), obj=obj)


def inspect_file(
    path: str | Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
) -> InspectResult:
    """Inspect one file; oversized files are rejected from their size, without reading them."""
    p = str(path)
    try:
        size = os.stat(p).st_size
        if size > max_bytes:
            raise PayloadTooLarge(f"file is {size} bytes, limit {max_bytes}")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except ProtocolError as exc:
        return _invalid(p, exc.reason, exc.args[0])
    except OSError as exc:
        return _invalid(p, "unreadable", exc.strerror or str(exc))
    return inspect_bytes(data, p, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed_signers)


def inspect_paths(
    paths: Iterable[str | Path],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
) -> Iterator[InspectResult]:
    """Inspect files; a directory stands for every file below it, in sorted order.

    Checkpoint weights are safetensors, not signed envelopes: a file that a valid checkpoint manifest
    among the inspected files lists (same folder) is checked against the manifest's size and sha256.
    """
    check = partial(inspect_file, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed_signers)
    results = [check(f) if isinstance(f, Path) else f for f in _expand(paths)]
    listed = _listed_by_manifests(results)
    for r in results:
        yield _verify_listed(r.path, *listed[r.path]) if not r.ok and r.path in listed else r


def _expand(paths: Iterable[str | Path]) -> Iterator[Path | InspectResult]:
    for path in paths:
        p = Path(path)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            yield from files
            if not files:
                yield _invalid(str(p), "unreadable", "directory holds no files")
        else:
            yield p


def _listed_by_manifests(results: Iterable[InspectResult]) -> dict[str, tuple[int, CheckpointFile]]:
    """path -> (window, entry) for every file named by a valid manifest, resolved beside it."""
    listed: dict[str, tuple[int, CheckpointFile]] = {}
    for r in results:
        manifest = r.obj.value if r.obj is not None else None
        if isinstance(manifest, CheckpointManifest):
            for entry in manifest.files:
                listed[str(Path(r.path).parent / entry.key.rsplit("/", 1)[-1])] = (manifest.window, entry)
    return listed


def _verify_listed(path: str, window: int, entry: CheckpointFile) -> InspectResult:
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        return _invalid(path, "unreadable", exc.strerror or str(exc))
    if size != entry.size or digest.hexdigest() != entry.sha256:
        return _invalid(path, "digest_mismatch", f"does not match its checkpoint manifest ({entry.key})")
    line = f"OK checkpoint-file window={window} bytes={size} sha256={_short(entry.sha256)} path={path}"
    return InspectResult(path, True, printable(line))


def _invalid(path: str, reason: str, message: str) -> InspectResult:
    return InspectResult(path, False, printable(f"INVALID {path} {reason}: {message}"), reason=reason)


def printable(text: str) -> str:
    """``text`` with every character that is not printable (controls, escape sequences, line and
    paragraph separators, bidirectional overrides, unassigned code points) written as a Python
    escape, so that it shows as exactly one line of what it really holds."""
    return "".join(ch if ch.isprintable() and ord(ch) not in _BIDI else _escape(ch) for ch in text)


# Bidirectional controls are "printable" for Python but reorder what a terminal shows.
_BIDI = frozenset([0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
