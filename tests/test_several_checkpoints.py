"""Genesis, checkpoints and retention in a run with several validators (``protocol.quorum``).

* One launch: only the leader of window 0, view 0 publishes the genesis; the others wait for it
  (and stop waiting when stopped), and nobody replaces another validator's valid genesis.
* One checkpoint per window: the first valid manifest of this launch for the θ after the certified
  aggregate stands; the other validators return it instead of writing their own. A manifest of
  another θ (a lying validator's) is replaced.
* A checkpoint is trusted only when the certificate of aggregate w − 1 names its aggregate and
  fingerprint: a lying validator's self-consistent checkpoint counts as absent for every reader
  (``Chain.manifest``, catch-up, ``export``, ``checkpoints``), which fall back to an older one.
* Retention keeps the certified aggregate before every checkpoint it keeps and collects the
  agreement's objects (proposals, endorsements, objections) with the contributions.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from client.checkpoints import Location, list_checkpoints, load_checkpoint
from client.peer.sync import Sync
from client.status import run_status
from protocol import layout
from protocol.aggregate import apply_outer
from protocol.broadcast import plain
from protocol.caps import published_bytes
from protocol.chain import delta_of
from protocol.config import RunSpec
from protocol.errors import Uncertified
from protocol.identity import Identity
from protocol.model import fingerprint, param_schema
from protocol.quorum import Quorum
from protocol.replay import Chain, initial_params
from protocol.store.base import ObjectStore
from protocol.store.memory import MemoryStore
from protocol.wire import GENESIS, CheckpointFile, CheckpointManifest, decode_aggregate, encode_checkpoint
from protocol.wire.quorum import Endorsement, encode_certificate, encode_endorsement
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.launch import Launcher, LaunchStopped
from validator.node import Validator
from validator.publish import encode_window_aggregate, publish_checkpoint, weights_bytes
from validator.retention import Retention, plan_collection

pytestmark = pytest.mark.timeout(180)

KEYS = [Identity.from_seed(bytes([i]) * 32) for i in range(4)]
TINY = {"preset": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
T0 = 1_767_225_600.0


def several_spec(**windows: object) -> RunSpec:
    return RunSpec.from_dict(
        {"model": TINY, "validator": {"public_keys": [k.public_key_hex for k in KEYS]}, "windows": windows}
    )


@dataclass
class Run:
    """A run of four validators (m = 3) with a certified chain written by hand."""

    spec: RunSpec
    store: ObjectStore
    url: str
    launch: str
    thetas: list[dict[str, torch.Tensor]]  # θ_w after w certified aggregates
    digests: list[str]  # digest of aggregate w

    @property
    def run(self) -> str:
        return layout.run_id(self.spec.hash())

    @property
    def keys(self) -> list[str]:
        return [k.public_key_hex for k in KEYS]

    def certify(self, window: int) -> None:
        """Aggregate ``window`` (one small step on the first tensor), certified by three validators."""
        spec, theta = self.spec, self.thetas[window]
        name, shape = sorted(param_schema(spec.model).items())[0]
        tensors = plain({name: (torch.tensor([window]), torch.tensor([1e-2]))}, {name: shape})
        base = self.launch if window == 0 else self.digests[window - 1]
        nxt = {n: t.clone() for n, t in theta.items()}

        def encoded(fp: str) -> bytes:
            return encode_window_aggregate(
                run_hash=spec.hash(),
                window=window,
                base=base,
                alpha=1.0,
                tensors=tensors,
                manifest=[],
                fingerprint_next=fp,
                published_at=T0 + window + 1,
                metadata={},
                identity=KEYS[window % 4],
            )

        draft = decode_aggregate(encoded("0" * 64), run_hash=spec.hash(), max_bytes=1 << 20, allowed_signers=None)
        apply_outer(nxt, delta_of(draft.value), 1.0)
        blob = encoded(fingerprint(nxt))
        digest = decode_aggregate(blob, run_hash=spec.hash(), max_bytes=1 << 20, allowed_signers=None).digest
        leader = Quorum.of(spec).leader(window, 0)
        ends = [encode_endorsement(Endorsement(spec.hash(), window, 0, leader, digest), k) for k in KEYS[:3]]
        cert = encode_certificate(blob, ends, window, spec.hash(), KEYS[0])
        self.store.put(layout.aggregate_key(self.run, window), cert)
        self.thetas.append(nxt)
        self.digests.append(digest)

    def checkpoint(self, window: int, signer: Identity, params: dict[str, torch.Tensor] | None = None) -> str:
        """``signer`` publishes checkpoint ``window`` (θ_window, or ``params``); the digest that stands."""
        return publish_checkpoint(
            self.store,
            self.run,
            self.spec.hash(),
            window,
            aggregate=self.digests[window - 1],
            params=self.thetas[window] if params is None else params,
            identity=signer,
            published_at=T0 + window,
            launch=self.launch,
            signers=self.keys,
        ).digest

    def forge(self, window: int, signer: Identity, *, aggregate: str | None = None) -> dict[str, torch.Tensor]:
        """A lying validator's checkpoint ``window``: another θ, a manifest consistent with it
        (its fingerprint, its files), naming the certified aggregate unless ``aggregate`` says
        otherwise, put over whatever is there. The fake θ."""
        fake = {n: t + 0.5 for n, t in self.thetas[window].items()}
        blob = weights_bytes(fake, window=window)
        key = layout.checkpoint_key(self.run, window, "model.safetensors")
        self.store.put(key, blob)
        files = (CheckpointFile(key, hashlib.sha256(blob).hexdigest(), len(blob)),)
        named = self.digests[window - 1] if aggregate is None else aggregate
        m = CheckpointManifest(
            self.spec.hash(), window, named, fingerprint(fake), files, T0 + window, launch=self.launch
        )
        self.store.put(layout.checkpoint_manifest_key(self.run, window), encode_checkpoint(m, signer))
        return fake


@pytest.fixture
def run() -> Iterator[Run]:
    spec = several_spec(checkpoint_every=2)
    url = f"memory://several-ckpt-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(url.removeprefix("memory://"))
    theta = initial_params(spec.model)
    launch = publish_checkpoint(
        store,
        layout.run_id(spec.hash()),
        spec.hash(),
        0,
        aggregate=GENESIS,
        params=theta,
        identity=KEYS[0],
        published_at=T0,
        signers=[k.public_key_hex for k in KEYS],
    ).digest
    r = Run(spec, store, url, launch, [theta], [])
    yield r
    MemoryStore.forget(url.removeprefix("memory://"))


def manifest_bytes(r: Run, window: int) -> bytes:
    return r.store.get(layout.checkpoint_manifest_key(r.run, window), max_bytes=1 << 20)


# ------------------------------------------------------------------------------ publishing
def test_another_validators_genesis_stands(run: Run) -> None:
    before = manifest_bytes(run, 0)
    for key in KEYS[1:]:
        got = publish_checkpoint(
            run.store,
            run.run,
            run.spec.hash(),
            0,
            aggregate=GENESIS,
            params=run.thetas[0],
            identity=key,
            published_at=T0 + 7,  # another clock: another genesis, were it written
            signers=run.keys,
        )
        assert got.digest == run.launch
    assert manifest_bytes(run, 0) == before
    assert Chain(run.spec, run.store).launch().digest == run.launch


def test_the_first_valid_checkpoint_stands_and_a_lie_is_replaced(run: Run) -> None:
    run.certify(0)
    run.certify(1)
    first = run.checkpoint(2, KEYS[2])
    before = manifest_bytes(run, 2)
    assert run.checkpoint(2, KEYS[1]) == first and run.checkpoint(2, KEYS[3]) == first
    assert manifest_bytes(run, 2) == before  # nobody rewrote it
    weights = layout.checkpoint_key(run.run, 2, "model.safetensors")
    good = run.store.get(weights, max_bytes=1 << 24)
    run.store.put(weights, b"damaged")
    assert run.checkpoint(2, KEYS[3]) == first and run.store.get(weights, max_bytes=1 << 24) == good
    run.forge(2, KEYS[3])  # a lying validator writes another θ over it
    assert run.checkpoint(2, KEYS[1]) != first  # an honest one puts the certified θ back
    got = Chain(run.spec, run.store).manifest(2)
    assert got.value.fingerprint == fingerprint(run.thetas[2]) and got.public_key == KEYS[1].public_key


# ------------------------------------------------------------------------------ readers
def test_a_checkpoint_the_certificate_vouches_for_is_read(run: Run) -> None:
    run.certify(0)
    run.certify(1)
    run.checkpoint(2, KEYS[1])
    chain = Chain(run.spec, run.store)
    assert chain.manifest(2).value.fingerprint == fingerprint(run.thetas[2])
    status = run_status(run.spec, run.store, store_url=run.url, state_dir=None, peer_id=None)
    assert status.checkpoint is not None and status.checkpoint["window"] == 2
    assert load_checkpoint(run.spec, Location(run.url, None)).manifest.window == 2
    params: dict[str, torch.Tensor] = {}
    pos = Sync(run.spec, run.store).resync(params)
    assert pos.window == 2 and pos.base == run.digests[1] and fingerprint(params) == fingerprint(run.thetas[2])


@pytest.mark.parametrize("lie", ["theta", "aggregate", "no_certificate"])
def test_a_fake_checkpoint_counts_as_absent_for_every_reader(run: Run, lie: str) -> None:
    run.certify(0)
    run.certify(1)
    run.certify(2)
    if lie == "theta":
        fake = run.forge(2, KEYS[3])
    elif lie == "aggregate":  # names aggregate 0's digest: the certificate of window 1 is another
        fake = run.forge(2, KEYS[3], aggregate=run.digests[0])
    else:  # consistent with θ_2, but nothing certifies aggregate 1
        run.checkpoint(2, KEYS[1])
        run.store.delete(layout.aggregate_key(run.run, 1))
        fake = None
    chain = Chain(run.spec, run.store)
    with pytest.raises(Uncertified):
        chain.manifest(2)
    assert chain.manifest(0).digest == run.launch  # genesis is the launch itself: no certificate
    # catch-up falls back to genesis and replays the certified chain
    params: dict[str, torch.Tensor] = {}
    sync = Sync(run.spec, run.store)
    pos = sync.advance(params, sync.resync(params))
    expect = 3 if lie != "no_certificate" else 1
    assert pos.window == expect and fingerprint(params) == fingerprint(run.thetas[expect])
    if fake is not None:
        assert fingerprint(params) != fingerprint(fake)
    # export and `checkpoints`: the newest usable checkpoint, and the lie listed with its reason
    ckpt = load_checkpoint(run.spec, Location(run.url, None))
    assert ckpt.manifest.window == 0
    infos = {i.window: i for i in list_checkpoints(run.spec, run.store)}
    assert infos[2].error is not None and "uncertified" in infos[2].error and infos[0].error is None
    status = run_status(run.spec, run.store, store_url=run.url, state_dir=None, peer_id=None)
    assert status.checkpoint is not None and status.checkpoint["window"] == 0


def test_a_validator_without_state_never_restarts_from_a_fake_checkpoint(run: Run, tmp_path: Path) -> None:
    for w in range(3):
        run.certify(w)
    run.forge(2, KEYS[3])
    run.store.delete(layout.aggregate_key(run.run, 0))  # as retention would, were checkpoint 2 real
    chain = Chain(run.spec, run.store)
    launcher = Launcher(run.spec, run.store, KEYS[1], tmp_path / "v1", chain=chain, clock=lambda: T0)
    # aggregate 0 is gone and the only later checkpoint is a lie: the validator stays at genesis
    assert launcher.resume().state.window == 0


# ------------------------------------------------------------------------------ retention
def test_retention_keeps_the_certificate_of_every_kept_checkpoint(run: Run) -> None:
    for w in range(6):
        run.certify(w)
    run.checkpoint(2, KEYS[1])
    run.checkpoint(4, KEYS[2])
    for w in range(6):
        for v in KEYS:
            vid = v.peer_id
            run.store.put(layout.proposal_key(run.run, w, vid), b"p")
            run.store.put(layout.endorsement_key(run.run, w, vid), b"e")
            run.store.put(layout.objection_key(run.run, w, vid, KEYS[0].peer_id), b"o")
    plan = plan_collection(
        run.store,
        run.run,
        run.spec.hash(),
        current=6,
        policy=Retention(windows=2, checkpoint_every=2),
        signers=run.keys,
        quorum=3,
        max_aggregate_bytes=published_bytes(run.spec),
    )
    assert plan.anchor == 4
    gone = set(plan.delete)
    aggregates = {w for w in range(6) if layout.aggregate_key(run.run, w) in gone}
    assert aggregates == {0, 2}  # 1 vouches for checkpoint 2 (archived), 3 for checkpoint 4
    for w in range(6):
        keys = {
            layout.proposal_key(run.run, w, KEYS[1].peer_id),
            layout.endorsement_key(run.run, w, KEYS[2].peer_id),
            layout.objection_key(run.run, w, KEYS[3].peer_id, KEYS[0].peer_id),
        }
        assert (keys <= gone) == (w < 4) and (keys & gone == set()) == (w >= 4)


def test_retention_never_anchors_on_a_fake_checkpoint(run: Run) -> None:
    for w in range(6):
        run.certify(w)
    run.checkpoint(2, KEYS[1])
    run.forge(4, KEYS[3])
    plan = plan_collection(
        run.store,
        run.run,
        run.spec.hash(),
        current=6,
        policy=Retention(windows=2),
        signers=run.keys,
        quorum=3,
        max_aggregate_bytes=published_bytes(run.spec),
    )
    assert plan.anchor == 2
    assert not any(layout.aggregate_key(run.run, w) in plan.delete for w in range(1, 6))


# ------------------------------------------------------------------------------ validators
@pytest.fixture
def swarm() -> Iterator[Swarm]:
    keys = KEYS
    spec = tiny_spec(
        keys[0],
        validator={"public_keys": [k.public_key_hex for k in keys], "handover_s": 2.0},
        windows={"checkpoint_every": 1},
    )
    sw = Swarm(spec, 3)
    sw.announce_all()
    yield sw
    sw.close()


class Recording(MemoryStore):
    """A handle on a shared namespace that records the keys it puts."""

    puts: list[str]

    def __init__(self, name: str, puts: list[str]) -> None:
        super().__init__(name)
        self.puts = puts

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        super().put(key, data, if_absent=if_absent)
        self.puts.append(key)


def test_validators_started_together_share_one_genesis_and_one_checkpoint(swarm: Swarm, tmp_path: Path) -> None:
    puts: list[str] = []
    vs = [
        Validator(swarm.spec, Recording(swarm.name, puts), k, tmp_path / f"v{i}", local=LOCAL)
        for i, k in enumerate(KEYS)
    ]
    threads = [threading.Thread(target=v.resume) for v in vs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    chain = Chain(swarm.spec, swarm.store)
    launch = chain.launch()
    founder = Quorum.of(swarm.spec).leader(0, 0)
    assert {v.state.launch for v in vs if v.state} == {launch.digest} and len(vs) == 4
    assert [v for v in vs if v.identity.peer_id == founder][0].identity.public_key == launch.public_key
    assert puts.count(layout.checkpoint_manifest_key(swarm.run, 0)) == 1
    for p in swarm.peers:
        swarm.upload(p.peer_id, 0, swarm.honest(p, vs[0].state.params, 0, vs[0].state.base))  # type: ignore[union-attr]
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: vs[i].run(windows=1)})) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {v.state.window for v in vs if v.state} == {1}
    manifest = chain.manifest(1)  # vouched for by the certificate of window 0
    assert manifest.value.fingerprint == chain.aggregate(0).value.fingerprint  # type: ignore[union-attr]
    assert puts.count(layout.checkpoint_manifest_key(swarm.run, 1)) == 1  # the first stood
    for v in vs:
        v.close()


def test_a_waiting_validator_stops_when_told(swarm: Swarm, tmp_path: Path) -> None:
    founder = Quorum.of(swarm.spec).leader(0, 0)
    other = next(k for k in KEYS if k.peer_id != founder)
    v = Validator(swarm.spec, swarm.handle(), other, tmp_path / "v", local=LOCAL)
    raised: list[BaseException] = []

    def resume() -> None:
        try:
            v.resume()
        except LaunchStopped as exc:
            raised.append(exc)

    t = threading.Thread(target=resume)
    t.start()
    v.stop.set()
    t.join(30)
    assert not t.is_alive() and raised and founder in str(raised[0])
    assert v.run(windows=1) == []  # stopped: no window, no genesis of its own
    assert not swarm.store.exists(layout.checkpoint_manifest_key(swarm.run, 0))
    v.close()


def test_a_waiting_validator_continues_once_the_founder_published(swarm: Swarm, tmp_path: Path) -> None:
    founder = Quorum.of(swarm.spec).leader(0, 0)
    other = next(k for k in KEYS if k.peer_id != founder)
    lead = next(k for k in KEYS if k.peer_id == founder)
    waiting = Validator(swarm.spec, swarm.handle(), other, tmp_path / "w", local=LOCAL)
    t = threading.Thread(target=waiting.resume)
    t.start()
    leader = Validator(swarm.spec, swarm.handle(), lead, tmp_path / "l", local=LOCAL, clock=lambda: time.time() + 5)
    leader.resume()
    t.join(60)
    assert waiting.state is not None and leader.state is not None
    assert waiting.state.launch == leader.state.launch == Chain(swarm.spec, swarm.store).launch().digest
    waiting.close()
    leader.close()
