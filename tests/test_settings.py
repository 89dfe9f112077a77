"""Local settings: one precedence order over five layers, and nothing local in the run's identity."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from client.cli import main as peer_cli
from client.tools import main as sparseloco
from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.settings import (
    SETTINGS,
    LocalSettings,
    env_name,
    load_settings,
    local_table,
    local_table_toml,
    resolve_settings,
    setting_field,
    settings_help,
)
from protocol.settings_cli import flag_name, option_help, param_name
from validator.cli import cli as validator_cli

# The value each layer gives a setting in the table below (None: the layer does not set it).
VALUES: dict[str, dict[str, Any]] = {
    "store.url": {"run": "file:///run", "file": "file:///file", "env": "file:///env", "flag": "file:///flag"},
    "peer.join_timeout_s": {"run": 10.0, "file": 20.0, "env": 30.0, "flag": 40.0},
    "compute.threads": {"run": 1, "file": 2, "env": 3, "flag": 4},
    "store.dht_bootstrap": {"run": ["/ip4/1"], "file": ["/ip4/2"], "env": ["/ip4/3", "/ip4/33"], "flag": ["/ip4/4"]},
    "poll_interval_s": {"run": 0.5, "file": 0.25, "env": 0.125, "flag": 2.0},
}

# Which layers set the value, and which one wins: flag > env > --settings file > [local] > default.
LAYERS = [
    ((), "default"),
    (("run",), "run"),
    (("file",), "file"),
    (("env",), "env"),
    (("flag",), "flag"),
    (("run", "file"), "file"),
    (("run", "env"), "env"),
    (("file", "env"), "env"),
    (("run", "flag"), "flag"),
    (("env", "flag"), "flag"),
    (("run", "file", "env"), "env"),
    (("run", "file", "env", "flag"), "flag"),
]


def nested(name: str, value: Any) -> dict[str, Any]:
    section, _, key = name.rpartition(".")
    return {section: {key: value}} if section else {key: value}


def env_text(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def get(settings: LocalSettings, name: str) -> Any:
    value: Any = settings
    for part in name.split("."):
        value = getattr(value, part)
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("name", sorted(VALUES))
@pytest.mark.parametrize("given, winner", LAYERS)
def test_precedence_flag_env_file_local_default(name: str, given: tuple[str, ...], winner: str) -> None:
    v = VALUES[name]
    settings = resolve_settings(
        run_local=nested(name, v["run"]) if "run" in given else {},
        settings_file=nested(name, v["file"]) if "file" in given else {},
        env={env_name(name): env_text(v["env"])} if "env" in given else {},
        flags={name: v["flag"] if "flag" in given else None},
    )
    expected = get(LocalSettings(), name) if winner == "default" else v[winner]
    assert get(settings, name) == expected


def test_layers_merge_per_setting_from_files_and_the_environment(tmp_path: Path) -> None:
    """Each setting comes from the highest layer that sets it; the others keep theirs."""
    run = tmp_path / "run.toml"
    local = {
        "poll_interval_s": 0.5,
        "store": {"url": "file:///run", "s3_region": "eu"},
        "data": {"cache_dir": "/cache"},
    }
    run.write_text(RunSpec().to_toml() + local_table_toml(local))
    mine = tmp_path / "mine.toml"
    mine.write_text('[store]\nurl = "file:///mine"\n[compute]\ndevice = "cuda:1"\n')
    env = {"SPARSELOCO_COMPUTE_DEVICE": "cpu", "SPARSELOCO_CACHE": "/not/a/setting", "PATH": "/bin"}
    s = load_settings(run, settings_path=mine, env=env, flags={"store.url": "file:///flag", "compute.threads": None})
    assert (s.poll_interval_s, s.store.s3_region, s.data.cache_dir) == (0.5, "eu", "/cache")  # [local]
    assert s.store.url == "file:///flag" and s.compute.device == "cpu" and s.compute.threads == 0


def test_s3_url_parameters_are_settings_of_their_layer() -> None:
    table = {"store": {"url": "s3://bucket/run", "s3_endpoint": "http://table:1"}}
    flag = resolve_settings(run_local=table, flags={"store.url": "s3://bucket/run?endpoint=http://flag:2&region=r"})
    assert (flag.store.url, flag.store.s3_endpoint, flag.store.s3_region) == ("s3://bucket/run", "http://flag:2", "r")
    in_url = {"store": {"url": "s3://bucket/run?endpoint=http://table:1&profile=p", "s3_endpoint": "http://x:9"}}
    assert resolve_settings(run_local=in_url).store.s3_endpoint == "http://table:1"  # the URL wins in its layer
    env = resolve_settings(run_local=in_url, env={"SPARSELOCO_STORE_S3_ENDPOINT": "http://env:3"})
    assert env.store.s3_endpoint == "http://env:3" and env.store.url == "s3://bucket/run?profile=p"
    assert env.store.location() == "s3://bucket/run?profile=p (endpoint http://env:3)"


@pytest.mark.parametrize(
    "layer, fragment",
    [
        ({"run_local": {"stor": {"url": "x"}}}, "stor"),
        ({"run_local": {"store": {"ur": "x"}}}, "store.ur"),
        ({"settings_file": {"peer": {"timeout": 1}}}, "peer.timeout"),
        ({"env": {"SPARSELOCO_STORE_ULR": "x"}}, "SPARSELOCO_STORE_ULR"),
        ({"env": {"SPARSELOCO_COMPUTE_THREADS": "many"}}, "SPARSELOCO_COMPUTE_THREADS"),
        ({"run_local": {"compute": {"threads": "many"}}}, "compute.threads"),
        ({"flags": {"store.nope": 1}}, "store.nope"),
        ({"run_local": {"poll_interval_s": 0}}, "poll_interval_s"),
        ({"run_local": {"peer": {"max_upload_failures": 0}}}, "max_upload_failures"),
    ],
)
def test_unknown_or_bad_settings_are_errors(layer: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_settings(**layer)


def test_every_setting_has_its_own_variable() -> None:
    assert len({env_name(n) for n in SETTINGS}) == len(SETTINGS)
    assert env_name("store.s3_endpoint") == "SPARSELOCO_STORE_S3_ENDPOINT"
    assert env_name("poll_interval_s") == "SPARSELOCO_POLL_INTERVAL_S"


def test_local_table_is_written_with_its_warning_and_read_back(tmp_path: Path) -> None:
    local = {"max_windows": 3, "store": {"url": "dht://", "dht_bootstrap": ["/ip4/1", "/ip4/2"]}}
    text = RunSpec().to_toml() + local_table_toml(local)
    assert "NOT part of the run's identity" in text
    (tmp_path / "run.toml").write_text(text)
    assert local_table(tmp_path / "run.toml") == local
    (tmp_path / "bad.toml").write_text(RunSpec().to_toml() + "\n[local]\nmax_window = 3\n")
    with pytest.raises(ConfigError, match="max_window"):
        local_table(tmp_path / "bad.toml")


# ---------------------------------------------------------------------- the run's identity
def write_run(path: Path, key: str, local: dict[str, Any], spelled: dict[str, str] | None = None) -> Path:
    """run.toml of the default RunSpec with ``key``, some values spelled differently, and [local]."""
    text = RunSpec().replace(validator={"public_keys": [key]}).to_toml()
    for old, new in (spelled or {}).items():
        assert old in text
        text = text.replace(old, new)
    path.write_text(text + local_table_toml(local))
    return path


def test_the_run_hash_ignores_everything_local(tmp_path: Path) -> None:
    """Two machines' run.toml files that differ only in how they reach the store, where their
    data cache is, how they poll, and how they wrote the validator key and a float: the same run."""
    key = Identity.from_seed(bytes(range(32))).public_key_hex
    mine = write_run(
        tmp_path / "mine.toml",
        key.upper(),
        {"store": {"url": "s3://bucket/run/", "s3_endpoint": "http://localhost:8333"}, "data": {"cache_dir": "/a"}},
        {"lr = 0.001": "lr = 1e-3", "alpha = 1.0": "alpha = 1"},  # the same floats
    )
    theirs = write_run(
        tmp_path / "theirs.toml",
        key,
        {
            "poll_interval_s": 0.2,
            "max_windows": 9,
            "store": {"url": "s3://bucket/run", "s3_endpoint": "http://127.0.0.1:8333", "s3_region": "us-east-1"},
            "data": {"cache_max_bytes": 1 << 30},
            "validator": {"gather_concurrency": 2},
        },
    )
    assert RunSpec.load(mine).hash() == RunSpec.load(theirs).hash()
    runner = CliRunner()
    outs = [runner.invoke(sparseloco, ["run-id", "--json", str(p)]) for p in (mine, theirs)]
    assert [o.exit_code for o in outs] == [0, 0]
    assert json.loads(outs[0].output) == json.loads(outs[1].output)
    assert json.loads(outs[0].output)["run_hash"] == RunSpec.load(mine).hash()
    plain = runner.invoke(sparseloco, ["run-id", str(mine)])
    assert RunSpec.load(mine).hash() in plain.output and "run id" in plain.output


def test_run_id_refuses_a_file_that_does_not_load(tmp_path: Path) -> None:
    (tmp_path / "old.toml").write_text('[storage]\nurl = "s3://bucket/run"\n')
    out = CliRunner().invoke(sparseloco, ["run-id", str(tmp_path / "old.toml")])
    assert out.exit_code == 2 and "[local.store]" in out.output  # where the moved table went


# ---------------------------------------------------------------------- one declaration per setting
def other_value(name: str) -> tuple[str, Any]:
    """A valid value of setting ``name`` other than its default: (environment text, value)."""
    tp, default = SETTINGS[name], get(LocalSettings(), name)
    if tp is bool:
        return ("false", False) if default else ("true", True)
    if tp in (int, float):
        value = default + 2 if tp is int else default * 0.5 + 0.125
        return str(value), value
    if tp is str:
        return "other.pem", "other.pem"
    return "/ip4/1,/ip4/2", ["/ip4/1", "/ip4/2"]  # an array


# Settings valid only with another one: the variable that goes with theirs in the test below.
COMPANIONS = {
    "validator.tls_cert": "SPARSELOCO_VALIDATOR_TLS_KEY",
    "validator.tls_key": "SPARSELOCO_VALIDATOR_TLS_CERT",
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_has_help_and_is_reachable_by_its_variable(name: str) -> None:
    assert setting_field(name).metadata["help"].strip()
    text, value = other_value(name)
    env = {env_name(name): text, **({COMPANIONS[name]: "pair.pem"} if name in COMPANIONS else {})}
    settings = resolve_settings(env=env)
    assert get(settings, name) == value != get(LocalSettings(), name)
    assert name in settings_help() and env_name(name) in settings_help()


def setting_params(command: click.Command) -> dict[str, click.Parameter]:
    """The options of ``command`` generated from settings, by setting name."""
    by_param = {param_name(n): n for n in SETTINGS}
    return {by_param[p.name]: p for p in command.params if p.name in by_param}


@pytest.mark.parametrize(
    "command, expected",
    [
        (peer_cli.commands["join"], {"--store", "--dht-peer", "--device", "--threads", "--join-timeout"}),
        (peer_cli.commands["preflight"], {"--store", "--dht-peer", "--device", "--threads"}),
        (
            validator_cli.commands["run"],
            {"--store", "--dht-peer", "--device", "--threads", "--eval-every", "--eval-sequences", "--grant-port"}
            | {"--grant-host", "--tls-cert", "--tls-key", "--retain-windows", "--retain-checkpoint-every"}
            | {"--max-fetches", "--max-fetch-bytes", "--fetch-timeout", "--max-announcements-per-poll"}
            | {"--max-tracked-peers", "--newcomer-wait"},
        ),
        (validator_cli.commands["gc"], {"--store", "--dht-peer", "--retain-windows", "--retain-checkpoint-every"}),
    ],
)
def test_commands_take_their_setting_flags_from_the_settings(command: click.Command, expected: set[str]) -> None:
    params = setting_params(command)
    assert {flag for p in params.values() for flag in p.opts} == expected
    for name, param in params.items():
        assert isinstance(param, click.Option) and param.opts == [flag_name(name)]
        assert param.help == option_help(name) and param.help.startswith(setting_field(name).metadata["help"])
        assert param.multiple == (typing.get_origin(SETTINGS[name]) is tuple)
    assert "--settings" in {flag for p in command.params for flag in p.opts}


def test_a_budget_reaches_the_validator_from_flag_env_and_settings_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sparseloco-validator run`` builds its validator from the budgets of the local settings."""
    import validator.serve as vserve

    run = tmp_path / "run.toml"
    run.write_text(RunSpec().to_toml() + local_table_toml({"budgets": {"max_tracked_peers": 100}}))
    mine = tmp_path / "mine.toml"
    mine.write_text("[budgets]\nfetch_timeout_s = 2.5\nmax_fetches = 9\n")
    seen: list[LocalSettings] = []

    def opened(run_path: str, local: LocalSettings, *args: object, **options: object) -> None:
        seen.append(local)
        raise ConfigError("stop before opening the store")

    monkeypatch.setattr(vserve, "open_validator", opened)
    monkeypatch.setenv("SPARSELOCO_BUDGETS_MAX_FETCHES", "7")
    monkeypatch.setenv("SPARSELOCO_BUDGETS_NEWCOMER_WAIT", "0.25")
    args = ["run", "--run", str(run), "--settings", str(mine), "--status-json", "--max-fetch-bytes", "4096"]
    out = CliRunner().invoke(validator_cli, args)
    assert out.exit_code == 2 and "stop before opening the store" in out.output
    budgets = seen[0].budgets
    assert (budgets.max_fetches, budgets.newcomer_wait) == (7, 0.25)  # the environment over the file
    assert (budgets.fetch_timeout_s, budgets.max_tracked_peers, budgets.max_fetch_bytes) == (2.5, 100, 4096)
    bad = CliRunner().invoke(validator_cli, [*args, "--max-fetches", "0"])
    assert bad.exit_code == 2 and "budgets.max_fetches must be >= 1" in bad.output and len(seen) == 1
