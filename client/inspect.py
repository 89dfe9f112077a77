"""Validate signed object files and describe them in one line each (``sparseloco inspect``).

    for r in inspect_paths(["swarm/ab12/aggregate"]):
        print(r.line)          # OK aggregate window=3 sender=… bytes=… or INVALID <path> <reason>: …

Checks signature and structure of every object (including every tensor payload); the run hash and
the aggregate signer are checked only when given, since an operator may inspect any run's files.

Objects are read from files or straight from a store (:func:`inspect_store`): a store URL names a
key, a prefix, a run or a whole store, and :func:`split_store_url` finds where the store ends and
the run's layout (:mod:`protocol.layout`) begins::

    split_store_url("s3://bucket/runs/ab12cd34ef56ab78/aggregate/00000003")
    # ("s3://bucket/runs", "ab12cd34ef56ab78/aggregate/00000003")
    with open_store(root) as store:
        for r in inspect_store(store, prefix, label=root): ...

Data shards and tokenizers (named by their sha256) and checkpoint weight files (listed by a valid
manifest among the inspected objects) are checked against their names and manifests, a window's
outcomes (:mod:`protocol.outcomes`) against the digest its aggregate signed.

The files come from anywhere, so what they make it print is treated as hostile too: every line is
one line of printable text (control characters, escape sequences and bidirectional overrides in
names, metadata, messages or paths are shown escaped, ``\x1b`` …), so an object can never make its
line, or another, read as something else — an INVALID object never shows as ``OK``. Objects larger
than ``max_bytes`` (default :data:`DEFAULT_MAX_BYTES`, ``--max-bytes``) are refused from their size,
and objects whose tensor tables declare more decoded memory than ``max_memory`` (default
:data:`DEFAULT_MAX_MEMORY`, ``--max-memory``; :func:`protocol.wire.footprint.declared_bytes`) from
their header, before the rest of a file is read: decoding allocates in proportion to what the
tables declare (at most 96 × the object's size + 1 MiB, the bound the fuzz tests assert), so
without it one crafted file of the 1 GiB ``--max-bytes`` could cost ~100 GiB.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from protocol import layout
from protocol.errors import PayloadTooLarge, ProtocolError, StoreError
from protocol.outcomes import OUTCOMES, decode_outcomes
from protocol.store.base import ObjectStore
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
from protocol.wire.footprint import body_end, declared_bytes
from protocol.wire.frame import FIXED_HEADER_BYTES

#: Far above any object a run accepts (contributions and aggregates are capped at tens of MiB).
DEFAULT_MAX_BYTES = 256 << 20
#: Decoded tensors one object may declare (a 1 B-parameter model's full contribution declares ~0.2 GiB).
DEFAULT_MAX_MEMORY = 4 << 30


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
            f"shards={len(obj.shards)} block_tokens={obj.block_tokens} train_tokens={tokens['train']} val_tokens={tokens['val']} "
            f"dataset={_short(dataset_digest(obj))} digest={_short(verified.digest)}"
        )
    head = f"window={obj.window} sender={verified.sender} bytes={verified.size}"
    if isinstance(obj, Contribution):
        tail = f"base={_short(obj.base)} tensors={len(obj.tensors)} nnz={obj.nnz}"
    elif isinstance(obj, Aggregate):
        tail = (
            f"base={_short(obj.base)} tensors={len(obj.tensors)} nnz={obj.nnz} manifest={len(obj.manifest)}"
            f" alpha={obj.alpha:g} encoding={'plain' if obj.codec is None else f'recompressed:k={obj.codec.k}'}"
            f" fingerprint={_short(obj.fingerprint)}"
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
    max_memory: int = DEFAULT_MAX_MEMORY,
) -> InspectResult:
    try:
        _check_declared(declared_bytes(data), max_memory)
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
    max_memory: int = DEFAULT_MAX_MEMORY,
) -> InspectResult:
    """Inspect one file; oversized files are rejected from their size, files whose header declares
    more than ``max_memory`` of decoded tensors from their header, without reading the rest."""
    p = str(path)
    try:
        size = os.stat(p).st_size
        if size > max_bytes:
            raise PayloadTooLarge(f"file is {size} bytes, limit {max_bytes}")
        with open(p, "rb") as f:
            data = f.read(FIXED_HEADER_BYTES)
            data += f.read(max(0, min(body_end(data), size) - len(data)))
            _check_declared(declared_bytes(data), max_memory)
            data += f.read(max_bytes + 1 - len(data))
    except ProtocolError as exc:
        return _invalid(p, exc.reason, exc.args[0])
    except OSError as exc:
        return _invalid(p, "unreadable", exc.strerror or str(exc))
    return inspect_bytes(
        data, p, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed_signers, max_memory=max_memory
    )


def _check_declared(need: int, max_memory: int) -> None:
    if need > max_memory:
        raise PayloadTooLarge(
            f"its tensor tables declare {need} bytes of decoded tensors, limit {max_memory} (--max-memory)"
        )


def inspect_paths(
    paths: Iterable[str | Path],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
) -> Iterator[InspectResult]:
    """Inspect files; a directory stands for every file below it, in sorted order.

    Checkpoint weights are safetensors, not signed envelopes: a file that a valid checkpoint manifest
    among the inspected files lists (same folder) is checked against the manifest's size and sha256.
    """
    check = partial(
        inspect_file, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed_signers, max_memory=max_memory
    )
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


def split_store_url(url: str, run: str | None = None) -> tuple[str, str]:
    """(store URL, key or prefix) of a URL that may point into a run's layout.

    The key starts at the segment that is followed by a layout kind (``<run>/aggregate/…``), or at
    ``run`` (the run id ``--run`` gives) when a segment equals it; otherwise the URL is the store
    and the prefix is ``run/`` (or everything without ``run``). Query parameters stay with the store.
    """
    base, sep, query = url.partition("?")
    scheme, _, rest = base.partition("://")
    parts = [p for p in rest.split("/")]
    start = None
    for i in range(len(parts) - 1):
        if parts[i + 1] in layout.KINDS and parts[i]:
            start = i
            break
    if start is None and run is not None and run in parts:
        start = parts.index(run)
    if start is None:
        return url, f"{run}/" if run else ""
    key = "/".join(parts[start:])
    root = "/".join(parts[:start]).rstrip("/")
    if scheme.lower() == "file" and not root:
        root = "/"
    return f"{scheme}://{root}{sep}{query}", key


def inspect_store(
    store: ObjectStore,
    prefix: str,
    *,
    label: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
) -> Iterator[InspectResult]:
    """Inspect every object under ``prefix`` in ``store`` (an exact key is its own prefix), in
    key order; each result's path is ``label/<key>``. Nothing found is one INVALID result."""
    try:
        keys = sorted(store.list(prefix))
    except (ProtocolError, StoreError) as exc:
        yield _invalid(f"{label}/{prefix}", exc.reason, str(exc))
        return
    if not keys:
        yield _invalid(f"{label}/{prefix}", "not_found", "no object at this key or under this prefix")
        return
    check = partial(
        inspect_bytes, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed_signers, max_memory=max_memory
    )
    results: dict[str, InspectResult] = {}
    for key in keys:
        path = label + key if label.endswith("://") else f"{label.rstrip('/')}/{key}"
        if _is_probe(key):  # any bytes by design: its size is all there is to say (and not read)
            results[key] = _probe(store, key, path)
            continue
        try:
            data = store.get(key, max_bytes=max_bytes)
        except (ProtocolError, StoreError) as exc:
            results[key] = _invalid(path, exc.reason, str(exc))
            continue
        named = _named_by_digest(key)
        if named is not None:
            results[key] = _check_named(path, data, named)
        elif _is_outcomes(key):
            results[key] = _check_outcomes(store, key, path, data, check)
        else:
            results[key] = check(data, path)
    listed = {
        entry.key: (r.obj.value.window, entry)
        for r in results.values()
        if r.obj is not None and isinstance(r.obj.value, CheckpointManifest)
        for entry in r.obj.value.files
    }
    for key, r in results.items():
        if not r.ok and key in listed:
            window, entry = listed[key]
            data = store.get(key, max_bytes=entry.size + 1)
            r = _check_listed(r.path, data, window, entry)
        yield r


def _is_probe(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[1] == "probe"


def _probe(store: ObjectStore, key: str, path: str) -> InspectResult:
    """A peer's preflight write probe (``<run>/probe/<peer_id>``): random bytes, nothing to verify."""
    try:
        size = store.size(key)
    except (ProtocolError, StoreError) as exc:
        return _invalid(path, exc.reason, str(exc))
    return InspectResult(path, True, f"OK probe bytes={size} (a peer's preflight write probe: any bytes)")


def _is_outcomes(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[1] == "outcomes"


def _check_outcomes(
    store: ObjectStore, key: str, path: str, data: bytes, check: Callable[[bytes, str], InspectResult]
) -> InspectResult:
    """Outcomes carry no signature: they are checked against the digest their aggregate signed."""
    run, _, window_text = key.split("/")
    try:
        window = layout.parse_window(window_text)
        agg_key = layout.aggregate_key(run, window)
        agg = check(store.get(agg_key, max_bytes=DEFAULT_MAX_BYTES), agg_key)
        if agg.obj is None or not isinstance(agg.obj.value, Aggregate):
            return _invalid(path, agg.reason or "malformed", f"its aggregate does not verify: {agg.line}")
        digest = agg.obj.value.metadata.get(OUTCOMES)
        if not isinstance(digest, str):
            return _invalid(path, "malformed", "its aggregate names no outcomes")
        table = decode_outcomes(data, digest=digest, run_hash=agg.obj.value.run_hash, window=window)
    except (ProtocolError, StoreError) as exc:
        return _invalid(path, exc.reason, str(exc))
    accepted = sum(r.accepted for r in table.rows.values())
    line = (
        f"OK outcomes window={window} peers={len(table.rows)} accepted={accepted} digest={_short(digest)} path={path}"
    )
    return InspectResult(path, True, printable(line))


def _named_by_digest(key: str) -> str | None:
    """The sha256 a data shard's or tokenizer's key names (None for other keys)."""
    parts = key.split("/")
    if len(parts) == 4 and parts[1] == "data" and parts[2] in ("shard", "tokenizer"):
        return parts[3]
    return None


def _check_named(path: str, data: bytes, sha256: str) -> InspectResult:
    if hashlib.sha256(data).hexdigest() != sha256:
        return _invalid(path, "digest_mismatch", "the bytes do not hash to the sha256 their key names")
    return InspectResult(path, True, printable(f"OK data-file bytes={len(data)} sha256={_short(sha256)} path={path}"))


def _check_listed(path: str, data: bytes, window: int, entry: CheckpointFile) -> InspectResult:
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        return _invalid(path, "digest_mismatch", f"does not match its checkpoint manifest ({entry.key})")
    line = f"OK checkpoint-file window={window} bytes={len(data)} sha256={_short(entry.sha256)} path={path}"
    return InspectResult(path, True, printable(line))


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
