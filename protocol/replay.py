"""One replay of the validator's chain for every reader: θ₀, one aggregate applied, the position.

Peers (join, catch-up, resync), the validator (restart, adopting what it had published), ``status``,
``export`` and ``eval`` all rebuild θ from the same signed objects with the same checks, so the
rebuilding lives here once::

    chain = Chain(spec, store)                        # the run's signed objects, verified as read
    params = initial_params(spec.model)               # θ₀: a pure function of the RunSpec
    launch = chain.launch()                           # the genesis manifest; its digest is base 0
    pos = Position(0, launch.digest, launch.value.fingerprint, launch.value.published_at)
    for verified, pos in replay(chain, params, pos):  # every aggregate published after ``pos``
        ...
    pos = apply_aggregate(params, pos, verified)      # one step; base and fingerprint checked

``Position`` is where a reader stands: θ opens window ``window``; ``base`` is the digest of
aggregate ``window − 1`` (at window 0, the digest of the launch's genesis manifest),
``fingerprint`` the sha256 of θ, ``opened_at`` the validator's signed ``published_at`` of that
aggregate, or of the checkpoint manifest θ was loaded from; None when unknown.

What lies at a chain key and does not verify or does not chain onto the reader's base counts as
not published (:mod:`protocol.chain`). An aggregate that verifies but does not reproduce its signed
fingerprint from the reader's θ means the reader diverged: :func:`apply_aggregate` raises
``DigestMismatch`` and θ must be rebuilt (a peer reloads a checkpoint; a validator stops).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

from torch import Tensor

from protocol import layout
from protocol.aggregate import apply_outer
from protocol.caps import published_bytes
from protocol.chain import (
    delta_of,
    next_aggregate,
    read_aggregate,
    read_launch,
    read_manifest,
    read_weights,
)
from protocol.config import ModelConfig, RunSpec
from protocol.errors import DigestMismatch, MalformedPayload, ObjectNotFound, ProtocolError, StaleBase
from protocol.model import build_model, fingerprint, param_schema, parameters_of
from protocol.quorum import Quorum, Signatures
from protocol.store.base import EXACT_READS, ObjectStore
from protocol.store.fetch import Watch
from protocol.wire import Aggregate, CheckpointManifest, Verified
from protocol.wire.quorum import MAX_ENDORSEMENT_BYTES, decode_endorsement

__all__ = ["Chain", "Position", "apply_aggregate", "initial_params", "replay", "replayed"]


@dataclass(frozen=True)
class Position:
    """θ opens ``window``; see the module docstring."""

    window: int
    base: str
    fingerprint: str
    opened_at: float | None = None


def initial_params(cfg: ModelConfig) -> dict[str, Tensor]:
    """θ₀ as CPU float32 tensors, the same bytes on every machine (built from ``model.init_seed``)."""
    return {n: p.detach().clone() for n, p in parameters_of(build_model(cfg)).items()}


def apply_aggregate(params: MutableMapping[str, Tensor], pos: Position, verified: Verified[Aggregate]) -> Position:
    """θ ← θ − α·Δ̄ for the aggregate that follows ``pos``, in place; the position after it.

    ``StaleBase`` when the aggregate does not chain onto ``pos`` (θ is untouched);
    ``DigestMismatch`` when θ after the step differs from the signed fingerprint (θ has diverged).
    """
    agg = verified.value
    if agg.window != pos.window:
        raise StaleBase(f"aggregate is for window {agg.window}, θ opens window {pos.window}")
    if agg.base != pos.base:
        raise StaleBase(f"aggregate {agg.window} builds on {agg.base[:16]}, θ is at {pos.base[:16]}")
    apply_outer(params, delta_of(agg), agg.alpha)
    got = fingerprint(params)
    if got != agg.fingerprint:
        raise DigestMismatch(f"θ after aggregate {agg.window} is {got[:16]}, validator signed {agg.fingerprint[:16]}")
    return Position(agg.window + 1, verified.digest, got, agg.published_at)


class Chain:
    """The signed chain of one run in one store, read with the run's keys, caps and schema.

    An aggregate that continues the chain is read once: the validator never replaces one, so
    waiting for it and applying it both ask for the same object. ``watch``: where large reads
    (checkpoint files, an aggregate past one range) report their progress
    (:data:`protocol.store.fetch.Watch`).
    """

    def __init__(self, spec: RunSpec, store: ObjectStore, *, watch: Watch | None = None) -> None:
        self.spec = spec
        self.store = store
        self.watch = watch
        self.run_hash = spec.hash()
        self.run = layout.run_id(self.run_hash)
        self.schema = param_schema(spec.model)
        self.signers = spec.validator.public_keys
        quorum = Quorum.of(spec)
        # several validators: aggregates travel as certificates of m endorsements (protocol.quorum)
        self.quorum: int | None = quorum.m if quorum.several else None
        self.validators: Quorum | None = quorum if quorum.several else None
        self.max_aggregate_bytes = published_bytes(spec)  # the validator reads with the same cap
        self._next: dict[tuple[int, str], Verified[Aggregate]] = {}

    def aggregate(self, window: int) -> Verified[Aggregate] | None:
        """The verified aggregate of ``window``, None when there is none; strict: ``ProtocolError``
        when what is there does not verify."""
        return read_aggregate(
            self.store,
            self.run,
            self.run_hash,
            window,
            allowed_signers=self.signers,
            max_bytes=self.max_aggregate_bytes,
            schema=self.schema,
            quorum=self.quorum,
            watch=self.watch,
        )

    def next_aggregate(self, window: int, base: str) -> Verified[Aggregate] | None:
        """The aggregate of ``window`` that continues the chain at ``base``; None while none is
        published (anything else at the key counts as absent)."""
        found = self._next.get((window, base))
        if found is None:
            found = next_aggregate(
                self.store,
                self.run,
                self.run_hash,
                window,
                base,
                allowed_signers=self.signers,
                max_bytes=self.max_aggregate_bytes,
                schema=self.schema,
                quorum=self.quorum,
                watch=self.watch,
            )
            if found is not None:
                self._next = {k: v for k, v in self._next.items() if k[0] >= window - 1}
                self._next[(window, base)] = found
        return found

    def signatures(self, window: int) -> Signatures | None:
        """Several validators: the endorsements of ``window`` found so far (what a reader waiting
        for its certificate is waiting for); None with one validator. Up to
        :data:`~protocol.store.base.EXACT_READS` validators, a GET of each one's endorsement key (a
        404 for one not there: cheaper in the bucket than a LIST); more, one listing of the window's
        endorsements, then a GET of each listed one (at most n, each at most 1 KiB). An endorsement
        that does not verify or is not there any more counts as none."""
        q = self.validators
        if q is None:
            return None
        prefix = layout.endorsement_prefix(self.run, window)
        ids = set(q.ids)
        if len(ids) <= EXACT_READS:
            signers = sorted(ids)
        else:
            listed = self.store.list_written_by(prefix, ids)
            signers = sorted({k[len(prefix) :] for k in listed if k.startswith(prefix)} & ids)
        digests: dict[str, int] = {}
        for signer in signers:
            try:
                e = decode_endorsement(
                    self.store.get(prefix + signer, max_bytes=MAX_ENDORSEMENT_BYTES),
                    run_hash=self.run_hash,
                    allowed_signers=self.signers,
                    window=window,
                    sender=signer,
                )
            except (ObjectNotFound, ProtocolError):
                continue
            digests[e.value.aggregate] = digests.get(e.value.aggregate, 0) + 1
        return Signatures(
            window=window,
            m=q.m,
            n=q.n,
            endorsements=max(digests.values(), default=0),
            endorsed=sum(digests.values()),
        )

    def launch(self) -> Verified[CheckpointManifest]:
        """The genesis manifest of the launch the store holds; ``ObjectNotFound`` or ``ProtocolError``."""
        return read_launch(self.store, self.run, self.run_hash, allowed_signers=self.signers)

    def manifest(self, window: int) -> Verified[CheckpointManifest]:
        """The signed checkpoint manifest of ``window``; ``ObjectNotFound`` when there is none. With
        several validators only one the certificate of aggregate ``window − 1`` vouches for
        (:func:`protocol.chain.read_manifest`; ``Uncertified`` otherwise): every reader of a
        checkpoint — catch-up, resync, ``status``, ``export``, the validator's restart — asks here."""
        return read_manifest(
            self.store,
            self.run,
            self.run_hash,
            window,
            allowed_signers=self.signers,
            quorum=self.quorum,
            max_aggregate_bytes=self.max_aggregate_bytes,
            schema=self.schema,
        )

    def checkpoint_windows(self) -> list[int]:
        """Windows that have a checkpoint manifest in the store, ascending (not yet verified)."""
        out = set()
        for key in self.store.list(layout.checkpoints_prefix(self.run)):
            try:
                parsed = layout.parse_key(key, run=self.run)
            except MalformedPayload:
                continue
            if parsed.file == layout.CHECKPOINT_MANIFEST and parsed.window is not None:
                out.add(parsed.window)
        return sorted(out)

    def checkpoint_params(self, manifest: CheckpointManifest) -> dict[str, Tensor]:
        """θ of a verified checkpoint manifest. θ₀ is built rather than downloaded, and proven by the
        fingerprint to be the bytes the validator signed."""
        if manifest.window != 0:
            return read_weights(self.store, manifest, schema=self.schema, watch=self.watch)
        params = initial_params(self.spec.model)
        got = fingerprint(params)
        if got != manifest.fingerprint:
            raise DigestMismatch(f"checkpoint 0 weights hash to {got[:16]}, manifest says {manifest.fingerprint[:16]}")
        return params


def replay(
    chain: Chain, params: MutableMapping[str, Tensor], pos: Position, *, until: int | None = None
) -> Iterator[tuple[Verified[Aggregate], Position]]:
    """Apply every aggregate published after ``pos`` (up to window ``until``, exclusive) to
    ``params`` in place, yielding each with the position after it. Raises what
    :func:`apply_aggregate` raises; stops at the first window with nothing published."""
    while until is None or pos.window < until:
        verified = chain.next_aggregate(pos.window, pos.base)
        if verified is None:
            return
        pos = apply_aggregate(params, pos, verified)
        yield verified, pos


def replayed(chain: Chain, params: MutableMapping[str, Tensor], pos: Position, *, until: int | None = None) -> Position:
    """:func:`replay` to its end: the position after the last aggregate applied (``pos`` if none)."""
    for step in replay(chain, params, pos, until=until):
        pos = step[1]
    return pos
