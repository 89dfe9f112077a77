"""Reading the validator's signed chain back from a store: aggregates and checkpoints.

Peers (catch-up, resync) and the validator (restart, genesis check) read the same objects with the
same checks, so the reading lives here once:

    agg = read_aggregate(store, run, run_hash, w, allowed_signers=keys, max_bytes=cap, schema=schema)
    agg.digest, delta_of(agg.value)              # the next window's base; Δ̄ for apply_outer
    manifest, theta = read_checkpoint(store, run, run_hash, w, allowed_signers=keys)

A checkpoint's weights are only trusted through its signed manifest: every file must have the size
and sha256 the manifest lists, and the loaded θ must have the manifest's fingerprint. The signed size
is also the read cap (a 1B-parameter θ is 4 GiB, far above any aggregate cap).

An aggregate comes back with its proof (:class:`~protocol.wire.Verified`): its digest is the base of
the next window. A checkpoint manifest comes back as its value: nothing names a manifest by its
digest, and its signer was checked against ``allowed_signers`` before it was parsed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from protocol import layout
from protocol.aggregate import SparseDict
from protocol.broadcast import applied
from protocol.errors import DigestMismatch, MalformedPayload, ObjectNotFound, SchemaMismatch
from protocol.model import fingerprint
from protocol.store.base import ObjectStore
from protocol.wire import Aggregate, CheckpointManifest, Verified, decode_aggregate, decode_checkpoint

__all__ = [
    "MAX_MANIFEST_BYTES",
    "WEIGHTS_FILE",
    "delta_of",
    "read_aggregate",
    "read_checkpoint",
    "read_manifest",
    "read_weights",
]

WEIGHTS_FILE = "model.safetensors"
MAX_MANIFEST_BYTES = 1 << 20

Signers = Collection[bytes | str]
Schema = Mapping[str, tuple[int, ...]]


def read_aggregate(
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    *,
    allowed_signers: Signers,
    max_bytes: int,
    schema: Schema | None = None,
) -> Verified[Aggregate] | None:
    """The published aggregate of ``window``, or None when there is none yet. With ``schema``,
    unknown tensors and wrong shapes are refused before the payload is read; a subset of θ is fine
    (parameters nobody sent, pipeline stages, empty windows)."""
    try:
        data = store.get(layout.aggregate_key(run, window), max_bytes=max_bytes)
    except ObjectNotFound:
        return None
    return decode_aggregate(
        data,
        run_hash=run_hash,
        max_bytes=max_bytes,
        allowed_signers=allowed_signers,
        window=window,
        schema=schema,
        partial=True,
    )


def delta_of(agg: Aggregate) -> SparseDict:
    """An aggregate's Δ̄ in :mod:`protocol.aggregate`'s form (what ``apply_outer`` takes), plain or
    re-compressed (:func:`protocol.broadcast.applied`)."""
    return applied(agg.tensors)


def read_manifest(
    store: ObjectStore, run: str, run_hash: str, window: int, *, allowed_signers: Signers
) -> CheckpointManifest:
    """The signed checkpoint manifest of ``window``; ``ObjectNotFound`` when there is none."""
    data = store.get(layout.checkpoint_manifest_key(run, window), max_bytes=MAX_MANIFEST_BYTES)
    return decode_checkpoint(
        data, run_hash=run_hash, max_bytes=MAX_MANIFEST_BYTES, allowed_signers=allowed_signers, window=window
    ).value


def read_weights(
    store: ObjectStore, manifest: CheckpointManifest, *, schema: Schema | None = None
) -> dict[str, torch.Tensor]:
    """θ from the files a verified manifest lists (float32, CPU), each checked against its entry."""
    if not manifest.files:
        raise MalformedPayload(f"checkpoint {manifest.window} lists no files")
    params: dict[str, torch.Tensor] = {}
    for f in manifest.files:
        data = store.get(f.key, max_bytes=max(f.size, 1))
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise DigestMismatch(f"checkpoint file {f.key} does not match its manifest entry")
        try:
            params.update(st_load(data))
        except (SafetensorError, ValueError) as exc:
            raise MalformedPayload(f"checkpoint file {f.key} is not safetensors: {exc}") from exc
    if schema is not None and {n: tuple(t.shape) for n, t in params.items()} != dict(schema):
        raise SchemaMismatch(f"checkpoint {manifest.window} does not hold exactly the run's parameters")
    params = {n: t.to(torch.float32).contiguous() for n, t in params.items()}
    got = fingerprint(params)
    if got != manifest.fingerprint:
        raise DigestMismatch(
            f"checkpoint {manifest.window} weights hash to {got[:16]}, manifest says {manifest.fingerprint[:16]}"
        )
    return params


def read_checkpoint(
    store: ObjectStore, run: str, run_hash: str, window: int, *, allowed_signers: Signers, schema: Schema | None = None
) -> tuple[CheckpointManifest, dict[str, torch.Tensor]]:
    """(manifest, θ_window) of the signed checkpoint of ``window``, every file verified."""
    manifest = read_manifest(store, run, run_hash, window, allowed_signers=allowed_signers)
    return manifest, read_weights(store, manifest, schema=schema)
