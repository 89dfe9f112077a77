"""Launch and resume: where a validator stands when it starts, from its state directory and the store.

The chain grows from the digest of a genesis manifest (:mod:`protocol.chain`). Without a state
directory the validator continues the launch whose genesis the store holds — from aggregate 0, or
from the newest checkpoint that verifies when retention removed the aggregates after genesis — or
publishes a new genesis; with one, it continues only its own launch (a store that lost the genesis
gets the same one again, byte for byte) and refuses a store holding another (``ConfigError``).
θ of the saved window is rebuilt by replaying the chain from θ as last written
(:func:`protocol.replay.replayed`, each aggregate checked against its signed fingerprint), and
:meth:`Launcher.published` finds aggregates already published past the state (a crash after
publishing, a lost state directory) with θ after each (:func:`protocol.replay.apply_aggregate`).
Objects of other launches, and anything at a chain key that does not verify, are never adopted:
they are overwritten when the validator publishes.

With several validators (:mod:`protocol.quorum`) one genesis roots the chain of all of them: only
the leader of window 0, view 0 (the *founder*) publishes it, the others wait for it in the store
(until stopped: ``LaunchStopped``), and nobody replaces another validator's valid genesis
(:func:`validator.publish.publish_checkpoint`). A checkpoint restarts a validator only when the
certificate of the aggregate before it vouches for it (:meth:`protocol.replay.Chain.manifest`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from protocol import layout
from protocol.chain import checkpoint_base
from protocol.config import RunSpec
from protocol.errors import ConfigError, DigestMismatch, ObjectNotFound, ProtocolError, SparseLocoError, StoreError
from protocol.identity import Identity
from protocol.model import fingerprint
from protocol.quorum import Quorum
from protocol.replay import Chain, Position, apply_aggregate, initial_params, replayed
from protocol.store.base import ObjectStore
from protocol.wire import GENESIS, Aggregate, CheckpointManifest, Verified
from validator import publish
from validator.state import ValidatorState, load_state, save_state

__all__ = ["LaunchStopped", "Launcher", "Resumed"]

log = logging.getLogger(__name__)


class LaunchStopped(SparseLocoError):
    """The validator was stopped while it waited for the genesis another validator creates."""


@dataclass(frozen=True)
class Resumed:
    """Where the validator starts: ``state`` with θ of its window, and the window whose θ the state
    directory holds (how far a restart would replay)."""

    state: ValidatorState
    theta_window: int


class Launcher:
    """Starts or resumes one validator's launch; see the module docstring."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state_dir: Path,
        *,
        chain: Chain,
        clock: Callable[[], float],
        wait: Callable[[float], bool] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.spec, self.store, self.identity, self.state_dir = spec, store, identity, state_dir
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.chain, self.clock = chain, clock
        self.wait = wait or threading.Event().wait  # True when the validator is stopped
        self.poll_s = poll_s
        quorum = Quorum.of(spec)
        # several validators: the leader of window 0, view 0 alone creates the launch
        self.founder = quorum.leader(0, 0) if quorum.several else identity.peer_id

    def resume(self) -> Resumed:
        """The saved state with θ of its window rebuilt, or a new state at genesis."""
        saved = load_state(self.state_dir, self.run_hash)
        return self._genesis() if saved is None else self._replayed(self._same_launch(saved))

    def published(self, st: ValidatorState) -> tuple[Verified[Aggregate], dict[str, torch.Tensor]] | None:
        """The aggregate already published for ``st``'s window on its base, with θ after it (a copy:
        ``st`` is untouched); None while there is none. What lies at the key without verifying or
        chaining onto ``st`` (junk, another launch's) counts as not published."""
        agg = self.chain.next_aggregate(st.window, st.base)
        if agg is None:
            return None
        params = {n: p.detach().clone() for n, p in st.params.items()}
        try:
            apply_aggregate(params, Position(st.window, st.base, ""), agg)
        except DigestMismatch as exc:
            raise ConfigError(f"aggregate {st.window} does not reproduce its fingerprint from this state") from exc
        return agg, params

    def _genesis(self) -> Resumed:
        """Without a state: continue the launch whose genesis the store holds (a lost state
        directory: the chain in the store is the truth), or start a new launch by publishing a
        genesis manifest, whose digest roots the chain. A genesis that does not verify counts as
        absent; objects of earlier launches never chain onto a new one."""
        params = initial_params(self.spec.model)
        launch = self._stored_launch() or self._new_launch(params, self.clock())
        if launch.value.fingerprint != fingerprint(params):
            raise ConfigError("the store's genesis checkpoint differs from θ₀ built from this RunSpec")
        at = launch.value.published_at
        state = ValidatorState(
            self.run_hash,
            0,
            launch.digest,
            at,
            params,
            launch=launch.digest,
            launched_at=at,
            previous_base=launch.digest,
            standings={},
        )
        state = self._from_checkpoint(state) or state
        save_state(self.state_dir, state)
        return Resumed(state, state.window)

    def _from_checkpoint(self, genesis: ValidatorState) -> ValidatorState | None:
        """When the aggregates after genesis are gone (retention, ``sparseloco-validator gc``),
        continue the store's launch from its newest checkpoint that verifies (what a joining peer
        loads); None when aggregate 0 is still there (the whole chain is replayed) or no later
        checkpoint verifies."""
        if self.chain.next_aggregate(genesis.window, genesis.base) is not None:
            return None
        for window in reversed([w for w in self.chain.checkpoint_windows() if w > 0]):
            try:
                verified = self.chain.manifest(window)
                base = checkpoint_base(verified, genesis.launch)
                params = self.chain.checkpoint_params(verified.value)
            except (ProtocolError, StoreError) as exc:
                log.warning("checkpoint %d cannot restart the validator: %s", window, exc)
                continue
            # The aggregate before ``base`` is not known from a checkpoint: a delayed run accepts only
            # contributions on ``base`` in this first window.
            at = verified.value.published_at
            return replace(genesis, window=window, base=base, previous_base=base, opened_at=at, params=params)
        return None

    def _same_launch(self, state: ValidatorState) -> ValidatorState:
        """A saved state continues its own launch only: the store's genesis must be that launch
        (written again, byte for byte, when the store lost it); another launch is a ConfigError."""
        stored = self._stored_launch()
        if stored is None:
            stored = self._new_launch(initial_params(self.spec.model), state.launched_at)
        if stored.digest != state.launch:
            raise ConfigError(
                f"the store holds launch {stored.digest[:16]} of this run, but the state in {self.state_dir} "
                f"continues launch {state.launch[:16]}: use a store without the other launch, or move "
                "the state directory away to continue the store's launch"
            )
        return state

    def _replayed(self, state: ValidatorState) -> Resumed:
        """θ of the saved window: θ as last written (at a checkpoint window; θ₀ when none was) with
        the aggregates published since applied, each checked against its signed fingerprint, and
        the chain checked against the saved base (:mod:`validator.state`)."""
        if state.current:
            return Resumed(state, state.window)
        w = state.params_window or 0
        params = state.params or initial_params(self.spec.model)
        base = state.params_base or state.launch
        try:
            pos = replayed(self.chain, params, Position(w, base, ""), until=state.window)
        except DigestMismatch as exc:
            raise ConfigError(f"the saved θ does not reproduce the chain's fingerprints: {exc}") from exc
        if pos.window != state.window:
            raise ConfigError(
                f"cannot rebuild θ of window {state.window} from θ of window {w} in {self.state_dir}: "
                f"aggregate {pos.window} is not in the store"
            )
        if pos.base != state.base:
            raise ConfigError(f"the store's chain up to window {state.window} is not the one saved in {self.state_dir}")
        return Resumed(replace(state, params=params, params_window=None, params_base=None), w)

    def _stored_launch(self) -> Verified[CheckpointManifest] | None:
        """The store's genesis manifest; None when there is none or it does not verify."""
        try:
            return self.chain.launch()
        except ObjectNotFound:
            return None
        except ProtocolError as exc:
            log.warning("the store's genesis manifest does not verify; treated as absent: %s", exc)
            return None

    def _new_launch(self, params: dict[str, torch.Tensor], published_at: float) -> Verified[CheckpointManifest]:
        """The genesis of a store that holds none: published by this validator when it is the
        founder (the only validator, or with several the leader of window 0, view 0 — two
        genesis manifests would be two launches), else the founder's once it is in the store.
        ``LaunchStopped`` when the validator is stopped meanwhile."""
        if self.founder == self.identity.peer_id:
            return self._publish_genesis(params, published_at)
        log.info("waiting for validator %s, the leader of window 0, to publish the run's genesis", self.founder)
        while not self.wait(self.poll_s):
            launch = self._stored_launch()
            if launch is not None:
                log.info("genesis %s published by %s", launch.digest[:16], launch.public_key.hex()[:16])
                return launch
        raise LaunchStopped(f"stopped while waiting for the genesis of validator {self.founder}")

    def _publish_genesis(self, params: dict[str, torch.Tensor], published_at: float) -> Verified[CheckpointManifest]:
        return publish.publish_checkpoint(
            self.store,
            self.run_id,
            self.run_hash,
            0,
            aggregate=GENESIS,
            params=params,
            identity=self.identity,
            published_at=published_at,
            signers=self.spec.validator.public_keys,
        )
