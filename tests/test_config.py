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
        ("[validator]\neval_confidence_z = -1.0\n", "eval_confidence_z"),
        ("[validator]\neval_confidence_z = inf\n", "eval_confidence_z"),
        ("[validator]\ncopy_overlap_lower = 1.5\n", "copy_overlap_lower"),
        ("[validator]\ncopy_rare_lower = -0.1\n", "copy_rare_lower"),
        ("[validator]\nreference_epoch_factor = 0.5\n", "reference_epoch_factor"),
        ("[validator]\nreference_horizon = 0\n", "reference_horizon"),
        ("[validator]\nreference_seniority = -1\n", "reference_seniority"),
        ("[validator]\nprobation_partial = 2.0\n", "probation_partial"),
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


def test_top_k_warm_up_falls_linearly_to_the_codec_k() -> None:
    spec = RunSpec.default().replace(codec={"k": 64}, outer={"warmup_k": 512, "warmup_windows": 4})
    assert spec == RunSpec.default()  # the default: 512 falling to 64 over 4 windows
    assert [spec.outer.k_at(w, 64) for w in range(7)] == [512, 400, 288, 176, 64, 64, 64]
    assert [spec.codec_at(w).k for w in range(6)] == [512, 400, 288, 176, 64, 64]
    assert spec.codec_at(4) == spec.codec and spec.codec_at(10**6) == spec.codec
    # Only k changes: the window's codec is what contributions carry and the validator checks.
    assert spec.codec_at(0) == spec.codec.__class__(**{**spec.to_dict()["codec"], "k": 512})
    assert spec.outer.max_k(64) == 512
    # A function of the RunSpec and the window only: a reloaded spec gives the same codecs.
    again = RunSpec.loads(spec.to_toml())
    assert [again.codec_at(w) for w in range(6)] == [spec.codec_at(w) for w in range(6)]
    assert again.hash() == spec.hash() != RunSpec.default().replace(outer={"warmup_k": 0}).hash()


def test_without_a_warm_up_every_window_has_the_codec_k() -> None:
    spec = RunSpec.default().replace(outer={"warmup_k": 0})
    assert spec.outer.warmup_windows == 4  # ignored: warmup_k = 0 turns the warm-up off
    assert all(spec.codec_at(w) is spec.codec for w in range(5))
    assert spec.outer.max_k(spec.codec.k) == spec.codec.k
    off = RunSpec.default().replace(outer={"warmup_k": 0, "warmup_windows": 0})
    assert all(off.codec_at(w) is off.codec for w in range(5))
    # A warm-up below k ramps k up instead; it is still exact integers.
    up = spec.replace(codec={"k": 64}, outer={"warmup_k": 16, "warmup_windows": 3})
    assert [up.codec_at(w).k for w in range(4)] == [16, 32, 48, 64]


@pytest.mark.parametrize(
    "outer, fragment",
    [
        ({"warmup_k": 5000, "warmup_windows": 2}, "outer.warmup_k"),
        ({"warmup_k": -1, "warmup_windows": 2}, "outer.warmup_k"),
        ({"warmup_k": 256, "warmup_windows": 0}, "outer.warmup_windows"),
        ({"warmup_windows": 0}, "outer.warmup_windows"),  # the default warmup_k needs windows
        ({"warmup_windows": -1}, "outer.warmup_windows"),
    ],
)
def test_bad_top_k_warm_ups_are_refused(outer: dict[str, int], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RunSpec.default().replace(outer=outer)


# ------------------------------------------------------------------------------ several validators
def _keys(n: int) -> list[str]:
    return [f"{i + 1:02x}" * 32 for i in range(n)]


def test_one_validator_needs_its_own_signature_and_the_run_is_unchanged() -> None:
    one = RunSpec.default().replace(validator={"public_keys": _keys(1)})
    assert one.validator.quorum == 0 and one.validator.signing_quorum == 1 and one.validator.handover_s == 0.0
    assert RunSpec.default().validator.signing_quorum == 1  # no keys yet: a majority of nothing is 1
    # the defaults are part of the run: writing them out changes neither the spec nor its hash
    explicit = RunSpec.loads(one.to_toml())
    assert explicit == one and explicit.hash() == one.hash()
    assert one.replace(validator={"quorum": 1}).validator.signing_quorum == 1


@pytest.mark.parametrize("n, quorum, m", [(2, 0, 2), (3, 0, 2), (3, 2, 2), (3, 3, 3), (4, 0, 3), (4, 4, 4), (7, 0, 4)])
def test_the_signing_quorum_is_the_configured_one_or_a_majority(n: int, quorum: int, m: int) -> None:
    spec = RunSpec.default().replace(validator={"public_keys": _keys(n), "quorum": quorum})
    assert spec.validator.signing_quorum == m


@pytest.mark.parametrize(
    "n, quorum, fragments",
    [
        (4, 2, ["unsafe", "2 of 4", "at least 3"]),  # two disjoint pairs could each sign a window
        (2, 1, ["unsafe", "at least 2"]),
        (6, 3, ["unsafe", "at least 4"]),
        (4, 5, ["validator.quorum = 5", "4 keys"]),  # more signatures than there are keys
        (1, 2, ["validator.quorum = 2", "1 keys"]),
        (3, -1, ["validator.quorum must be >= 0"]),
    ],
)
def test_unsafe_or_impossible_quorums_are_refused(n: int, quorum: int, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        RunSpec.default().replace(validator={"public_keys": _keys(n), "quorum": quorum})
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("handover", [-1.0, float("nan"), float("inf")])
def test_bad_handover_timeouts_are_refused(handover: float) -> None:
    with pytest.raises(ConfigError, match="validator.handover_s"):
        RunSpec.default().replace(validator={"public_keys": _keys(3), "handover_s": handover})


def test_quorum_and_handover_are_part_of_the_run() -> None:
    base = RunSpec.default().replace(validator={"public_keys": _keys(4)})
    assert base.replace(validator={"quorum": 4}).hash() != base.hash()
    assert base.replace(validator={"handover_s": 30.0}).hash() != base.hash()
    again = RunSpec.loads(base.replace(validator={"quorum": 4, "handover_s": 30.0}).to_toml())
    assert (again.validator.signing_quorum, again.validator.handover_s) == (4, 30.0)
