"""Staying bit-identical with the swarm: find the current window, load checkpoints, replay aggregates.

A peer holds θ as CPU float32 tensors (the *master copy*; the trainer's model may live on a GPU).
Every change to θ goes through this module, and only from objects signed by a key in
``spec.validator.public_keys``. :class:`Sync` reads one run's chain and changes the θ it is given;
it keeps no θ of its own (the peer's is :class:`client.peer.position.Theta`'s)::

    sync = Sync(spec, store, poll_interval_s=settings.poll_interval_s)
    pos = sync.bootstrap(params)                 # newest checkpoint + replay of the aggregates after it
    for step in sync.steps(params, pos):         # every aggregate published since ``pos``, as values:
        step.pos                                 #   Advanced (one applied) or Reloaded (θ rebuilt)
    pos = sync.advance(params, pos)              # the same, to its end
    sync.wait_until_published(pos.window, base=pos.base, stop_at=deadline)
    sync.wait_until_published(pos.window, base=pos.base, due_at=expected)  # backs off until then
    sync.wait_until_published(pos.window, base=pos.base, on_waiting=show)  # several validators:
                                                 #   show(Signatures) every SIGNATURES_EVERY_S

``Position`` (:mod:`protocol.replay`) is where a peer stands; applying one aggregate, θ₀ and the
chain's reads are :mod:`protocol.replay`'s, the same for the validator and every tool.

The chain is verified from its root, the genesis manifest of the launch the store holds
(:mod:`protocol.chain`): a checkpoint of another launch is never loaded, and an object at an
aggregate key that does not verify or does not chain onto ``base`` counts as not published — it
neither opens the next window nor stops the peer. Recovery rules: an aggregate whose resulting
fingerprint differs from the one it carries means this peer diverged: :meth:`Sync.steps` then
reloads the newest checkpoint (:meth:`Sync.resync`), says so (:class:`Reloaded`) and replays from
there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import Tensor

from protocol import layout
from protocol.chain import checkpoint_base
from protocol.config import RunSpec
from protocol.errors import DigestMismatch, ObjectNotFound, ProtocolError, StaleBase, StoreError
from protocol.quorum import Signatures
from protocol.replay import Chain, Position, apply_aggregate, replay
from protocol.store.base import ObjectStore
from protocol.store.fetch import Watch
from protocol.windows import poll_delays
from protocol.wire import Aggregate, Verified

__all__ = ["SIGNATURES_EVERY_S", "Advanced", "NotReady", "Position", "Reloaded", "Step", "Sync"]

# Several validators: while a reader waits for an aggregate it reads the endorsements so far at most
# this often (a listing of at most n keys and as many GETs of 1 KiB), never on every poll.
SIGNATURES_EVERY_S = 5.0


class NotReady(ProtocolError):
    """The run has no signed genesis checkpoint yet (the validator has not started)."""

    reason = "not_ready"


@dataclass(frozen=True)
class Advanced:
    """θ holds ``aggregate`` now and stands at ``pos``."""

    aggregate: Verified[Aggregate]
    pos: Position


@dataclass(frozen=True)
class Reloaded:
    """θ diverged (``error``) and was rebuilt from the checkpoint it stands at now, ``pos``."""

    pos: Position
    error: ProtocolError


Step = Advanced | Reloaded
"""One change to θ while it catches up with the chain."""


class Sync:
    """Reads signed aggregates and checkpoints of one run from a store and applies them to θ."""

    def __init__(
        self, spec: RunSpec, store: ObjectStore, *, poll_interval_s: float = 1.0, watch: Watch | None = None
    ) -> None:
        self.spec = spec
        self.chain = Chain(spec, store, watch=watch)  # watch: the progress of large reads
        self.run = self.chain.run
        self.max_aggregate_bytes = self.chain.max_aggregate_bytes
        self.poll_s = poll_interval_s  # the local setting poll_interval_s

    @property
    def store(self) -> ObjectStore:
        """The store the chain is read from (one for every read of this reader)."""
        return self.chain.store

    @store.setter
    def store(self, store: ObjectStore) -> None:
        self.chain.store = store

    # ------------------------------------------------------------------ discovery
    def checkpoint_windows(self) -> list[int]:
        """Windows that have a checkpoint manifest, ascending."""
        return self.chain.checkpoint_windows()

    # ------------------------------------------------------------------ aggregates
    def fetch_aggregate(self, window: int) -> Verified[Aggregate] | None:
        """The verified aggregate of ``window``, or None when it is not published yet; a
        ``ProtocolError`` when what is there does not verify (strict: see :meth:`next_aggregate`)."""
        return self.chain.aggregate(window)

    def next_aggregate(self, window: int, base: str) -> Verified[Aggregate] | None:
        """The aggregate of ``window`` that continues the chain at ``base``; None while none is
        published (anything else at the key counts as absent, see the module doc)."""
        return self.chain.next_aggregate(window, base)

    def aggregate_published(self, window: int, base: str | None = None) -> bool:
        """Whether a verified aggregate of ``window`` is published; with ``base``, one that chains
        onto it (what a peer at ``window`` waits for). Junk at the key is not an aggregate."""
        if base is not None:
            return self.next_aggregate(window, base) is not None
        if not self.store.exists(layout.aggregate_key(self.run, window)):
            return False
        try:
            return self.fetch_aggregate(window) is not None
        except ProtocolError:
            return False

    def wait_until_published(
        self,
        window: int,
        *,
        base: str | None = None,
        stop_at: float | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        on_waiting: Callable[[Signatures], None] | None = None,
        signatures_every_s: float = SIGNATURES_EVERY_S,
        due_at: float | None = None,
    ) -> bool:
        """Poll until aggregate ``window`` is published (True; with ``base``: one chaining onto it),
        ``stop_at`` passes or ``should_stop()`` (False). Each poll is one GET of the aggregate's
        key. Before ``due_at`` (unix time; the aggregate is not expected sooner, e.g.
        :meth:`client.peer.position.Theta.due_at`) the polls back off from ``poll_s`` to
        :func:`protocol.windows.max_poll_s`; from then on, or without it, one every ``poll_s``:
        a reader that waits idles, and a GET costs far less than its idle time. In a run with several validators,
        ``on_waiting`` is told what the aggregate still waits for (:meth:`Chain.signatures`) once
        ``signatures_every_s`` have passed without it, and again every ``signatures_every_s``; a
        store error while reading the endorsements only skips that report, and one while looking
        for the aggregate is one more look that did not find it (a store outage shorter than the
        window in training does not fail the window)."""
        due = time.monotonic() + signatures_every_s
        delays = poll_delays(self.poll_s, self.spec.windows)  # before due_at: each look is a billed request
        while not should_stop():
            try:
                if self.aggregate_published(window, base):
                    return True
            except StoreError:  # the store does not answer now (an outage): look again, as for an absent one
                pass
            if stop_at is not None and time.time() >= stop_at:
                return False
            if on_waiting is not None and self.chain.validators is not None and time.monotonic() >= due:
                due = time.monotonic() + signatures_every_s
                try:
                    found = self.chain.signatures(window)
                except StoreError:
                    found = None
                if found is not None:
                    on_waiting(found)
            now = time.time()
            delay = (
                self.poll_s if due_at is None or now >= due_at else max(self.poll_s, min(next(delays), due_at - now))
            )
            time.sleep(delay if stop_at is None else max(0.0, min(delay, stop_at - now)))
        return False

    def apply(self, params: dict[str, Tensor], pos: Position, verified: Verified[Aggregate]) -> Position:
        """θ ← θ − α·Δ̄ for the aggregate that follows ``pos`` (:func:`protocol.replay.apply_aggregate`)."""
        return apply_aggregate(params, pos, verified)

    # ------------------------------------------------------------------ checkpoints
    def launch(self) -> str:
        """The digest of the genesis manifest of the launch the store holds (the base of window 0);
        NotReady when there is none that verifies (the validator has not started yet)."""
        try:
            return self.chain.launch().digest
        except ObjectNotFound:
            raise NotReady("no signed genesis checkpoint in the store yet (is the validator running?)") from None
        except ProtocolError as exc:
            raise NotReady(f"the store's genesis checkpoint does not verify (yet): {exc}") from exc

    def load_checkpoint(self, window: int, launch: str) -> tuple[Position, dict[str, Tensor]]:
        """θ from the signed checkpoint of ``window`` of ``launch`` (files checked against the
        manifest); StaleBase for a checkpoint of another launch."""
        verified = self.chain.manifest(window)
        base = checkpoint_base(verified, launch)
        manifest = verified.value
        params = self.chain.checkpoint_params(manifest)
        return Position(window, base, manifest.fingerprint, manifest.published_at), params

    # ------------------------------------------------------------------ catch-up
    def bootstrap(self, params: dict[str, Tensor]) -> Position:
        """Load the newest valid checkpoint into ``params`` and replay every aggregate after it."""
        return self.advance(params, self.resync(params))

    def resync(self, params: dict[str, Tensor]) -> Position:
        """Replace ``params`` by the newest checkpoint of the store's launch that verifies (older
        ones as fallback)."""
        launch = self.launch()
        windows = self.checkpoint_windows()
        last_error: ProtocolError | StoreError | None = None
        for window in reversed(windows):
            try:
                pos, loaded = self.load_checkpoint(window, launch)
            except (ProtocolError, StoreError) as exc:
                last_error = exc  # a damaged or forged checkpoint: try the one before it
                continue
            params.clear()
            params.update(loaded)
            return pos
        if last_error is None:
            raise NotReady("no signed checkpoint in the store yet (is the validator running?)")
        raise last_error

    def steps(self, params: dict[str, Tensor], pos: Position, *, max_resyncs: int = 2) -> Iterator[Step]:
        """Apply every published aggregate after ``pos`` to ``params``, yielding each change as it
        happens: :class:`Advanced` per aggregate, :class:`Reloaded` when θ diverged and was rebuilt
        from a checkpoint (at most ``max_resyncs`` times; then the mismatch is raised). What was
        yielded before an error stands (θ holds it)."""
        resyncs = 0
        while True:
            try:
                for verified, after in replay(self.chain, params, pos):
                    yield Advanced(verified, after)
                return
            except (StaleBase, DigestMismatch) as exc:
                if resyncs >= max_resyncs:
                    raise
                resyncs += 1
                pos = self.resync(params)
                yield Reloaded(pos, exc)

    def advance(self, params: dict[str, Tensor], pos: Position, *, max_resyncs: int = 2) -> Position:
        """:meth:`steps` to its end: the position after the last change (``pos`` if none)."""
        for step in self.steps(params, pos, max_resyncs=max_resyncs):
            pos = step.pos
        return pos
