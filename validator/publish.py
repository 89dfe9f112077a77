"""Publishing: the signed aggregate of a window, genesis and checkpoints.

Checkpoint convention: ``checkpoint/<w>/`` holds θ_w, the parameters that *open* window ``w``
(θ₀ at ``w = 0`` is genesis; otherwise θ after aggregate ``w − 1``). Its signed manifest names
``aggregate`` = digest of aggregate ``w − 1`` (GENESIS for ``w = 0``), the ``launch`` (digest of the
genesis manifest; GENESIS in the genesis manifest itself), the fingerprint of θ_w and the files
with their sha256. A late joiner loads the newest checkpoint ``w`` and applies aggregates
``w, w + 1, …``. The manifest's signed metadata holds ``published_at``: when window ``w`` opened
(for genesis, when window 0 opened; peers take the window-0 deadline from it). The weights file
``model.safetensors`` carries metadata ``window`` and ``fingerprint`` and is otherwise a pure
function of θ_w.

Every put of a signed object is a conditional create (:func:`put_chain`): finding an identical
object already there (a restarted validator republishing) is success, another object of this chain
is a conflict (``ObjectExists``), and anything else at the key — junk, a forgery, an object of
another launch — counts as absent and is replaced, so that nobody can block the chain by writing
first.

With several validators (:mod:`protocol.quorum`) every one of them reaches each checkpoint window;
the first valid manifest of the launch for the certified θ, by any of the run's keys, is the
checkpoint and the others return it (:func:`publish_checkpoint`). Readers trust it only through
the certificate of the aggregate before it (:func:`protocol.chain.read_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from safetensors.torch import save as st_save

from protocol import layout
from protocol.chain import MAX_MANIFEST_BYTES, WEIGHTS_FILE, read_checkpoint
from protocol.errors import ObjectExists, ObjectNotFound, PayloadTooLarge, ProtocolError
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.store.base import ObjectStore
from protocol.wire import (
    GENESIS,
    Aggregate,
    AggregateTensor,
    CheckpointFile,
    CheckpointManifest,
    ManifestEntry,
    Verified,
    decode_aggregate,
    decode_checkpoint,
    encode_aggregate,
    encode_checkpoint,
)

__all__ = [
    "WEIGHTS_FILE",
    "encode_window_aggregate",
    "load_checkpoint",
    "publish_aggregate",
    "publish_checkpoint",
    "publish_outcomes",
    "put_chain",
    "weights_bytes",
]

log = logging.getLogger(__name__)
Signers = Collection[bytes | str]


def weights_bytes(params: Mapping[str, torch.Tensor], *, window: int) -> bytes:
    """θ as safetensors, the same bytes for the same θ and window (a checkpoint can be written
    again byte for byte, as a launch's genesis must be)."""
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in sorted(params.items())}
    meta = {"window": str(window), "fingerprint": fingerprint(tensors)}
    return _sorted_header(bytes(st_save(tensors, metadata=meta)))


def _sorted_header(blob: bytes) -> bytes:
    """``blob`` with its safetensors header written with sorted keys: safetensors writes the
    metadata map in hash order, which differs between calls. Offsets are relative to the data,
    so only the header (padded to 8 bytes, as safetensors does) changes."""
    n = int.from_bytes(blob[:8], "little")
    text = json.dumps(json.loads(blob[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + n :]


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
    launch: str = GENESIS,
    signers: Signers = (),
) -> Verified[CheckpointManifest]:
    """Write θ_window and its signed manifest (weights first: a manifest never names a missing file).
    ``launch``: the digest of this chain's genesis manifest (GENESIS when writing the genesis
    itself). ``signers``: the run's validator keys (default: ``identity``'s alone).

    If a manifest of this launch for the same θ is already there, nothing is written and it is
    returned. With several validators (more than one of ``signers``) that manifest may be signed
    by any of them and must also follow the same aggregate and name the same weights file (θ's
    bytes are a pure function of θ): the first one written stands — the genesis above all, whose
    digest is the launch — and a validator that finds it, or loses the race to create it, returns
    it (putting the weights file back if it was damaged since). A valid manifest of another θ is
    not this chain's checkpoint and is replaced."""
    fp = fingerprint(params)
    signers = list(signers) or [identity.public_key]
    several = len(signers) > 1
    key = layout.checkpoint_key(run, window, WEIGHTS_FILE)
    blob = weights_bytes(params, window=window) if several else b""
    files = (CheckpointFile(key, hashlib.sha256(blob).hexdigest(), len(blob)),)

    def stands(got: Verified[CheckpointManifest] | None) -> bool:
        m = None if got is None else got.value
        if m is None or m.fingerprint != fp or m.launch != launch:
            return False
        return not several or (m.aggregate == aggregate and tuple(m.files) == files)

    existing = _existing_manifest(store, run, run_hash, window, signers)
    if existing is not None and stands(existing):
        if several:
            _weights_in_place(store, key, blob)
        return existing
    if not several:
        blob = weights_bytes(params, window=window)
        files = (CheckpointFile(key, hashlib.sha256(blob).hexdigest(), len(blob)),)
    store.put(key, blob)  # not if_absent: a weights file without a manifest is from a crashed attempt
    manifest = CheckpointManifest(run_hash, window, aggregate, fp, files, float(published_at), launch=launch)
    data = encode_checkpoint(manifest, identity)

    def of_this_launch(found: bytes) -> bool:
        got = _decoded_manifest(found, run_hash, window, signers)
        if got is None or (window != 0 and got.value.launch != launch):
            return False
        return not several or stands(got)  # several: a manifest of another θ is not this chain's

    try:
        put_chain(
            store,
            layout.checkpoint_manifest_key(run, window),
            data,
            belongs=of_this_launch,
            max_bytes=MAX_MANIFEST_BYTES,
        )
    except ObjectExists:
        existing = _existing_manifest(store, run, run_hash, window, signers)
        if not several or existing is None or not stands(existing):
            raise
        log.info("checkpoint %d is already published by validator %s", window, existing.public_key.hex()[:16])
        return existing
    return decode_checkpoint(
        data, run_hash=run_hash, max_bytes=MAX_MANIFEST_BYTES, allowed_signers=signers, window=window
    )


def _weights_in_place(store: ObjectStore, key: str, blob: bytes) -> None:
    """Put ``blob`` back at ``key`` unless it is there already (a manifest that stands names it)."""
    try:
        there: bytes | None = store.get(key, max_bytes=len(blob))
    except (ObjectNotFound, PayloadTooLarge):
        there = None
    if there != blob:
        log.warning("the weights file %s differs from what its checkpoint manifest names; put back", key)
        store.put(key, blob)


def publish_aggregate(
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    blob: bytes,
    *,
    base: str,
    allowed_signers: Signers,
    max_bytes: int,
) -> bool:
    """Put the signed aggregate ``blob`` of ``window`` (built on ``base``) with :func:`put_chain`:
    another valid aggregate of this window on the same base is a conflict, anything else is
    replaced. Whether this call wrote it."""

    def same_chain(found: bytes) -> bool:
        try:
            agg = decode_aggregate(
                found, run_hash=run_hash, max_bytes=max_bytes, allowed_signers=allowed_signers, window=window
            )
        except ProtocolError:
            return False
        return agg.value.base == base

    return put_chain(store, layout.aggregate_key(run, window), blob, belongs=same_chain, max_bytes=max_bytes)


def publish_outcomes(store: ObjectStore, run: str, window: int, blob: bytes) -> None:
    """Put the per-peer outcomes of ``window`` (:mod:`protocol.outcomes`) before its aggregate. A
    plain put: until the aggregate naming their digest is out they vouch for nothing, and a window
    decided again after a crash replaces them."""
    store.put(layout.outcomes_key(run, window), blob)


def put_chain(store: ObjectStore, key: str, data: bytes, *, belongs: Callable[[bytes], bool], max_bytes: int) -> bool:
    """Create ``key`` holding ``data``; True when this call wrote it.

    The same bytes already there are success (False). An object there for which ``belongs`` is
    true — a valid object of this chain, say another validator process's — raises ``ObjectExists``.
    Anything else (unreadable, larger than ``max_bytes``, not of this chain) counts as absent and is
    overwritten: the validator owns the chain keys, so what others left there cannot block them.
    """
    try:
        store.put(key, data, if_absent=True)
        return True
    except ObjectExists:
        pass
    try:
        existing: bytes | None = store.get(key, max_bytes=max(max_bytes, len(data)))
    except (ObjectNotFound, PayloadTooLarge):
        existing = None  # gone meanwhile, or larger than any object of ours: not ours
    if existing == data:
        return False
    if existing is not None and belongs(existing):
        raise ObjectExists(f"{key!r} already holds another object of this chain")
    log.warning("replacing the object at %s, which is not part of this chain", key)
    store.put(key, data)
    return True


def _existing_manifest(
    store: ObjectStore, run: str, run_hash: str, window: int, signers: Signers
) -> Verified[CheckpointManifest] | None:
    """The valid manifest of ``window`` signed by one of ``signers`` already in the store, if any."""
    try:
        data = store.get(layout.checkpoint_manifest_key(run, window), max_bytes=MAX_MANIFEST_BYTES)
    except (ObjectNotFound, PayloadTooLarge):
        return None
    return _decoded_manifest(data, run_hash, window, signers)


def _decoded_manifest(data: bytes, run_hash: str, window: int, signers: Signers) -> Verified[CheckpointManifest] | None:
    try:
        return decode_checkpoint(
            data, run_hash=run_hash, max_bytes=MAX_MANIFEST_BYTES, allowed_signers=signers, window=window
        )
    except ProtocolError:
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
