"""protocol.replay: θ₀, one aggregate applied with its base and fingerprint checked, and the replay
of a chain that the validator's publishing code wrote — what peers, the validator and the tools
all rebuild θ with."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
import torch

from protocol import layout
from protocol.aggregate import apply_outer
from protocol.broadcast import applied, plain
from protocol.config import RunSpec
from protocol.errors import DigestMismatch, StaleBase
from protocol.identity import Identity
from protocol.model import fingerprint, param_schema
from protocol.replay import Chain, Position, apply_aggregate, initial_params, replay, replayed
from protocol.store import open_store
from protocol.wire import GENESIS
from validator.publish import encode_window_aggregate, publish_checkpoint

TINY = {"preset": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
VALIDATOR = Identity.from_seed(bytes(range(32)))
T0 = 1_767_225_600.0


class Run:
    """A run in a memory store: its genesis, and aggregates appended with honest fingerprints."""

    def __init__(self) -> None:
        self.spec = RunSpec.from_dict({"model": TINY, "validator": {"public_keys": [VALIDATOR.public_key_hex]}})
        self.store = open_store(f"memory://replay-{time.time_ns()}")
        self.run = layout.run_id(self.spec.hash())
        self.theta = initial_params(self.spec.model)
        launch = publish_checkpoint(
            self.store, self.run, self.spec.hash(), 0, aggregate=GENESIS, params=self.theta, identity=VALIDATOR,
            published_at=T0,
        )  # fmt: skip
        self.genesis = Position(0, launch.digest, launch.value.fingerprint, T0)
        self.head = self.genesis

    def publish(self, *, fingerprint_next: str | None = None, base: str | None = None) -> None:
        """The next aggregate: one value in the first tensor; its signed fingerprint honest unless given."""
        name, shape = sorted(param_schema(self.spec.model).items())[0]
        w = self.head.window
        tensors = plain({name: (torch.tensor([w]), torch.tensor([1e-2 * (w + 1)]))}, {name: shape})
        after = {n: t.clone() for n, t in self.theta.items()}
        apply_outer(after, applied(tensors), 1.0)
        fp = fingerprint_next or fingerprint(after)
        blob = encode_window_aggregate(
            run_hash=self.spec.hash(), window=w, base=base or self.head.base, alpha=1.0, tensors=tensors,
            manifest=[], fingerprint_next=fp, published_at=T0 + w + 1, metadata={}, identity=VALIDATOR,
        )  # fmt: skip
        self.store.put(layout.aggregate_key(self.run, w), blob)
        self.theta = after
        self.head = Position(w + 1, hashlib.sha256(blob).hexdigest(), fp, T0 + w + 1)


@pytest.fixture
def run() -> Iterator[Run]:
    r = Run()
    yield r
    r.store.close()


def test_initial_params_are_the_signed_genesis(run: Run) -> None:
    chain = Chain(run.spec, run.store)
    assert fingerprint(initial_params(run.spec.model)) == chain.launch().value.fingerprint
    assert fingerprint(chain.checkpoint_params(chain.launch().value)) == run.genesis.fingerprint


def test_replay_applies_every_published_aggregate_in_order(run: Run) -> None:
    for _ in range(3):
        run.publish()
    params = initial_params(run.spec.model)
    steps = list(replay(Chain(run.spec, run.store), params, run.genesis))
    assert [pos.window for _, pos in steps] == [1, 2, 3]
    assert steps[-1][1].base == run.head.base and steps[-1][1].opened_at == T0 + 3
    assert fingerprint(params) == fingerprint(run.theta) == run.head.fingerprint


def test_replay_stops_at_until_and_at_the_first_missing_window(run: Run) -> None:
    for _ in range(3):
        run.publish()
    params = initial_params(run.spec.model)
    chain = Chain(run.spec, run.store)
    pos = replayed(chain, params, run.genesis, until=2)
    assert pos.window == 2
    assert replayed(chain, params, pos).window == 3
    assert replayed(chain, params, run.head) == run.head  # nothing published after the head


def test_a_fingerprint_the_step_does_not_reproduce_is_divergence(run: Run) -> None:
    run.publish(fingerprint_next="0" * 64)
    params = initial_params(run.spec.model)
    agg = Chain(run.spec, run.store).next_aggregate(0, run.genesis.base)
    assert agg is not None
    with pytest.raises(DigestMismatch):
        apply_aggregate(params, run.genesis, agg)


def test_an_aggregate_on_another_base_or_window_leaves_theta_untouched(run: Run) -> None:
    run.publish()
    chain = Chain(run.spec, run.store)
    agg = chain.aggregate(0)
    assert agg is not None
    params = initial_params(run.spec.model)
    before = fingerprint(params)
    for pos in (Position(0, "ab" * 32, before), Position(1, run.genesis.base, before)):
        with pytest.raises(StaleBase):
            apply_aggregate(params, pos, agg)
    assert fingerprint(params) == before
    assert chain.next_aggregate(0, "ab" * 32) is None  # not chaining onto the reader's base: absent
