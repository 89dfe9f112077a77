"""RunSpec: TOML round trip, hashing, strictness."""

from __future__ import annotations

import pytest

from protocol.config import MODEL_PRESETS, RunSpec, model_config
from protocol.errors import ConfigError


def test_toml_round_trip_keeps_hash() -> None:
    spec = RunSpec.default().replace(inner={"steps": 30}, model={"preset": "small"})
    again = RunSpec.loads(spec.to_toml())
    assert again == spec
    assert again.hash() == spec.hash()


def test_hash_changes_with_any_field() -> None:
    base = RunSpec.default()
    assert base.replace(codec={"k": 128}).hash() != base.hash()
    assert base.replace(outer={"beta": 0.8}).hash() != base.hash()
    assert base.replace(name="other").hash() != base.hash()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[modle]\ndim = 3\n", "modle"),
        ("[codec]\ntopk = 3\n", "codec.topk"),
        ("[codec]\nk = 'many'\n", "codec.k"),
        ("[codec]\nvalue_bits = 3\n", "value_bits"),
        ("[codec]\nvalue_bits = 8\n", "value_bits"),  # 2-bit codes are the only value mode
        ("[model]\npreset = 'huge'\n", "preset"),
        ("[inner]\nbetas = [0.9]\n", "inner.betas"),
        ("name = = 1\n", "does not parse"),
    ],
)
def test_bad_specs_raise_config_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RunSpec.loads(text)


def test_presets_expand_and_allow_overrides() -> None:
    spec = RunSpec.loads("[model]\npreset = '512m'\nmax_seq_len = 512\n")
    assert spec.model.dim == MODEL_PRESETS["512m"]["dim"] == 1536
    assert spec.model.max_seq_len == 512
    assert model_config("tiny").dim == MODEL_PRESETS["tiny"]["dim"]


def test_load_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        RunSpec.load(tmp_path / "nope.toml")


def test_hash_is_taken_over_normalised_values() -> None:
    """Key case, order and duplicates, and ints written for floats, do not make another run."""
    a, b = "ab" * 32, "cd" * 32
    one = RunSpec.default().replace(validator={"public_keys": [a, b]}, outer={"alpha": 1.0})
    two = RunSpec.default().replace(validator={"public_keys": [b.upper(), a, a]}, outer={"alpha": 1})
    assert two.validator.public_keys == (a, b) and two.outer.alpha == 1.0
    assert one.hash() == two.hash()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[validator]\npublic_keys = ['abc']\n", "public_keys"),
        ("[inner]\nlr = nan\n", "finite"),
        ("[storage]\nurl = 'file:///x'\n", r"\[local.store\]"),
        ("[data]\nsource = 'x'\n", r"data.source .*sparseloco-validator init"),
        ("[windows]\npoll_interval_s = 1.0\n", r"\[local\] poll_interval_s"),
        ("[validator]\nannouncement_ttl_s = 1.0\n", "announcement_ttl_s"),
    ],
)
def test_bad_values_and_moved_keys_are_named(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RunSpec.loads(text)


def test_the_local_table_is_not_part_of_the_runspec() -> None:
    base = RunSpec.default().to_toml()
    local = "\n[local]\npoll_interval_s = 0.5\n[local.store]\nurl = 's3://b/r'\n"
    assert RunSpec.loads(base + local) == RunSpec.loads(base)
