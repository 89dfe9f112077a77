"""A run's signed checkpoints, seen from the user's side: list them, name one, read it verified.

A checkpoint manifest names its run only by the RunSpec hash, so the RunSpec (``run.toml``) is
always given: it holds the model's shape, the tokenizer and the validator keys that must have
signed the manifest. Which checkpoint is then named by a location and a window::

    spec = RunSpec.load("run.toml")
    loc = locate(spec, "RUN/store/ab12…/checkpoint/00000004")     # a checkpoint folder or its manifest
    loc = locate(spec, "s3://bucket/prefix", window="latest")       # a store URL, newest checkpoint
    loc = locate(spec, None, window=4, settings=local.store)        # the store of the local settings
    ckpt = load_checkpoint(spec, loc)          # every file checked against the signed manifest,
    ckpt.params, ckpt.window, ckpt.signer      # θ against its fingerprint (protocol.chain)
    model = model_of(spec, ckpt, "cuda")       # protocol.model.Transformer holding θ, eval mode
    for info in list_checkpoints(spec, store): ...                  # ``sparseloco checkpoints``

A location inside a store's layout (``<root>/<run>/checkpoint/<window>[/manifest]``, as a local
path, a ``file://`` or an ``s3://`` URL) names both the store (``<root>``) and the window.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from protocol import layout
from protocol.chain import read_weights
from protocol.config import RunSpec
from protocol.errors import ConfigError, ObjectNotFound, ProtocolError, Uncertified
from protocol.identity import Identity, peer_id_of
from protocol.model import Transformer
from protocol.replay import Chain
from protocol.settings import StoreSettings
from protocol.store.base import ObjectStore
from protocol.wire import CheckpointManifest, Verified

__all__ = [
    "Checkpoint",
    "CheckpointInfo",
    "Location",
    "checkpoint_windows",
    "list_checkpoints",
    "load_checkpoint",
    "locate",
    "model_of",
    "open_location",
    "parse_window",
    "read_signed_manifest",
]

LATEST = "latest"
_WINDOW_SEGMENT = re.compile(r"^[0-9]{8}$")


@dataclass(frozen=True)
class Location:
    """Where a checkpoint is: a store URL and a window (None: the newest checkpoint there)."""

    store_url: str
    window: int | None
    dht_peers: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointInfo:
    """One listed checkpoint; ``error`` says why it does not verify (the other fields are then empty)."""

    window: int
    size: int | None = None  # bytes of its files
    signed_by: str | None = None  # hex public key of the signer (one of validator.public_keys)
    signer_peer_id: str | None = None
    fingerprint: str | None = None  # sha256 of θ (protocol.model.fingerprint)
    published_at: float | None = None  # when window ``window`` opened
    aggregate: str | None = None  # digest of the aggregate θ results from (GENESIS at window 0)
    error: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """θ of a verified checkpoint (float32, CPU) with what its signed manifest says."""

    manifest: CheckpointManifest
    params: dict[str, Tensor]
    signer: str  # hex public key
    store_url: str

    @property
    def window(self) -> int:
        return self.manifest.window


def parse_window(text: str | int | None) -> int | None:
    """``"latest"`` or None -> None; a window number -> that number (ConfigError otherwise)."""
    if text is None or text == LATEST:
        return None
    try:
        window = int(text)
    except ValueError:
        raise ConfigError(f"window must be a number or 'latest', got {text!r}") from None
    if window < 0:
        raise ConfigError(f"window must be >= 0, got {window}")
    return window


def locate(
    spec: RunSpec,
    checkpoint: str | None,
    *,
    store_url: str | None = None,
    window: str | int | None = None,
    dht_peers: Sequence[str] = (),
    settings: StoreSettings | None = None,
) -> Location:
    """The checkpoint that ``checkpoint`` (a path, a URL or None), ``--store`` and ``--window`` name.

    ``checkpoint`` inside a store's checkpoint layout fixes the store and the window; a store URL
    or a local store directory fixes the store; None leaves ``store_url`` or else the store of the
    local ``settings`` (run.toml's ``[local]`` table, the environment, ``--settings``). ``window`` picks among the store's checkpoints (``latest`` or None: the newest).
    Naming a store or a window twice, differently, is a ConfigError.
    """
    wanted = parse_window(window)
    if checkpoint is None:
        default = (settings or StoreSettings()).url
        return Location(store_url or default, wanted, tuple(dht_peers))
    if store_url is not None:
        raise ConfigError("give either CHECKPOINT or --store, not both")
    url = checkpoint if "://" in checkpoint else _local_url(checkpoint)
    root, run, at = _split_checkpoint_url(url)
    if run is not None and run != layout.run_id(spec.hash()):
        raise ConfigError(f"{checkpoint} belongs to run {run}; run.toml describes run {layout.run_id(spec.hash())}")
    if at is not None and wanted is not None and at != wanted:
        raise ConfigError(f"{checkpoint} is the checkpoint of window {at}, --window says {wanted}")
    return Location(root, at if at is not None else wanted, tuple(dht_peers))


def _local_url(path: str) -> str:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"no such file or directory: {path}")
    return f"file://{p.resolve()}"


def _split_checkpoint_url(url: str) -> tuple[str, str | None, int | None]:
    """(store URL, run, window) of a URL that may point into ``<run>/checkpoint/<window>[/manifest]``."""
    base, sep, query = url.partition("?")
    scheme, _, rest = base.partition("://")
    parts = rest.rstrip("/").split("/")
    if parts and parts[-1] == layout.CHECKPOINT_MANIFEST:
        parts = parts[:-1]
    if len(parts) >= 4 and parts[-2] == "checkpoint" and _WINDOW_SEGMENT.match(parts[-1]):
        root = "/".join(parts[:-3])
        return f"{scheme}://{root}{sep}{query}", parts[-3], layout.parse_window(parts[-1])
    return url, None, None


def open_location(
    loc: Location,
    settings: StoreSettings | None = None,
    *,
    identity: Identity | None = None,
    spec: RunSpec | None = None,
) -> ObjectStore:
    """The store of ``loc``, opened with the local store ``settings`` (S3 endpoint, region, DHT
    bootstrap …); an endpoint or region in the location's URL wins. With ``identity`` and ``spec``,
    the run's own store (``settings.url``) opens as a peer opens it: through ``store.grant_url``
    when set (:func:`client.store_access.open_run_store`)."""
    from client.store_access import open_run_store

    return open_run_store(settings or StoreSettings(), identity, spec, loc.store_url, loc.dht_peers)


def checkpoint_windows(spec: RunSpec, store: ObjectStore) -> list[int]:
    """Windows that have a checkpoint manifest in ``store``, ascending (listed, not yet verified)."""
    return Chain(spec, store).checkpoint_windows()


def read_signed_manifest(spec: RunSpec, store: ObjectStore, window: int) -> Verified[CheckpointManifest]:
    """The manifest of ``window``, signed by one of the RunSpec's validator keys for this run."""
    return Chain(spec, store).manifest(window)


def list_checkpoints(spec: RunSpec, store: ObjectStore) -> list[CheckpointInfo]:
    """Every checkpoint of the run in ``store`` with its signed facts; manifests that do not verify
    are listed with the reason (their weights are not read)."""
    out = []
    for window in checkpoint_windows(spec, store):
        try:
            v = read_signed_manifest(spec, store, window)
        except ProtocolError as exc:
            out.append(CheckpointInfo(window, error=str(exc)))
            continue
        m = v.value
        out.append(
            CheckpointInfo(
                window,
                size=sum(f.size for f in m.files),
                signed_by=v.public_key.hex(),
                signer_peer_id=peer_id_of(v.public_key),
                fingerprint=m.fingerprint,
                published_at=m.published_at,
                aggregate=m.aggregate,
            )
        )
    return out


def load_checkpoint(
    spec: RunSpec, loc: Location, settings: StoreSettings | None = None, *, identity: Identity | None = None
) -> Checkpoint:
    """θ of the checkpoint ``loc`` names, verified: the manifest's signer is one of the RunSpec's
    validator keys, every file has the signed size and sha256, θ has the signed fingerprint and
    exactly the RunSpec's parameter shapes. Raises ConfigError when there is no such checkpoint
    and a :class:`ProtocolError` when it does not verify. ``settings``, ``identity``: see
    :func:`open_location`."""
    store = open_location(loc, settings, identity=identity, spec=spec)
    try:
        chain = Chain(spec, store)
        if loc.window is None:
            v = _newest_usable(chain, loc.store_url)
        else:
            try:
                v = chain.manifest(loc.window)
            except ObjectNotFound:
                raise ConfigError(f"no checkpoint of window {loc.window} in {loc.store_url}") from None
        params = read_weights(store, v.value, schema=chain.schema)  # what the store holds, even at window 0
        return Checkpoint(v.value, params, v.public_key.hex(), loc.store_url)
    finally:
        store.close()


def _newest_usable(chain: Chain, url: str) -> Verified[CheckpointManifest]:
    """The newest checkpoint's manifest, or with several validators the newest a certificate vouches
    for (an uncertified one counts as absent, :meth:`protocol.replay.Chain.manifest`)."""
    windows = chain.checkpoint_windows()
    if not windows:
        raise ConfigError(f"no checkpoint of run {chain.run} in {url}")
    for window in reversed(windows):
        try:
            return chain.manifest(window)
        except ObjectNotFound:
            raise ConfigError(f"no checkpoint of window {window} in {url}") from None
        except Uncertified:
            continue
    raise ConfigError(f"no checkpoint of run {chain.run} in {url} that a certificate vouches for")


def model_of(spec: RunSpec, ckpt: Checkpoint, device: str | torch.device = "cpu") -> Transformer:
    """The run's model holding θ of ``ckpt``, in eval mode on ``device``."""
    with torch.device("cpu"):
        model = Transformer(spec.model)  # θ replaces the initial weights: no need for build_model's θ₀
    model.load_state_dict(ckpt.params, strict=True)
    return model.to(device).eval()
