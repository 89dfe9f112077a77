"""Hand-made peers and contributions for the validator tests (honest and hostile).

Honest updates are real: a few AdamW steps on the peer's assigned batches from θ_t, compressed by
the window's codec (``RunSpec.codec_at``: the Top-k warm-up keeps a larger k in the first windows).
Hostile ones are built from them (forged, replayed, scaled, truncated …).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping

import torch

from protocol import codec, layout
from protocol.caps import object_caps
from protocol.config import RunSpec
from protocol.data.assignment import assigned_batches, open_dataset
from protocol.identity import Identity
from protocol.model import build_model, lm_loss, parameters_of
from protocol.settings import LocalSettings
from protocol.store.memory import MemoryStore
from protocol.wire import Announcement, Contribution, encode_announcement, encode_contribution
from validator import checks
from validator.held import Held

# Two cores shared by many processes: one intra-op thread is ~30x faster than oversubscribed two.
torch.set_num_threads(1)

TINY_MODEL = {"dim": 64, "n_layers": 1, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64}
LOCAL = LocalSettings(poll_interval_s=0.02)  # the validator's local settings in these tests


def tiny_spec(vkey: Identity, **sections: dict[str, object]) -> RunSpec:
    base: dict[str, dict[str, object]] = {
        "model": TINY_MODEL,
        "data": {"seq_len": 32, "batch_size": 4},
        "inner": {"steps": 4, "lr": 3e-3, "warmup_steps": 1},
        "windows": {"upload_deadline_s": 2.0, "gather_grace_s": 0.05, "checkpoint_every": 2},
        "validator": {"public_keys": [vkey.public_key_hex], "eval_sequences": 8, "eval_peers_per_window": 8},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return RunSpec().replace(**base)


class Swarm:
    """A shared in-memory store plus peers that announce themselves and upload contributions."""

    def __init__(self, spec: RunSpec, n_peers: int) -> None:
        self.spec = spec
        self.run_hash = spec.hash()
        self.run = layout.run_id(self.run_hash)
        self.name = f"swarm-{uuid.uuid4().hex[:8]}"
        self.store = MemoryStore(self.name)
        self.peers = [Identity.generate() for _ in range(n_peers)]
        self.dataset = open_dataset(spec.data)
        self.schema = {n: tuple(p.shape) for n, p in parameters_of(build_model(spec.model)).items()}

    def handle(self) -> MemoryStore:
        """Another handle on the same namespace (the validator's own)."""
        return MemoryStore(self.name)

    def close(self) -> None:
        MemoryStore.forget(self.name)

    def announce(self, peer: Identity, *, withdrawn: bool = False) -> None:
        blob = encode_announcement(Announcement(self.run_hash, 0, "test", "cpu", withdrawn=withdrawn), peer)
        self.store.put(layout.peer_key(self.run, peer.peer_id), blob)

    def announce_all(self) -> None:
        for p in self.peers:
            self.announce(p)

    # ------------------------------------------------------------------ contributions
    def delta(self, peer: Identity, params: Mapping[str, torch.Tensor], window: int) -> dict[str, torch.Tensor]:
        """θ_t − θ_local after ``inner.steps`` AdamW steps on the peer's assigned batches."""
        model = build_model(self.spec.model)
        local = parameters_of(model)
        with torch.no_grad():
            for n, p in local.items():
                p.copy_(params[n])
        opt = torch.optim.AdamW(model.parameters(), lr=self.spec.inner.lr, betas=(0.9, 0.95), weight_decay=0.0)
        d = self.spec.data
        for batch in assigned_batches(
            self.dataset,
            self.spec.seed,
            peer.peer_id,
            window,
            self.spec.inner.steps,
            d.batch_size,
            d.seq_len,
            pages=d.pages,
        ):
            opt.zero_grad()
            lm_loss(model, batch).backward()
            opt.step()
        return {n: (params[n] - p.detach()).contiguous() for n, p in local.items()}

    def encode(self, delta: Mapping[str, torch.Tensor], window: int) -> dict[str, codec.Encoded]:
        """``delta`` compressed with the codec of ``window``, as an honest peer compresses it."""
        cfg = self.spec.codec_at(window)
        return {n: codec.encode(t, cfg) for n, t in delta.items()}

    def blob(
        self,
        signer: Identity,
        window: int,
        base: str,
        tensors: Mapping[str, codec.Encoded],
        *,
        run_hash: str | None = None,
    ) -> bytes:
        c = Contribution(run_hash or self.run_hash, window, base, self.spec.codec_at(window), dict(tensors), {})
        return encode_contribution(c, signer)

    def honest(self, peer: Identity, params: Mapping[str, torch.Tensor], window: int, base: str) -> bytes:
        return self.blob(peer, window, base, self.encode(self.delta(peer, params, window), window))

    def upload(self, peer_id: str, window: int, blob: bytes) -> None:
        self.store.put(layout.contrib_key(self.run, window, peer_id), blob)

    def held(self, signer: Identity, window: int, base: str, tensors: Mapping[str, codec.Encoded]) -> Held:
        """What the validator keeps of this contribution once it passed the per-contribution checks."""
        ctx = checks.Context(
            run_hash=self.run_hash,
            window=window,
            expected_base=base,
            codec=self.spec.codec_at(window),
            schema=self.schema,
            max_bytes=object_caps(self.spec).contribution,
            registered=frozenset({signer.peer_id}),
        )
        s = checks.screen(signer.peer_id, self.blob(signer, window, base, tensors), ctx)
        assert s.reason is None and s.held is not None, s
        return s.held


def with_nan_scale(enc: codec.Encoded) -> codec.Encoded:
    """The same tensor with a NaN per-tensor scale (what a buggy or hostile peer could send)."""
    return dataclasses.replace(enc, base=float("nan"))
