"""Several validators, one chain (protocol.quorum): what a quorum tolerates, who leads which view,
when the next leader takes over; and readers of the chain that take an aggregate only with the
certificate of m validators (protocol.chain, protocol.replay)."""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Iterator

import pytest
import torch

import protocol.quorum
from protocol import layout
from protocol.caps import object_caps, published_bytes
from protocol.chain import read_aggregate
from protocol.config import RunSpec
from protocol.errors import UnsupportedVersion
from protocol.identity import Identity
from protocol.model import param_schema
from protocol.quorum import MIN_HANDOVER_S, Quorum, Tolerance, handover_s, tolerance
from protocol.replay import Chain
from protocol.store.memory import MemoryStore
from protocol.wire import Aggregate, SparseDelta, encode_aggregate
from protocol.wire.delta import round_values
from protocol.wire.quorum import Endorsement, NoQuorum, encode_certificate, encode_endorsement

TINY = {"preset": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
VALIDATORS = [Identity.from_seed(bytes([48 + i]) * 32) for i in range(4)]


def spec_of(n: int, quorum: int = 0, **validator: object) -> RunSpec:
    keys = [v.public_key_hex for v in VALIDATORS[:n]]
    return RunSpec.from_dict({"model": TINY, "validator": {"public_keys": keys, "quorum": quorum, **validator}})


# ------------------------------------------------------------------------------ tolerance
def _documented_rows() -> list[tuple[int, int, int, int]]:
    """(n, m, crashed, lying) of every row of the table in protocol.quorum's docstring, and of the
    alternatives its notes give in parentheses ("(m = 3: 2 crashed, 0 lying)")."""
    doc = protocol.quorum.__doc__ or ""
    rows = []
    for line in doc.splitlines():
        m = re.match(r"^(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\b(.*)$", line)
        if not m:
            continue
        n, q, crashed, lying, note = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]
        rows.append((n, q, crashed, lying))
        alt = re.search(r"m = (\d+): (\d+) crashed, (\d+) lying", note)
        if alt:
            rows.append((n, int(alt[1]), int(alt[2]), int(alt[3])))
    return rows


def test_the_documented_table_is_what_tolerance_computes() -> None:
    rows = _documented_rows()
    assert len(rows) >= 7 and (5, 3, 2, 0) in rows  # the table and its note were found
    for n, m, crashed, lying in rows:
        assert tolerance(n, m) == Tolerance(crashed, lying), (n, m)


def test_tolerance_is_what_two_quorums_share() -> None:
    """f lying validators are survived (safety and liveness) exactly when every two quorums share
    an honest validator (2m − n ≥ f + 1) and m validators remain without them (m ≤ n − f)."""
    for n in range(1, 13):
        for m in range(n // 2 + 1, n + 1):
            t = tolerance(n, m)
            assert t.crashed == n - m
            for f in range(n + 1):
                assert (t.lying >= f) == (2 * m - n >= f + 1 and m <= n - f), (n, m, f)
        best = max(tolerance(n, q).lying for q in range(n // 2 + 1, n + 1))
        assert best == (n - 1) // 3, n  # n ≥ 3f + 1
    assert "1 validator(s) down" in tolerance(4, 3).describe() and "safe with 1 lying" in tolerance(4, 3).describe()


# ------------------------------------------------------------------------------ rotation
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_every_key_leads_once_in_n_consecutive_views(n: int) -> None:
    keys = tuple(sorted(Identity.from_seed(bytes([100 + i]) * 32).public_key_hex for i in range(n)))
    q = Quorum(keys, n // 2 + 1, 30.0)
    assert q.n == n and len(set(q.ids)) == n
    for window in (0, 1, 5, 1000):
        for start in (0, 3):
            leaders = [q.leader(window, v) for v in range(start, start + n)]
            assert sorted(leaders) == sorted(q.ids)
    for window in range(3 * n):
        for vid in q.ids:
            v = q.first_view_of(window, vid)
            assert 0 <= v < n and q.leader(window, v) == vid
            assert all(q.leader(window, u) != vid for u in range(v))


def test_consecutive_windows_start_with_different_leaders() -> None:
    q = Quorum.of(spec_of(4))
    firsts = [q.leader(w, 0) for w in range(12)]
    assert all(a != b for a, b in zip(firsts, firsts[1:], strict=False))
    assert firsts[:4] == list(q.ids) and firsts[4:8] == list(q.ids)  # each leads one window in n
    # view v of window t is led by whoever leads view 0 of window t + v
    assert all(q.leader(w, v) == q.leader(w + v, 0) for w in range(8) for v in range(8))


def test_the_rotation_follows_the_sorted_keys_whatever_the_spec_order() -> None:
    keys = [v.public_key_hex for v in VALIDATORS]
    a = Quorum.of(RunSpec.from_dict({"model": TINY, "validator": {"public_keys": keys}}))
    b = Quorum.of(RunSpec.from_dict({"model": TINY, "validator": {"public_keys": keys[::-1]}}))
    assert a == b and a.keys == tuple(sorted(keys))
    with pytest.raises(ValueError):
        a.index(Identity.from_seed(b"z" * 32).peer_id)


def test_views_change_every_handover() -> None:
    q = Quorum(Quorum.of(spec_of(4)).keys, 3, 30.0)
    # each view lasts one handover longer than the one before: views begin at 0, 30, 90, 180, 300 s
    assert [q.view_at(s) for s in (-5.0, 0.0, 29.999, 30.0, 89.9, 90.0, 179.9, 180.0, 301.0)] == [
        0,
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        4,
    ]
    assert q.view_at(math.nextafter(30.0, 0.0)) == 0
    assert all(
        q.view_at(q.view_start(v)) == v and q.view_at(math.nextafter(q.view_start(v), 0.0)) == v - 1
        for v in range(1, 200)
    )


def test_handover_is_configured_or_derived_from_the_upload_deadline() -> None:
    assert handover_s(spec_of(4, handover_s=12.5)) == 12.5
    assert handover_s(spec_of(4).replace(windows={"upload_deadline_s": 600.0})) == 300.0
    assert handover_s(spec_of(4).replace(windows={"upload_deadline_s": 20.0})) == MIN_HANDOVER_S
    assert Quorum.of(spec_of(4, handover_s=7.0)).handover_s == 7.0


def test_quorate_counts_distinct_validators_of_the_run() -> None:
    q = Quorum.of(spec_of(4))
    a, b, c, _ = q.ids
    stranger = Identity.from_seed(b"z" * 32).peer_id
    assert q.m == 3 and q.quorate([a, b, c]) and q.quorate([c, b, a, a])
    assert not q.quorate([a, b]) and not q.quorate([a, a, b, b]) and not q.quorate([a, b, stranger])
    assert q.several and not Quorum.of(spec_of(1)).several and Quorum.of(spec_of(1)).m == 1
    assert Quorum.of(spec_of(2)).m == 2 and Quorum.of(spec_of(3)).m == 2


# ------------------------------------------------------------------------------ readers of the chain
BASE = hashlib.sha256(b"aggregate 0").hexdigest()
WINDOW = 1


class Run:
    """A 4-validator run (m = 3) in a memory store: aggregates and certificates put by hand."""

    def __init__(self, n: int = 4) -> None:
        self.spec = spec_of(n)
        self.store = MemoryStore()
        self.run_hash = self.spec.hash()
        self.run = layout.run_id(self.run_hash)
        self.key = layout.aggregate_key(self.run, WINDOW)

    def aggregate(self, signer: Identity = VALIDATORS[0], seed: int = 0) -> bytes:
        name, shape = sorted(param_schema(self.spec.model).items())[seed % 3]
        tensors = {name: SparseDelta(tuple(shape), torch.tensor([seed]), round_values(torch.tensor([0.5])))}
        agg = Aggregate(self.run_hash, WINDOW, BASE, 1.0, "f" * 64, (), tensors, 1_767_225_600.0 + seed)
        return encode_aggregate(agg, signer)

    def certificate(self, agg: bytes, endorsers: list[Identity]) -> bytes:
        digest = hashlib.sha256(agg).hexdigest()
        ends = [
            encode_endorsement(Endorsement(self.run_hash, WINDOW, 0, VALIDATORS[0].peer_id, digest), v)
            for v in endorsers
        ]
        return encode_certificate(agg, ends, WINDOW, self.run_hash, endorsers[-1])

    def read(self, quorum: int | None = 3):  # type: ignore[no-untyped-def]
        return read_aggregate(
            self.store,
            self.run,
            self.run_hash,
            WINDOW,
            allowed_signers=self.spec.validator.public_keys,
            max_bytes=published_bytes(self.spec),
            schema=param_schema(self.spec.model),
            quorum=quorum,
        )


@pytest.fixture
def run() -> Iterator[Run]:
    r = Run()
    yield r
    r.store.close()


def test_read_aggregate_takes_the_aggregate_of_a_certificate(run: Run) -> None:
    assert run.read() is None  # nothing there yet
    agg = run.aggregate()
    run.store.put(run.key, run.certificate(agg, VALIDATORS[:3]))
    got = run.read()
    assert got is not None and got.digest == hashlib.sha256(agg).hexdigest() and got.value.base == BASE
    with pytest.raises(NoQuorum):
        run.read(quorum=4)
    with pytest.raises(UnsupportedVersion):  # a reader of a one-validator run wants a plain aggregate
        run.read(quorum=None)
    run.store.put(run.key, agg)
    assert run.read(quorum=None).digest == got.digest
    with pytest.raises(UnsupportedVersion):
        run.read()


def test_the_chain_of_a_run_with_several_keys_wants_certificates(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    chain = Chain(run.spec, run.store)
    assert (
        chain.quorum == 3 and chain.max_aggregate_bytes == published_bytes(run.spec) > object_caps(run.spec).aggregate
    )
    agg = run.aggregate()
    assert chain.next_aggregate(WINDOW, BASE) is None  # absent
    for what, blob in [
        ("plain", agg),
        ("no_quorum", run.certificate(agg, VALIDATORS[:2])),
        ("no_quorum", run.certificate(agg, [VALIDATORS[0], VALIDATORS[1], VALIDATORS[1]])),
        ("unknown_signer", run.certificate(run.aggregate(Identity.from_seed(b"z" * 32)), VALIDATORS[:3])),
    ]:
        run.store.put(run.key, blob)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="protocol.chain"):
            assert Chain(run.spec, run.store).next_aggregate(WINDOW, BASE) is None, what
        assert "treated as absent" in caplog.text, what
        if what != "plain":
            assert what in caplog.text
    good = run.certificate(agg, VALIDATORS[1:])  # written by another validator than the proposer
    run.store.put(run.key, good)
    found = chain.next_aggregate(WINDOW, BASE)
    assert found is not None and found.digest == hashlib.sha256(agg).hexdigest()
    assert chain.aggregate(WINDOW).digest == found.digest  # type: ignore[union-attr]
    assert chain.next_aggregate(WINDOW, "0" * 64) is None  # it does not chain onto another base


def test_a_one_validator_run_reads_plain_aggregates_as_before() -> None:
    r = Run(n=1)
    chain = Chain(r.spec, r.store)
    assert chain.quorum is None and chain.max_aggregate_bytes == object_caps(r.spec).aggregate
    agg = r.aggregate()
    r.store.put(r.key, agg)
    assert chain.next_aggregate(WINDOW, BASE).digest == hashlib.sha256(agg).hexdigest()  # type: ignore[union-attr]
    r.store.put(r.key, r.certificate(agg, VALIDATORS[:1]))
    assert Chain(r.spec, r.store).next_aggregate(WINDOW, BASE) is None
