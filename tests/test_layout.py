"""Object keys: one layout, window-ordered listings, strict parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import layout
from protocol.config import RunSpec
from protocol.errors import MalformedPayload
from protocol.identity import Identity

PEER = Identity.from_seed(b"k" * 32).peer_id
LEADER = Identity.from_seed(b"l" * 32).peer_id
RUN = layout.run_id(RunSpec.default().hash())


def test_keys_follow_the_documented_layout() -> None:
    assert len(RUN) == 16 and RunSpec.default().hash().startswith(RUN)
    assert layout.contrib_key(RUN, 3, PEER) == f"{RUN}/contrib/00000003/{PEER}"
    assert layout.contrib_prefix(RUN, 3) == f"{RUN}/contrib/00000003/"
    assert layout.aggregate_key(RUN, 12) == f"{RUN}/aggregate/00000012"
    assert layout.checkpoint_key(RUN, 10, "model.safetensors") == f"{RUN}/checkpoint/00000010/model.safetensors"
    assert layout.checkpoint_manifest_key(RUN, 10) == f"{RUN}/checkpoint/00000010/manifest"
    assert layout.peer_key(RUN, PEER) == f"{RUN}/peers/{PEER}"
    assert layout.aggregate_key("my-run_2", 0) == "my-run_2/aggregate/00000000"
    for key in (layout.contrib_key(RUN, 3, PEER), layout.aggregate_key(RUN, 3), layout.checkpoint_key(RUN, 3, "f")):
        assert layout.parse_key(key).window == 3


def test_parse_key_roundtrips_every_kind() -> None:
    assert layout.parse_key(layout.contrib_key(RUN, 7, PEER), run=RUN) == layout.ParsedKey(RUN, "contrib", 7, PEER)
    assert layout.parse_key(layout.aggregate_key(RUN, 99_999_999)) == layout.ParsedKey(RUN, "aggregate", 99_999_999)
    assert layout.parse_key(layout.checkpoint_manifest_key(RUN, 5)).file == "manifest"
    assert layout.parse_key(layout.peer_key(RUN, PEER)) == layout.ParsedKey(RUN, "peers", peer_id=PEER)
    assert layout.parse_key(layout.contrib_key(RUN, 42, PEER)).window == 42


def test_the_keys_of_several_validators() -> None:
    assert layout.proposal_key(RUN, 3, PEER) == f"{RUN}/proposal/00000003/{PEER}"
    assert layout.endorsement_key(RUN, 3, PEER) == f"{RUN}/endorsement/00000003/{PEER}"
    assert layout.objection_key(RUN, 3, PEER, LEADER) == f"{RUN}/objection/00000003/{PEER}/{LEADER}"
    assert layout.proposal_key(RUN, 3, PEER).startswith(layout.proposal_prefix(RUN, 3))
    assert layout.endorsement_key(RUN, 3, PEER).startswith(layout.endorsement_prefix(RUN, 3))
    assert layout.objection_key(RUN, 3, PEER, LEADER).startswith(layout.objection_prefix(RUN, 3))
    assert layout.parse_key(layout.proposal_key(RUN, 3, PEER), run=RUN) == layout.ParsedKey(RUN, "proposal", 3, PEER)
    assert layout.parse_key(layout.endorsement_key(RUN, 9, PEER)) == layout.ParsedKey(RUN, "endorsement", 9, PEER)
    parsed = layout.parse_key(layout.objection_key(RUN, 3, PEER, LEADER))
    assert parsed == layout.ParsedKey(RUN, "objection", 3, peer_id=PEER, file=LEADER)  # the writer, then the proposer
    assert set(layout.VALIDATOR_KINDS) <= set(layout.KINDS)
    with pytest.raises(MalformedPayload):
        layout.objection_key(RUN, 3, PEER, "../x")
    with pytest.raises(MalformedPayload):
        layout.endorsement_key(RUN, -1, PEER)


@pytest.mark.parametrize(
    "key",
    [
        f"{RUN}/proposal/00000003",
        f"{RUN}/proposal/00000003/{PEER}/{LEADER}",
        f"{RUN}/proposal/3/{PEER}",
        f"{RUN}/endorsement/00000003/{PEER.upper()}",
        f"{RUN}/endorsement/00000003/{PEER}/x",
        f"{RUN}/objection/00000003/{PEER}",  # no proposer
        f"{RUN}/objection/00000003/{PEER}/..",
        f"{RUN}/objection/00000003/{PEER}/{LEADER}/x",
    ],
)
def test_the_keys_of_several_validators_parse_strictly(key: str) -> None:
    with pytest.raises(MalformedPayload):
        layout.parse_key(key)


@pytest.mark.parametrize(
    "key",
    [
        f"{RUN}/aggregate/12",  # not padded
        f"{RUN}/aggregate/000000012",  # 9 digits
        f"{RUN}/aggregate/+0000012",
        f"{RUN}/aggregate/0000001\u0662",  # a non-ASCII digit
        f"{RUN}/aggregate/00000012/extra",
        f"{RUN}/contrib/00000012/{PEER.upper()}",
        f"{RUN}/contrib/00000012/../../etc",
        f"{RUN}/contrib/00000012",
        f"{RUN}/checkpoint/00000012/..",
        f"{RUN}/checkpoint/00000012/a/b",
        f"{RUN}/peers/{PEER}/x",
        f"{RUN}/blobs/00000001",
        f"/{RUN}/aggregate/00000001",
        "UPPER/aggregate/00000001",
        "",
    ],
)
def test_parse_key_is_strict(key: str) -> None:
    with pytest.raises(MalformedPayload):
        layout.parse_key(key)


def test_parse_key_checks_the_run() -> None:
    with pytest.raises(MalformedPayload):
        layout.parse_key(layout.aggregate_key(RUN, 1), run="otherrun")


@pytest.mark.parametrize("window", [-1, 10**8, 1.0, True, "3"])
def test_builders_refuse_bad_windows(window) -> None:
    with pytest.raises(MalformedPayload):
        layout.aggregate_key(RUN, window)


@pytest.mark.parametrize("bad", [("a/b", 1, PEER), ("", 1, PEER), (RUN, 1, "../x"), (RUN, 1, PEER[:-1])])
def test_builders_refuse_unsafe_segments(bad) -> None:
    with pytest.raises(MalformedPayload):
        layout.contrib_key(*bad)
    with pytest.raises(MalformedPayload):
        layout.checkpoint_key(RUN, 1, "../model")
    with pytest.raises(MalformedPayload):
        layout.run_id("xyz")


@given(st.lists(st.integers(0, layout.MAX_WINDOW), min_size=1, max_size=30, unique=True))
def test_lexicographic_listing_order_is_window_order(windows: list[int]) -> None:
    keys = [layout.aggregate_key(RUN, w) for w in windows]
    assert [layout.parse_key(k).window for k in sorted(keys)] == sorted(windows)
