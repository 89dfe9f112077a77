"""LocalSettings: what one machine decides for itself. Never part of the run's identity.

The RunSpec (:mod:`protocol.config`) is what every participant must agree on; its hash names the
run. Everything else is a *local setting*: how this machine reaches the store (URL, endpoint,
region, DHT bootstrap nodes), where it caches the run's data, how often it polls, which device and
how many threads it uses, when it gives up. Local settings never enter the hash, so a peer that
writes ``127.0.0.1`` where the operator wrote ``localhost`` is still in the operator's run.

One precedence order, highest first, for ``sparseloco-peer join``, ``sparseloco-validator run``
and the processes ``sparseloco demo`` starts::

    1. command-line flags             --store, --dht-peer, --device, --threads …
    2. environment                    SPARSELOCO_STORE_URL, SPARSELOCO_PEER_JOIN_TIMEOUT_S …
    3. a local settings file          --settings PATH (TOML: the same keys as run.toml's [local])
    4. run.toml's [local] table       the operator's suggested defaults
    5. built-in defaults              the dataclasses below

    settings = load_settings("run.toml", settings_path=None, env=os.environ,
                             flags={"store.url": "s3://bucket/run", "compute.device": None})
    settings.store.url, settings.data.cache_dir, settings.peer.join_timeout_s

A setting's name is ``section.field`` (``store.url``) or a top-level ``field``
(``poll_interval_s``); its environment variable is ``SPARSELOCO_`` and the name upper-cased with
``.`` written ``_`` (``SPARSELOCO_STORE_URL``, ``SPARSELOCO_POLL_INTERVAL_S``). A flag value of
None means the flag was not given. Unknown keys (in any table) and unknown ``SPARSELOCO_*``
variables are errors. Environment values are text: arrays are comma-separated, booleans
``true``/``false``/``1``/``0``.

An ``s3://bucket/prefix?endpoint=URL&region=NAME`` store URL carries settings too: its
``endpoint`` and ``region`` become ``store.s3_endpoint`` and ``store.s3_region`` of the layer the
URL was given in, so ``--store s3://…?endpoint=…`` overrides an endpoint in run.toml.

Each component receives only its own subtree: the store opener ``settings.store``
(:func:`protocol.store.open_from_settings`), the data cache ``settings.data``
(:func:`protocol.data.run_data.open_run_dataset`), the validator's window budgets
``settings.budgets`` (:mod:`validator.budgets`), and so on.

A setting is declared once: a field made with :func:`setting` (default, help, and the flag where
it is not derived from the field's name). Its name, type, environment variable, place in the
settings files and ``--help`` line follow from the field, and so do the click options of the
commands that take it (:func:`protocol.settings_cli.setting_options`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from protocol.config import LOCAL_TABLE, from_table, parse_toml, toml_value
from protocol.errors import ConfigError

__all__ = [
    "DEFAULT_EXPECT_WINDOWS",
    "DEFAULT_RESTART_HOLD_S",
    "ENV_PREFIX",
    "BudgetSettings",
    "ComputeSettings",
    "DataSettings",
    "LocalSettings",
    "PeerSettings",
    "StoreSettings",
    "ValidatorSettings",
    "env_name",
    "load_settings",
    "local_table",
    "local_table_toml",
    "resolve_settings",
    "setting",
    "setting_field",
    "settings_help",
]

ENV_PREFIX = "SPARSELOCO_"
# ``validator.expect_windows``: a peer with an upload in one of the last 3 windows is waited for
# (validator/gather.py says why 3).
DEFAULT_EXPECT_WINDOWS = 3
# ``validator.restart_hold_s``: how long a restarted validator holds an empty first window (validator/hold.py).
DEFAULT_RESTART_HOLD_S = 3600.0
# SPARSELOCO_* variables that are not settings: the data cache's default location.
_OTHER_ENV = frozenset({"SPARSELOCO_CACHE"})
# Settings that no longer exist, and what replaced them (named in the error an old file gets).
_REMOVED = {"data.source": "the run's dataset lies in its store, created by `sparseloco-validator init`"}
# s3:// URL parameters that are store settings (the others stay in the URL: protocol.store).
_URL_SETTINGS = {"endpoint": "s3_endpoint", "endpoint_url": "s3_endpoint", "region": "s3_region"}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def setting(default: Any, doc: str, *, flag: str = "") -> Any:
    """A setting's field: its default, its help text ``doc`` (what ``--help`` says of its flag)
    and, where it is not ``--`` + the field name without ``_s`` and with ``-`` for ``_``, its
    command-line ``flag`` (:mod:`protocol.settings_cli`). A section's field takes the section's
    class as ``default``."""
    meta = {"help": doc, "flag": flag}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class StoreSettings:
    """Where this machine finds the run's objects. Credentials are never settings: they come from
    the usual AWS environment and profile chain. A peer with a ``grant_url`` needs none: every
    read and write is a request the validator presigned (:mod:`protocol.store.granted`)."""

    url: str = setting(
        "file://./.sparseloco/store",
        "Store URL: file:///path, s3://bucket/prefix[?endpoint=URL&region=NAME], dht:// or memory://.",
        flag="--store",
    )
    s3_endpoint: str = setting("", "Endpoint of an S3-compatible store other than AWS (R2, MinIO, SeaweedFS).")
    s3_region: str = setting("auto", "Region of the S3 store.")
    dht_bootstrap: tuple[str, ...] = setting(
        (), "DHT bootstrap multiaddr to join a dht:// store through (repeatable).", flag="--dht-peer"
    )
    grant_url: str = setting(
        "",
        "A peer's grant server (http(s)://host:port, the validator's --grant-port): with it the peer needs "
        "no store credential; the validator ignores it. Several, comma-separated (one per validator): the "
        "peer uses the first that answers and moves to the next when it is unreachable or fails (5xx).",
    )
    public_reads: bool = setting(
        False,
        "With a grant server: read the objects anonymously from the store URL (a public-read run prefix) "
        "and ask only for write grants.",
    )

    def __post_init__(self) -> None:
        url, endpoint, region = lift_url_settings(self.url, self.s3_endpoint, self.s3_region)
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "s3_endpoint", endpoint)
        object.__setattr__(self, "s3_region", region)

    def location(self) -> str:
        """The store as people read it in messages: the URL, and the endpoint of an S3 store (and
        the grant server, for a peer that has one)."""
        where = self.url
        if self.url.lower().startswith("s3://") and self.s3_endpoint:
            where = f"{self.url} (endpoint {self.s3_endpoint})"
        if self.grant_url:
            where += f" via grants from {self.grant_url}" + (" (public reads)" if self.public_reads else "")
        return where


@dataclass(frozen=True)
class DataSettings:
    """This machine's copy of the run's data. The dataset itself lies in the run's store (the
    RunSpec's ``data.dataset``); a process fetches the blocks its batches read and keeps them,
    verified, in the cache, the least recently used going first once they would exceed its cap."""

    cache_dir: str = setting("", "Data cache directory ('': $SPARSELOCO_CACHE or ~/.cache/sparseloco).")
    cache_max_bytes: int = setting(16 << 30, "Size cap of the data cache in bytes (0: no cap).")

    def __post_init__(self) -> None:
        _require(self.cache_max_bytes >= 0, "data.cache_max_bytes must be >= 0")


@dataclass(frozen=True)
class ComputeSettings:
    """How this machine computes (:mod:`client.memory` picks an automatic micro batch)."""

    device: str = setting(
        "", "Torch device: cuda, cpu, cuda:1 … ('': a peer uses CUDA when torch sees it, the validator the CPU)."
    )
    threads: int = setting(0, "Torch CPU threads (0: torch's default).")
    micro_batch_size: int = setting(
        0,
        "Sequences per forward/backward pass, gradients accumulated over an inner step's batch (0: automatic, "
        "the whole batch on a CPU, the most that fit the free memory on CUDA).",
    )
    rank_timeout_s: float = setting(
        300.0,
        "A peer on several GPUs (torchrun): seconds one collective between its processes may take before "
        "the peer stops.",
    )

    def __post_init__(self) -> None:
        _require(self.threads >= 0, "compute.threads must be >= 0")
        _require(self.micro_batch_size >= 0, "compute.micro_batch_size must be >= 0")
        _require(self.rank_timeout_s > 0, "compute.rank_timeout_s must be > 0")


@dataclass(frozen=True)
class PeerSettings:
    """How a peer waits, gives up and saves (client/state.py: e is written with every
    contribution, the moments also when the peer stops; a restart resumes the last write)."""

    join_timeout_s: float = setting(300.0, "Seconds `join` waits for the run's genesis checkpoint.")
    max_upload_failures: int = setting(
        3, "Consecutive windows whose contribution the store refused before the peer stops."
    )
    moments_every: int = setting(
        10, "Windows between two writes of the inner optimizer's moments to the state directory."
    )

    def __post_init__(self) -> None:
        _require(self.join_timeout_s > 0, "peer.join_timeout_s must be > 0")
        _require(self.max_upload_failures >= 1, "peer.max_upload_failures must be >= 1")
        _require(self.moments_every >= 1, "peer.moments_every must be >= 1")


@dataclass(frozen=True)
class ValidatorSettings:
    """How the validator gathers, evaluates, serves grants (:mod:`validator.grant_server`) and
    deletes what the run no longer needs (:mod:`validator.retention`)."""

    gather_concurrency: int = setting(16, "Contributions fetched (and checked) at once while gathering a window.")
    workers: int = setting(0, "Threads that decode, clip and sum a gathered window's contributions (0: one per core).")
    eval_every: int = setting(
        0, "Evaluate θ (loss, perplexity, bits per byte) every N windows into the log (0: never)."
    )
    eval_sequences: int = setting(256, "Validation sequences per periodic evaluation.")
    grant_port: int = setting(
        0,
        "Serve grants on this port: peers need no store credential, only store.grant_url (0: no grant "
        "server; needs an s3:// store).",
    )
    grant_host: str = setting("0.0.0.0", "Address the grant server binds.")
    tls_cert: str = setting("", "PEM certificate: serve grants over HTTPS (with tls_key).")
    tls_key: str = setting("", "PEM private key of tls_cert.")
    grant_prefix_v4: int = setting(
        24, "The grant server's rate limits count all IPv4 addresses of one /N network together."
    )
    grant_prefix_v6: int = setting(
        48, "The grant server's rate limits count all IPv6 addresses of one /N network together."
    )
    retain_windows: int = setting(
        0,
        "After each publish, delete contributions and aggregates older than the last K windows, keeping "
        "what joiners need (0: keep everything, K >= 2).",
    )
    retain_checkpoint_every: int = setting(
        0, "With retain_windows: also keep every M-th checkpoint (0: only those catch-up needs)."
    )
    expect_windows: int = setting(
        DEFAULT_EXPECT_WINDOWS,
        "A peer that uploaded in one of the last G windows is waited for (until the deadline) in the next; "
        "a peer gone without withdrawing costs at most G windows their full deadline.",
    )
    restart_hold_s: float = setting(
        DEFAULT_RESTART_HOLD_S,
        "After a restart, a first window nobody uploaded to is held, unpublished, until a peer is heard from "
        "(announces, rejoins, asks for a grant), at most this long (0: publish it empty at once).",
    )
    window_retries: int = setting(
        10,
        "Consecutive store failures of one window before the validator gives up on it (exit status 1); "
        "the waits double from poll_interval_s up to 60 s (243 s in all at the defaults).",
    )

    def __post_init__(self) -> None:
        _require(self.gather_concurrency >= 1, "validator.gather_concurrency must be >= 1")
        _require(self.workers >= 0, "validator.workers must be >= 0")
        _require(self.eval_every >= 0, "validator.eval_every must be >= 0")
        _require(self.eval_sequences >= 1, "validator.eval_sequences must be >= 1")
        _require(0 <= self.grant_port <= 65535, "validator.grant_port must be in 0..65535")
        _require(bool(self.tls_cert) == bool(self.tls_key), "validator.tls_cert and validator.tls_key go together")
        _require(8 <= self.grant_prefix_v4 <= 32, "validator.grant_prefix_v4 must be in 8..32")
        _require(16 <= self.grant_prefix_v6 <= 128, "validator.grant_prefix_v6 must be in 16..128")
        _require(
            self.retain_windows == 0 or self.retain_windows >= 2,
            "validator.retain_windows must be 0 (keep everything) or >= 2",
        )
        _require(self.retain_checkpoint_every >= 0, "validator.retain_checkpoint_every must be >= 0")
        _require(self.window_retries >= 1, "validator.window_retries must be >= 1")
        _require(1 <= self.expect_windows <= 64, "validator.expect_windows must be in 1..64")
        _require(
            math.isfinite(self.restart_hold_s) and self.restart_hold_s >= 0, "validator.restart_hold_s must be >= 0"
        )


@dataclass(frozen=True)
class BudgetSettings:
    """What one validator spends on a window (:mod:`validator.budgets` says why): anyone can list
    keys, announce identities and upload bytes at no cost, so these caps bound what that costs."""

    max_fetches: int = setting(256, "Contributions read per window, highest reputation first (the rest: over_budget).")
    max_fetch_bytes: int = setting(8 << 30, "Bytes of contributions read per window.")
    fetch_timeout_s: float = setting(30.0, "Seconds reads listed before the window closed may still take.")
    max_announcements_per_poll: int = setting(64, "New peer announcements read per poll.")
    max_tracked_peers: int = setting(4096, "Peer identities tracked at most.")
    newcomer_wait: float = setting(
        0.5, "Fraction of the upload deadline that identities without uploads keep a window open (0..1)."
    )

    def __post_init__(self) -> None:
        for name in ("max_fetches", "max_fetch_bytes", "max_announcements_per_poll", "max_tracked_peers"):
            _require(getattr(self, name) >= 1, f"budgets.{name} must be >= 1")
        _require(self.fetch_timeout_s > 0, "budgets.fetch_timeout_s must be > 0")
        _require(0.0 <= self.newcomer_wait <= 1.0, "budgets.newcomer_wait must be in [0, 1]")


@dataclass(frozen=True)
class LocalSettings:
    """Every local setting (see the module docstring)."""

    poll_interval_s: float = setting(1.0, "Seconds between two looks for new objects.")
    max_windows: int = setting(0, "Stop once the run reaches this window (0: never).")
    store: StoreSettings = setting(StoreSettings, "Where this machine finds the run's objects.")
    data: DataSettings = setting(DataSettings, "This machine's copy of the run's data.")
    compute: ComputeSettings = setting(ComputeSettings, "How this machine computes.")
    peer: PeerSettings = setting(PeerSettings, "A peer's timeouts and saves.")
    validator: ValidatorSettings = setting(ValidatorSettings, "The validator's work and services.")
    budgets: BudgetSettings = setting(BudgetSettings, "What one validator spends on a window.")

    def __post_init__(self) -> None:
        _require(self.poll_interval_s > 0, "poll_interval_s must be > 0")
        _require(self.max_windows >= 0, "max_windows must be >= 0")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str = "[local]") -> LocalSettings:
        return from_table(cls, raw, table=where)

    def to_dict(self) -> dict[str, Any]:
        plain: dict[str, Any] = _plain(self)
        return plain


# ---------------------------------------------------------------------- names
def _names(cls: type[Any] = LocalSettings, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """(dotted name, type, field) of every setting below ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _names(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, tp, f


SETTINGS: dict[str, Any] = {name: tp for name, tp, _ in _names()}  # dotted name -> type
_FIELDS: dict[str, dataclasses.Field[Any]] = {name: f for name, _, f in _names()}


def setting_field(name: str) -> dataclasses.Field[Any]:
    """The dataclass field of setting ``name`` (``store.url``): its default and metadata (help, flag)."""
    if name not in _FIELDS:
        raise ConfigError(f"unknown setting {name!r}")
    return _FIELDS[name]


def env_name(name: str) -> str:
    """The environment variable of setting ``name``: ``store.url`` -> ``SPARSELOCO_STORE_URL``."""
    return ENV_PREFIX + name.replace(".", "_").upper()


_BY_ENV = {env_name(n): n for n in SETTINGS}
if len(_BY_ENV) != len(SETTINGS):  # pragma: no cover - a section and a field whose names collide
    raise AssertionError("two settings share an environment variable")


# ---------------------------------------------------------------------- layers
def resolve_settings(
    *,
    run_local: Mapping[str, Any] | None = None,
    settings_file: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> LocalSettings:
    """Merge the layers, highest last in the argument list wins: ``flags`` > ``env`` >
    ``settings_file`` > ``run_local`` (run.toml's [local]) > the defaults.

    ``run_local`` and ``settings_file`` are nested tables as in TOML; ``env`` holds environment
    variables (only ``SPARSELOCO_*`` ones are read); ``flags`` maps dotted names to values, None
    for a flag that was not given.
    """
    layers = [
        _layer(run_local or {}, "run.toml [local]"),
        _layer(settings_file or {}, "the settings file"),
        _layer(_env_layer(env or {}), "the environment"),
        _layer(_flag_layer(flags or {}), "the command line"),
    ]
    merged: dict[str, Any] = {}
    for layer in layers:
        _merge(merged, layer)
    return LocalSettings.from_dict(merged, where="local settings")


def load_settings(
    run_path: str | Path | None,
    *,
    settings_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> LocalSettings:
    """The settings of a process started with ``run_path`` (its [local] table), an optional
    ``--settings`` file, the environment (``os.environ`` when None) and its flags."""
    run_local = local_table(run_path) if run_path is not None else {}
    file_layer = _read_toml(settings_path, "settings file") if settings_path is not None else {}
    return resolve_settings(
        run_local=run_local,
        settings_file=file_layer,
        env=os.environ if env is None else env,
        flags=flags,
    )


def local_table(run_path: str | Path) -> dict[str, Any]:
    """run.toml's ``[local]`` table (empty when it has none), checked for unknown keys."""
    raw = _read_toml(run_path, "RunSpec file").get(LOCAL_TABLE, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"[{LOCAL_TABLE}] in {run_path} must be a table")
    LocalSettings.from_dict(_layer(raw, "run.toml [local]"))  # unknown keys and bad values fail here
    return raw


def _read_toml(path: str | Path, what: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} not found: {p}")
    try:
        return parse_toml(p.read_text())
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from exc


def _layer(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A copy of one layer with its keys checked and an s3 URL's settings lifted out of it."""
    sections = {name.split(".")[0] for name in SETTINGS if "." in name}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in sections:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} in {where} must be a table")
            known = {n.split(".", 1)[1] for n in SETTINGS if n.startswith(key + ".")}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigError(
                    f"unknown key(s) in {where}: {', '.join(_removed_hint(f'{key}.{k}') for k in unknown)}"
                )
            out[key] = dict(value)
        elif key in SETTINGS:
            out[key] = value
        else:
            raise ConfigError(f"unknown key in {where}: {key}")
    store = out.get("store")
    if store is not None and isinstance(store.get("url"), str):
        url, endpoint, region = lift_url_settings(store["url"], store.get("s3_endpoint"), store.get("s3_region"))
        store["url"] = url
        if endpoint is not None:
            store["s3_endpoint"] = endpoint
        if region is not None:
            store["s3_region"] = region
    return out


def _removed_hint(name: str) -> str:
    return f"{name} (no longer a setting: {_REMOVED[name]})" if name in _REMOVED else name


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var in _OTHER_ENV:
            continue
        name = _BY_ENV.get(var)
        if name is None:
            removed = [n for n in _REMOVED if env_name(n) == var]
            if removed:
                raise ConfigError(f"{var} is no longer a setting: {_REMOVED[removed[0]]}")
            raise ConfigError(f"unknown setting in the environment: {var} (known: {', '.join(sorted(_BY_ENV))})")
        flat[name] = _from_text(SETTINGS[name], text, var)
    return _nest(flat)


def _flag_layer(flags: Mapping[str, Any]) -> dict[str, Any]:
    for name in flags:
        if name not in SETTINGS:
            raise ConfigError(f"unknown setting {name!r}")
    return _nest({k: v for k, v in flags.items() if v is not None})


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        if "." in name:
            section, key = name.split(".", 1)
            out.setdefault(section, {})[key] = value
        else:
            out[name] = value
    return out


def _merge(into: dict[str, Any], layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, Mapping):
            into.setdefault(key, {}).update(value)
        else:
            into[key] = value


def _from_text(tp: Any, text: str, where: str) -> Any:
    """An environment variable's text as a value of type ``tp``."""
    try:
        if tp is bool:
            low = text.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return low in ("1", "true", "yes")
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where} must be a {tp.__name__}, got {text!r}") from None
    if typing.get_origin(tp) is tuple:
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def lift_url_settings(url: str, endpoint: str | None, region: str | None) -> tuple[str, str | None, str | None]:
    """(url, endpoint, region) with an ``s3://`` URL's ``endpoint``/``region`` parameters moved out
    of the URL; they win over ``endpoint``/``region`` given with it (the same layer)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "s3" or not parts.query:
        return url, endpoint, region
    kept = []
    for name, value in parse_qsl(parts.query, keep_blank_values=False):
        target = _URL_SETTINGS.get(name)
        if target == "s3_endpoint":
            endpoint = value
        elif target == "s3_region":
            region = value
        else:
            kept.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), endpoint, region


# ---------------------------------------------------------------------- writing and help
def local_table_toml(raw: Mapping[str, Any]) -> str:
    """``raw`` (a nested [local] table) as run.toml text, headed by a comment that says it is not
    part of the run's identity."""
    checked = _layer(raw, "the [local] table")
    LocalSettings.from_dict(checked)
    lines = [
        "",
        "# Local settings: NOT part of the run's identity (never hashed). The operator's suggested",
        "# defaults for every participant's machine; each one may override any of them with",
        "# --settings FILE, SPARSELOCO_* environment variables or command-line flags.",
        f"[{LOCAL_TABLE}]",
    ]
    lines += [f"{k} = {toml_value(_plain(v))}" for k, v in checked.items() if not isinstance(v, Mapping)]
    for section, table in checked.items():
        if isinstance(table, Mapping):
            lines.append(f"\n[{LOCAL_TABLE}.{section}]")
            lines += [f"{k} = {toml_value(_plain(v))}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def settings_help() -> str:
    """The precedence order and every setting with its variable, for ``--help`` (click keeps the
    ``\\b`` blocks as written)."""
    lines = [
        "\b",
        "Local settings (never part of the run's identity), highest first:",
        "  flag > SPARSELOCO_* environment > --settings FILE > run.toml [local] > default",
        "",
        "\b",
    ]
    defaults = _flat(LocalSettings().to_dict())
    width = max(len(n) for n in SETTINGS)
    for name in SETTINGS:
        lines.append(f"  {name:<{width}}  {env_name(name):<{width + len(ENV_PREFIX)}}  [{defaults[name]!r}]")
    return "\n".join(lines)


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_plain(v) for v in obj]
    return obj
