"""The command-line flags of the local settings, generated from their fields.

A local setting is declared once, as a field of :class:`protocol.settings.LocalSettings`'s tree
(:func:`protocol.settings.setting`: default, help, and the flag where it is not the field's name).
A command names the settings it takes; :func:`setting_options` turns them into click options (and
``--settings FILE``) and hands the command what was given as one :class:`Overrides`, the top layer
of the precedence order (flag > ``SPARSELOCO_*`` > ``--settings FILE`` > run.toml [local] >
default)::

    @cli.command(epilog=settings_help())
    @click.option("--run", "run_path", required=True)
    @setting_options("store.url", "store.dht_bootstrap", "compute.device")
    def join(run_path: str, overrides: Overrides) -> None:
        local = overrides.load(run_path)       # --store, --dht-peer, --device, --settings

A setting's flag is ``--`` and its field name without a ``_s`` suffix, ``_`` written ``-``
(``peer.join_timeout_s``: ``--join-timeout``) unless its field names another (``store.url``:
``--store``); an array is a repeatable flag; the help of the flag is the field's help followed by
the setting's name and its environment variable (:func:`option_help`).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from protocol.settings import SETTINGS, LocalSettings, env_name, load_settings, setting_field

__all__ = [
    "COMPUTE_FLAGS",
    "OVERRIDES",
    "STORE_FLAGS",
    "Overrides",
    "flag_name",
    "option_help",
    "param_name",
    "setting_options",
]

F = TypeVar("F", bound=Callable[..., Any])
OVERRIDES = "overrides"  # the keyword argument a command decorated with setting_options receives
SETTINGS_FILE_HELP = "Local settings TOML (the keys of run.toml's [local] table)."
# Settings that many commands take as flags: how to reach the store, what to compute on.
STORE_FLAGS = ("store.url", "store.dht_bootstrap")  # --store, --dht-peer
COMPUTE_FLAGS = ("compute.device", "compute.threads")  # --device, --threads


@dataclass(frozen=True)
class Overrides:
    """What a command's setting flags gave: ``flags`` maps setting names to values (None: not
    given), ``settings_path`` is ``--settings FILE`` (None: none)."""

    flags: Mapping[str, Any] = field(default_factory=dict)
    settings_path: str | None = None

    def get(self, name: str) -> Any:
        """The value the flag of setting ``name`` gave, None when it was not given."""
        return self.flags.get(name)

    def load(self, run_path: str | Path | None, *, env: Mapping[str, str] | None = None) -> LocalSettings:
        """The settings of the process: these flags over the environment, ``--settings`` and
        ``run_path``'s [local] table (:func:`protocol.settings.load_settings`)."""
        return load_settings(run_path, settings_path=self.settings_path, env=env, flags=dict(self.flags))


def flag_name(name: str) -> str:
    """The command-line flag of setting ``name``: ``peer.join_timeout_s`` -> ``--join-timeout``."""
    named: str = setting_field(name).metadata["flag"]
    if named:
        return named
    leaf = name.rsplit(".", 1)[-1]
    return "--" + (leaf[: -len("_s")] if leaf.endswith("_s") else leaf).replace("_", "-")


def param_name(name: str) -> str:
    """The click parameter of setting ``name`` (``store.url`` -> ``setting__store__url``)."""
    return "setting__" + name.replace(".", "__")


def option_help(name: str) -> str:
    """The help of setting ``name``'s flag: its field's help, its name and its variable."""
    doc: str = setting_field(name).metadata["help"]
    return f"{doc} [{name}, {env_name(name)}]"


def _option(name: str, required: bool) -> Callable[[F], F]:
    tp = SETTINGS[name]
    help_text = option_help(name)
    if typing.get_origin(tp) is tuple:
        return click.option(flag_name(name), param_name(name), multiple=True, required=required, help=help_text)
    kind = {bool: click.BOOL, int: click.INT, float: click.FLOAT}.get(tp, click.STRING)
    return click.option(flag_name(name), param_name(name), type=kind, default=None, required=required, help=help_text)


def _given(name: str, value: Any) -> Any:
    """A parsed flag's value as a settings override (None: not given; a repeatable flag given
    no time is not given)."""
    if isinstance(value, tuple):
        return list(value) or None
    return value


def setting_options(*names: str, settings_file: bool = True, required: Collection[str] = ()) -> Callable[[F], F]:
    """A decorator for a click command: one option per setting of ``names`` (in that order; those
    in ``required`` must be given), and ``--settings FILE`` unless ``settings_file`` is False. The
    command receives them as one keyword argument ``overrides`` (:class:`Overrides`) instead of
    one parameter each."""
    for name in (*names, *required):
        setting_field(name)  # an unknown name fails at import, not when the command runs

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            path = kwargs.pop("settings_path") if settings_file else None
            flags = {name: _given(name, kwargs.pop(param_name(name))) for name in names}
            return fn(*args, **kwargs, **{OVERRIDES: Overrides(flags, path)})

        for name in reversed(names):
            _option(name, name in required)(command)
        if settings_file:
            click.option(
                "--settings",
                "settings_path",
                default=None,
                type=click.Path(exists=True, dir_okay=False),
                help=SETTINGS_FILE_HELP,
            )(command)
        return cast(F, command)

    return decorate
