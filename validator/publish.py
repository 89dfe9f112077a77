"""Publishing: the signed aggregate of a window, genesis and checkpoints.

Checkpoint convention: ``checkpoint/<w>/`` holds θ_w, the parameters that *open* window ``w``
(θ₀ at ``w = 0`` is genesis; otherwise θ after aggregate ``w − 1``). Its signed manifest names
``aggregate`` = digest of aggregate ``w − 1`` (GENESIS for ``w = 0``), the fingerprint of θ_w and
the files with their sha256. A late joiner loads the newest checkpoint ``w`` and applies aggregates
``w, w + 1, …``. The manifest's signed metadata holds ``published_at``: when window ``w`` opened
(for genesis, when window 0 opened; peers take the window-0 deadline from it). The weights file
``model.safetensors`` carries metadata ``window`` and ``fingerprint`` and is otherwise a pure
function of θ_w.

Every put is a conditional create; finding an identical object already there (a restarted
validator republishing) is success.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
from safetensors.torch import save as st_save

from protocol import layout
from protocol.chain import MAX_MANIFEST_BYTES, WEIGHTS_FILE, read_checkpoint, read_manifest
from protocol.errors import ObjectNotFound
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.store.base import ObjectStore, put_once
from protocol.wire import (
    Aggregate,
    AggregateTensor,
    CheckpointFile,
    CheckpointManifest,
    ManifestEntry,
    decode_checkpoint,
    encode_aggregate,
    encode_checkpoint,
)

__all__ = [
    "WEIGHTS_FILE",
    "encode_window_aggregate",
    "load_checkpoint",
    "publish_checkpoint",
    "weights_bytes",
]


def weights_bytes(params: Mapping[str, torch.Tensor], *, window: int) -> bytes:
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in sorted(params.items())}
    meta = {"window": str(window), "fingerprint": fingerprint(tensors)}
    return bytes(st_save(tensors, metadata=meta))


def publish_checkpoint(
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    *,
    aggregate: str,
    params: Mapping[str, torch.Tensor],
    identity: Identity,
    published_at: float,
) -> CheckpointManifest:
    """Write θ_window and its signed manifest (weights first: a manifest never names a missing file).
    If a manifest for this window is already there for the same θ, nothing is written."""
    fp = fingerprint(params)
    existing = _existing_manifest(store, run, run_hash, window, identity)
    if existing is not None and existing.fingerprint == fp:
        return existing
    blob = weights_bytes(params, window=window)
    key = layout.checkpoint_key(run, window, WEIGHTS_FILE)
    store.put(key, blob)  # not if_absent: a weights file without a manifest is from a crashed attempt
    files = (CheckpointFile(key, hashlib.sha256(blob).hexdigest(), len(blob)),)
    manifest = CheckpointManifest(run_hash, window, aggregate, fp, files, float(published_at))
    data = encode_checkpoint(manifest, identity)
    put_once(store, layout.checkpoint_manifest_key(run, window), data)
    return decode_checkpoint(
        data, run_hash=run_hash, max_bytes=MAX_MANIFEST_BYTES, allowed_signers=[identity.public_key], window=window
    ).value


def _existing_manifest(
    store: ObjectStore, run: str, run_hash: str, window: int, identity: Identity
) -> CheckpointManifest | None:
    try:
        return read_manifest(store, run, run_hash, window, allowed_signers=[identity.public_key])
    except ObjectNotFound:
        return None


def load_checkpoint(
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    *,
    allowed_signers: Sequence[bytes | str],
) -> tuple[CheckpointManifest, dict[str, torch.Tensor], float]:
    """(manifest, θ_window, published_at), every file checked against the signed manifest
    (``protocol.chain``); ``published_at`` is when window ``window`` opened."""
    manifest, params = read_checkpoint(store, run, run_hash, window, allowed_signers=allowed_signers)
    return manifest, params, manifest.published_at


def encode_window_aggregate(
    *,
    run_hash: str,
    window: int,
    base: str,
    alpha: float,
    tensors: Mapping[str, AggregateTensor],
    manifest: Sequence[tuple[str, str, float]],
    fingerprint_next: str,
    published_at: float,
    metadata: Mapping[str, int | float | str | bool],
    identity: Identity,
) -> bytes:
    """The signed aggregate of ``window``: Δ̄ in its published form (``protocol.broadcast.publishable``:
    what θ_{window+1} was computed with), manifest [(peer, digest, weight)], fingerprint of
    θ_{window+1}, ``published_at`` (now: window + 1 opens with it), metadata (``val_loss`` …)."""
    agg = Aggregate(
        run_hash,
        window,
        base,
        alpha,
        fingerprint_next,
        tuple(ManifestEntry(p, d, w) for p, d, w in sorted(manifest)),
        dict(tensors),
        float(published_at),
        dict(metadata),
    )
    return encode_aggregate(agg, identity)
