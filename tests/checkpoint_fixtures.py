"""A run with signed checkpoints in a directory store, as the validator publishes them, for the
tests of ``sparseloco checkpoints | export | eval | sample``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocol import layout
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.model import build_model
from protocol.settings import StoreSettings, local_table_toml
from protocol.store import open_store
from protocol.wire import GENESIS
from validator.publish import publish_checkpoint

VALIDATOR = Identity.from_seed(bytes(range(32)))
PUBLISHED_AT = 1_767_225_600.0


def tiny_model(**overrides: Any) -> dict[str, Any]:
    return {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 96, "max_seq_len": 64, **overrides}


def trained_like(spec: RunSpec, seed: int = 1, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """θ₀ plus noise: weights far enough from init that attention is not uniform and RoPE matters."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach() + scale * torch.randn(p.shape, generator=gen)).contiguous()
        for n, p in build_model(spec.model).named_parameters()
    }


@dataclass
class Run:
    spec: RunSpec
    run_toml: Path
    store_dir: Path
    params: dict[int, dict[str, torch.Tensor]]  # window -> θ of its checkpoint

    @property
    def store_url(self) -> str:
        return f"file://{self.store_dir}"

    @property
    def settings(self) -> StoreSettings:
        """The store settings run.toml's [local] table gives."""
        return StoreSettings(url=self.store_url)

    @property
    def run_id(self) -> str:
        return layout.run_id(self.spec.hash())

    def checkpoint_dir(self, window: int) -> Path:
        return self.store_dir / self.run_id / "checkpoint" / layout.window_str(window)


def make_run(tmp_path: Path, *, windows: tuple[int, ...] = (0, 4), signer: Identity = VALIDATOR, **model: Any) -> Run:
    """A run.toml whose [local] store.url is a directory store holding signed checkpoints of ``windows``."""
    store_dir = (tmp_path / "store").resolve()
    spec = RunSpec.from_dict(
        {
            "name": "export-test",
            "model": tiny_model(**model),
            "data": {"seq_len": 32, "batch_size": 4},
            "validator": {"public_keys": [VALIDATOR.public_key_hex], "eval_sequences": 8},
        }
    )
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(spec.to_toml() + local_table_toml({"store": {"url": f"file://{store_dir}"}}))
    store = open_store(f"file://{store_dir}")
    params = {}
    for w in windows:
        theta = trained_like(spec, seed=w + 1)
        publish_checkpoint(
            store,
            layout.run_id(spec.hash()),
            spec.hash(),
            w,
            aggregate=GENESIS if w == 0 else "ab" * 32,
            params=theta,
            identity=signer,
            published_at=PUBLISHED_AT + w,
            launch=GENESIS if w == 0 else "cd" * 32,  # later checkpoints name the genesis they descend from
        )
        params[w] = theta
    store.close()
    return Run(spec, run_toml, store_dir, params)
