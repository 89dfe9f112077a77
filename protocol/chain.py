"""Reading the validator's signed chain back from a store: launch, aggregates and checkpoints.

Peers (catch-up, resync) and the validator (restart, genesis check) read the same objects with the
same checks, so the reading lives here once:

    launch = read_launch(store, run, run_hash, allowed_signers=keys)   # the signed genesis manifest
    base = launch.digest                                               # the base of window 0
    agg = next_aggregate(store, run, run_hash, w, base, allowed_signers=keys, max_bytes=cap, schema=schema)
    agg.digest, delta_of(agg.value)              # the next window's base; Δ̄ for apply_outer
    manifest, theta = read_checkpoint(store, run, run_hash, w, allowed_signers=keys)
    checkpoint_base(manifest, launch.digest)     # the base of window w, if w is of this launch

**The chain and its root.** Every launch of a run starts with a new genesis checkpoint manifest
(checkpoint 0; it carries the launch time ``published_at``). Its digest is the base of window 0,
aggregate ``t``'s digest the base of window ``t + 1``, and every later checkpoint manifest names
the launch it belongs to. So a chain is verified from its root, and objects of another launch of
the same RunSpec (leftovers in a store, or replayed) never continue it.

**What does not verify is absent.** Anything can lie at a chain key: a forgery, junk, an object of
another launch. :func:`next_aggregate` treats an object that does not verify, or does not chain
onto the base the reader holds, as *not published* (and logs it): never as published, never as a
reason to stop. :func:`read_aggregate` is the strict read underneath, raising ``ProtocolError``.

A checkpoint's weights are only trusted through its signed manifest: every file must have the size
and sha256 the manifest lists, and the loaded θ must have the manifest's fingerprint. The signed size
is also the read cap (a 1B-parameter θ is 4 GiB, far above any aggregate cap). Large objects — a
checkpoint's files, an aggregate past one range — are read in parallel byte ranges, each retried
alone and hashed as it lands (:mod:`protocol.store.fetch`); a reader that shows progress passes
``watch``, which gives a progress callback for a label (``"checkpoint 120"``, ``"aggregate 57"``).

Aggregates and manifests come back with their proof (:class:`~protocol.wire.Verified`): an
aggregate's digest is the base of the next window, the genesis manifest's digest the launch.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from protocol import layout
from protocol.aggregate import SparseDict
from protocol.broadcast import applied
from protocol.errors import (
    DigestMismatch,
    MalformedPayload,
    ObjectNotFound,
    ProtocolError,
    SchemaMismatch,
    StaleBase,
    Uncertified,
)
from protocol.model import fingerprint
from protocol.store.base import ObjectStore
from protocol.store.fetch import Progress, Watch, fetch, fetch_capped
from protocol.wire import GENESIS, Aggregate, CheckpointManifest, Verified, decode_aggregate, decode_checkpoint
from protocol.wire.quorum import decode_certificate

__all__ = [
    "MAX_MANIFEST_BYTES",
    "WEIGHTS_FILE",
    "certify_manifest",
    "checkpoint_base",
    "decode_published",
    "delta_of",
    "next_aggregate",
    "read_aggregate",
    "read_checkpoint",
    "read_launch",
    "read_manifest",
    "read_weights",
]

log = logging.getLogger(__name__)

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
    quorum: int | None = None,
    watch: Watch | None = None,
) -> Verified[Aggregate] | None:
    """The published aggregate of ``window``, or None when there is none yet. With ``schema``,
    unknown tensors and wrong shapes are refused before the payload is read; a subset of θ is fine
    (parameters nobody sent, pipeline stages, empty windows). ``quorum`` (a run with several
    validators, :mod:`protocol.quorum`): what is there must be a certificate with that many
    validators' endorsements of its aggregate (``NoQuorum`` otherwise)."""
    try:
        data = fetch_capped(
            store,
            layout.aggregate_key(run, window),
            max_bytes=max_bytes,
            progress=_progress(watch, f"aggregate {window}"),
        )
    except ObjectNotFound:
        return None
    return decode_published(
        data,
        run_hash=run_hash,
        max_bytes=max_bytes,
        allowed_signers=allowed_signers,
        window=window,
        schema=schema,
        quorum=quorum,
    )


def decode_published(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Signers,
    window: int | None,
    schema: Schema | None = None,
    quorum: int | None = None,
) -> Verified[Aggregate]:
    """What lies at an aggregate key, verified: the one validator's signed aggregate (``quorum``
    None), or the aggregate of a certificate endorsed by ``quorum`` validators of the run."""
    if quorum is None:
        return decode_aggregate(
            data,
            run_hash=run_hash,
            max_bytes=max_bytes,
            allowed_signers=allowed_signers,
            window=window,
            schema=schema,
            partial=True,
        )
    cert = decode_certificate(
        data,
        run_hash=run_hash,
        max_bytes=max_bytes,
        allowed_signers=allowed_signers,
        quorum=quorum,
        window=window,
        schema=schema,
    )
    return cert.value.aggregate


def next_aggregate(
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    base: str,
    *,
    allowed_signers: Signers,
    max_bytes: int,
    schema: Schema | None = None,
    quorum: int | None = None,
    watch: Watch | None = None,
) -> Verified[Aggregate] | None:
    """The aggregate of ``window`` that continues the chain at ``base`` (the digest the reader holds
    for window ``window``), or None: nothing is published there yet, or what is there does not
    verify or does not chain onto ``base`` — which counts as absent (module doc)."""
    try:
        found = read_aggregate(
            store,
            run,
            run_hash,
            window,
            allowed_signers=allowed_signers,
            max_bytes=max_bytes,
            schema=schema,
            quorum=quorum,
            watch=watch,
        )
    except ProtocolError as exc:
        log.warning("aggregate %d in the store does not verify; treated as absent: %s", window, exc)
        return None
    if found is not None and found.value.base != base:
        log.warning(
            "aggregate %d in the store builds on %s, not on %s (another launch?); treated as absent",
            window,
            found.value.base[:16],
            base[:16],
        )
        return None
    return found


def delta_of(agg: Aggregate) -> SparseDict:
    """An aggregate's Δ̄ in :mod:`protocol.aggregate`'s form (what ``apply_outer`` takes), plain or
    re-compressed (:func:`protocol.broadcast.applied`)."""
    return applied(agg.tensors)


def read_manifest(
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    *,
    allowed_signers: Signers,
    quorum: int | None = None,
    max_aggregate_bytes: int = 0,
    schema: Schema | None = None,
) -> Verified[CheckpointManifest]:
    """The signed checkpoint manifest of ``window``; ``ObjectNotFound`` when there is none.

    ``quorum`` (a run with several validators): a manifest is signed by one validator only, so
    checkpoint ``window > 0`` is trusted only when the certificate of aggregate ``window − 1``
    vouches for it (:func:`certify_manifest`); ``Uncertified`` otherwise (logged)."""
    data = store.get(layout.checkpoint_manifest_key(run, window), max_bytes=MAX_MANIFEST_BYTES)
    manifest = decode_checkpoint(
        data, run_hash=run_hash, max_bytes=MAX_MANIFEST_BYTES, allowed_signers=allowed_signers, window=window
    )
    if quorum is not None and window > 0:
        try:
            certified = read_aggregate(
                store,
                run,
                run_hash,
                window - 1,
                allowed_signers=allowed_signers,
                max_bytes=max_aggregate_bytes,
                schema=schema,
                quorum=quorum,
            )
        except ProtocolError as exc:
            certified = None
            log.debug("aggregate %d does not verify: %s", window - 1, exc)
        try:
            certify_manifest(manifest.value, certified)
        except Uncertified as exc:
            log.warning("checkpoint %d counts as absent: %s", window, exc)
            raise
    return manifest


def certify_manifest(manifest: CheckpointManifest, certified: Verified[Aggregate] | None) -> None:
    """Whether ``certified`` (the certified aggregate of the window before the checkpoint, None when
    there is none that verifies) vouches for ``manifest``: its digest is the manifest's
    ``aggregate`` and the θ it leads to has the manifest's fingerprint. ``Uncertified`` otherwise:
    a lying validator can sign a self-consistent manifest of a θ nobody agreed on, but not the m
    endorsements of the aggregate that leads to it."""
    w = manifest.window
    if certified is None:
        raise Uncertified(f"checkpoint {w}: no certified aggregate of window {w - 1} vouches for it")
    if certified.digest != manifest.aggregate:
        raise Uncertified(
            f"checkpoint {w} follows aggregate {manifest.aggregate[:16]}, the certified aggregate of window "
            f"{w - 1} is {certified.digest[:16]}"
        )
    if certified.value.fingerprint != manifest.fingerprint:
        raise Uncertified(
            f"checkpoint {w} holds θ {manifest.fingerprint[:16]}, the certified aggregate of window {w - 1} "
            f"leads to {certified.value.fingerprint[:16]}"
        )


def read_launch(
    store: ObjectStore, run: str, run_hash: str, *, allowed_signers: Signers
) -> Verified[CheckpointManifest]:
    """The genesis manifest (checkpoint 0) of the launch the store holds; its digest is the base of
    window 0. ``ObjectNotFound`` when there is none, ``ProtocolError`` when it does not verify."""
    return read_manifest(store, run, run_hash, 0, allowed_signers=allowed_signers)


def checkpoint_base(manifest: Verified[CheckpointManifest], launch: str) -> str:
    """The base of the window checkpoint ``manifest`` opens, if it belongs to ``launch`` (the digest
    of the genesis manifest): ``launch`` itself at window 0, else the aggregate it follows.
    ``StaleBase`` for a checkpoint of another launch."""
    m = manifest.value
    if m.window == 0:
        if manifest.digest != launch:
            raise StaleBase(f"genesis {manifest.digest[:16]} is not the launch {launch[:16]}")
        return launch
    if m.launch != launch:
        raise StaleBase(f"checkpoint {m.window} belongs to launch {m.launch[:16]}, not {launch[:16]}")
    if m.aggregate == GENESIS:
        raise MalformedPayload(f"checkpoint {m.window} names no aggregate")
    return m.aggregate


def read_weights(
    store: ObjectStore, manifest: CheckpointManifest, *, schema: Schema | None = None, watch: Watch | None = None
) -> dict[str, torch.Tensor]:
    """θ from the files a verified manifest lists (float32, CPU), each checked against its entry
    (size and sha256, ``DigestMismatch`` naming the file) as it is fetched in ranges."""
    if not manifest.files:
        raise MalformedPayload(f"checkpoint {manifest.window} lists no files")
    params: dict[str, torch.Tensor] = {}
    for f in manifest.files:
        data = fetch(
            store, f.key, size=f.size, sha256=f.sha256, progress=_progress(watch, f"checkpoint {manifest.window}")
        )
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
    store: ObjectStore,
    run: str,
    run_hash: str,
    window: int,
    *,
    allowed_signers: Signers,
    schema: Schema | None = None,
    watch: Watch | None = None,
) -> tuple[CheckpointManifest, dict[str, torch.Tensor]]:
    """(manifest, θ_window) of the signed checkpoint of ``window``, every file verified."""
    manifest = read_manifest(store, run, run_hash, window, allowed_signers=allowed_signers).value
    return manifest, read_weights(store, manifest, schema=schema, watch=watch)


def _progress(watch: Watch | None, label: str) -> Progress | None:
    return None if watch is None else watch(label)
