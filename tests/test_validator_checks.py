"""Each cheap check is a pure function with its own test; plus copies, reputation and the window clock."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from protocol import codec
from protocol.config import CodecConfig, RunSpec, ValidatorConfig, WindowConfig
from protocol.identity import Identity
from protocol.outcomes import PeerOutcome
from protocol.windows import gather_close, is_checkpoint_window, should_close, upload_deadline
from protocol.wire import GENESIS, Contribution, encode_contribution
from validator import checks
from validator.copies import CopyRule, scan, similarity
from validator.held import Held, decode, hold
from validator.log import CheckRow
from validator.reference import Measured, TensorNorms
from validator.reputation import EXCLUDED, Standing, is_established, is_excluded, is_senior, standings, update
from validator.sketch import Sketcher

SCHEMA = {"w": (64, 64), "b": (64,)}
CFG = CodecConfig()
RUN = "12" * 32


def blob(
    signer: Identity,
    *,
    window: int = 3,
    base: str = "ab" * 32,
    run: str = RUN,
    scale: float = 1.0,
    tensors: dict[str, torch.Tensor] | None = None,
) -> bytes:
    gen = torch.Generator().manual_seed(0)
    tensors = tensors or {n: torch.randn(s, generator=gen) * scale for n, s in SCHEMA.items()}
    enc = {n: codec.encode(t, CFG) for n, t in tensors.items()}
    return encode_contribution(Contribution(run, window, base, CFG, enc, {}), signer)


@pytest.fixture(scope="module")
def peer() -> Identity:
    return Identity.generate()


def ctx(peer: Identity, **kw: object) -> checks.Context:
    base = dict(
        run_hash=RUN,
        window=3,
        expected_base="ab" * 32,
        codec=CFG,
        schema=SCHEMA,
        max_bytes=1 << 20,
        registered=frozenset({peer.peer_id}),
    )
    base.update(kw)
    return checks.Context(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------ single checks
def test_single_checks() -> None:
    assert checks.check_size(10, 10).passed and checks.check_size(11, 10).reason == "too_large"
    assert checks.check_size(0, 10).reason == "empty"
    assert checks.check_window(3, 3).passed and checks.check_window(2, 3).reason == "wrong_window"
    assert checks.check_registered("p", {"p"}).passed and checks.check_registered("q", {"p"}).reason == "unregistered"
    assert checks.check_codec(CFG, CFG).passed and checks.check_codec(CodecConfig(k=32), CFG).reason == "wrong_codec"
    assert checks.check_schema({"w": (64, 64)}, SCHEMA).passed  # a subset (pipeline stage) is fine
    assert checks.check_schema({"w": (64, 32)}, SCHEMA).reason == "schema_mismatch"
    assert checks.check_schema({"x": (64,)}, SCHEMA).reason == "schema_mismatch"
    assert checks.check_schema({}, SCHEMA).reason == "empty_contribution"
    assert checks.check_sync("a", "a").passed and checks.check_sync(GENESIS, "a").reason == "stale_base"
    assert checks.check_excluded(True).reason == "excluded" and checks.check_excluded(False).passed
    nan = {"w": (torch.tensor([0, 1]), torch.tensor([1.0, float("nan")]))}
    assert checks.check_finite(nan).reason == "non_finite"
    assert checks.check_finite({"w": (torch.tensor([0]), torch.tensor([1.0]))}).passed


def test_norm_check_compares_with_the_reference_not_the_window() -> None:
    from validator.reference import NormReference, TensorNorms, check_norms, lower_median, window_value

    med = window_value([{"w": TensorNorms(1.0)}, {"w": TensorNorms(1000.0)}])
    assert med == {"w": TensorNorms(1.0)}  # with two contributions, the huge one cannot drag it up
    ref = NormReference({"w": TensorNorms(1.0, 0.1)})

    def reason(norm: float) -> str | None:
        return check_norms({"w": TensorNorms(norm)}, ref, max_ratio=10.0, min_ratio=0.1)[0].reason

    assert reason(1.0) is None and reason(9.0) is None  # scaled up to 9x: passes (and is clipped)
    assert reason(1000.0) == "norm_outlier" and reason(float("inf")) == "norm_outlier"
    assert reason(0.001) == "norm_tiny"  # however many send tiny updates, the reference stays
    empty = NormReference()
    assert check_norms({"w": TensorNorms(1e6)}, empty, max_ratio=10.0, min_ratio=0.1)[0].passed  # no history yet
    assert check_norms({"w": TensorNorms(float("nan"))}, empty, max_ratio=10.0, min_ratio=0.1)[0].reason == (
        "norm_outlier"
    )
    assert lower_median([3.0, 1.0, 2.0]) == 2.0


def test_reference_moves_at_a_bounded_rate_and_round_trips() -> None:
    from validator.reference import NormReference, TensorNorms, advance, clip_limits, measured

    ref = NormReference({"w": TensorNorms(1.0, 0.2)})
    assert advance(ref, {"w": TensorNorms(100.0, 0.0)}, 2.0).tensors["w"] == TensorNorms(2.0, 0.1)
    assert advance(ref, {"b": TensorNorms(3.0)}, 2.0).tensors["b"] == TensorNorms(3.0)  # new tensor: as is
    assert NormReference.from_json(ref.to_json()) == ref
    with pytest.raises(ValueError):
        NormReference.from_json('{"w": [NaN, 0]}')
    # caps: the established median, kept within [reference, headroom x reference]
    big = {"w": (torch.tensor([0, 8]), torch.tensor([5.0, 0.3]))}  # norm ~5, rows 5.0 and 0.3
    caps = clip_limits(ref, [measured(big, {"w": (4, 8)})], {"w": (4, 8)}, headroom=2.0, rows=True)
    assert caps["w"].norm == 2.0 and caps["w"].row == pytest.approx(0.4) and caps["w"].row_len == 8
    # each row: headroom x max(what established peers did to that row, the RMS row = 1 / 2)
    assert caps["w"].rows is not None and caps["w"].rows.tolist() == pytest.approx([10.0, 1.0, 1.0, 1.0])
    small = {"w": (torch.tensor([0]), torch.tensor([0.01]))}
    caps = clip_limits(ref, [measured(small, {"w": (4, 8)})], {"w": (4, 8)}, headroom=2.0, rows=False)
    assert caps["w"].norm == 1.0 and caps["w"].row == 0.0 and caps["w"].rows is None


EMPTY_SKETCH = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))


def _held(norm: float) -> Held:
    """What the reference needs of a contribution to a (4, 8) tensor ``w`` with this norm (rows equal)."""
    rows = torch.full((4,), norm / 2.0, dtype=torch.float64)
    return Held("d", b"", 32, Measured({"w": TensorNorms(norm, norm / 2.0)}, {"w": rows}), EMPTY_SKETCH)


def _drift(spec: RunSpec, *, senior: bool, windows: int = 6) -> float:
    """The reference of ``w`` after ``windows`` windows in which 6 honest senior peers send norm 1
    and 10 established sybils (senior or not) send 8 x the current reference."""
    from validator.limits import advanced
    from validator.reference import NormReference

    ref = NormReference({"w": TensorNorms(1.0, 0.5)})
    honest, sybils = [f"h{i}" for i in range(6)], [f"s{i}" for i in range(10)]
    established = set(honest + sybils)
    seniors = set(honest) | (set(sybils) if senior else set())
    for _ in range(windows):
        held = {p: _held(1.0) for p in honest} | {p: _held(8.0 * ref.tensors["w"].norm) for p in sybils}
        screened = [checks.Screened(peer=p, checks=(), reason=None, held=h) for p, h in held.items()]
        ref = advanced(spec, ref, screened, established, seniors)
    return ref.tensors["w"].norm


def test_established_sybils_cannot_drag_the_reference() -> None:
    """Six windows of x8 pushes by a majority of established identities: those not yet senior do
    not move the reference at all; senior ones only to within the epoch bound of its baseline
    (x2 of a baseline that follows over 16 windows), not the x2 per window they would get from
    unclipped norms without the bound."""
    spec = RunSpec()
    cfg = spec.validator
    assert _drift(spec, senior=False) == pytest.approx(1.0)
    bound = cfg.reference_epoch_factor ** (1.0 + 6 / cfg.reference_horizon)  # 2.59
    assert 2.0 <= _drift(spec, senior=True) <= bound
    unbounded = spec.replace(validator={"reference_epoch_factor": 1e9})
    assert _drift(unbounded, senior=True) == pytest.approx(2.0**6)  # what the bound prevents
    # honest norms that change slowly are followed: x1.5 over a few windows is inside the band
    from validator.reference import NormReference, advance

    ref = NormReference({"w": TensorNorms(1.0, 0.5)})
    for _ in range(3):
        ref = advance(ref, {"w": TensorNorms(1.5, 0.75)}, 2.0, factor=2.0, horizon=16)
    assert ref.tensors["w"] == TensorNorms(1.5, 0.75)
    assert NormReference.from_json(ref.to_json()) == ref and ref.baseline["w"].norm > 1.0


def test_rows_for_error_name_the_failing_check() -> None:
    rows = checks.rows_for_error("wrong_run")
    assert rows[-1] == CheckRow("run", False, "wrong_run")
    assert [r.name for r in rows if r.passed] == ["size", "format", "signature"]
    assert checks.rows_for_error("invalid_indices")[-1] == CheckRow("schema", False, "invalid_indices")
    assert checks.rows_for_error("something_new")[-1].name == "format"


# ------------------------------------------------------------------ screen(): one contribution
def test_screen_accepts_a_good_contribution(peer: Identity) -> None:
    s = checks.screen(peer.peer_id, blob(peer), ctx(peer))
    assert s.reason is None and s.held is not None and set(s.held.norms.tensors) == set(SCHEMA)
    assert s.held.data == blob(peer) and s.held.digest == hashlib.sha256(s.held.data).hexdigest()
    again = decode(s.held, SCHEMA, CFG)  # what is held decodes to the values that were checked
    assert set(again) == set(SCHEMA) and s.held.nnz == sum(len(i) for i, _ in again.values())
    assert len(s.held.sketch[0]) == s.held.nnz  # a small contribution is not sampled
    assert [c.name for c in s.checks] == list(checks.CHECK_ORDER[: checks.CHECK_ORDER.index("excluded") + 1])


# Objects the peer did not sign for this run and window are "foreign" (never blamed on the peer);
# the failed check still names what was wrong with them.
@pytest.mark.parametrize(
    "make, context, reason, check",
    [
        (lambda p: blob(p), dict(max_bytes=100), "foreign", "size"),
        (lambda p: blob(p)[:-1], {}, "foreign", "format"),
        (lambda p: b"\x00" * 200, {}, "foreign", "format"),
        (lambda p: blob(Identity.generate()), {}, "foreign", "signature"),  # stored under p's id, signed by another
        (lambda p: blob(p, run="34" * 32), {}, "foreign", "run"),  # p's own object of another run
        (lambda p: blob(p, window=2), {}, "foreign", "window"),  # p's own object of another window
        (lambda p: blob(p), dict(registered=frozenset()), "unregistered", "registered"),
        (lambda p: blob(p), dict(codec=CodecConfig(k=32)), "wrong_codec", "codec"),
        (lambda p: blob(p, tensors={"w": torch.randn(32, 64)}), {}, "schema_mismatch", "schema"),
        (lambda p: blob(p, base=GENESIS), {}, "stale_base", "sync"),
        (lambda p: blob(p), dict(excluded=frozenset()), None, None),
    ],
)
def test_screen_rejects_with_the_named_reason(peer: Identity, make, context, reason, check) -> None:  # type: ignore[no-untyped-def]
    s = checks.screen(peer.peer_id, make(peer), ctx(peer, **context))
    assert s.reason == reason
    if reason is not None:
        assert s.checks[-1] == CheckRow(check, False, reason) and s.detail


def test_a_delayed_run_accepts_a_base_one_aggregate_old_and_no_older(peer: Identity) -> None:
    """outer.delay = 1: a peer may train window t from θ_t−1 (base: the aggregate before the
    expected one); outer.delay = 0 (no ``previous_base``) accepts the expected base only."""
    previous, older = "cd" * 32, GENESIS
    assert checks.check_sync(previous, "ab" * 32, previous).passed
    assert checks.check_sync("ab" * 32, "ab" * 32, previous).passed
    assert checks.check_sync(older, "ab" * 32, previous).reason == "stale_base"
    assert checks.check_sync(previous, "ab" * 32, None).reason == "stale_base"
    delayed = ctx(peer, previous_base=previous)
    assert checks.screen(peer.peer_id, blob(peer, base=previous), delayed).reason is None
    assert checks.screen(peer.peer_id, blob(peer, base=older), delayed).reason == "stale_base"
    assert checks.screen(peer.peer_id, blob(peer, base=previous), ctx(peer)).reason == "stale_base"


def test_screen_never_raises_on_garbage(peer: Identity) -> None:
    good = blob(peer)
    rng = np.random.default_rng(0)
    for _ in range(200):
        data = bytearray(good)
        for i in rng.integers(0, len(data), size=3):
            data[i] ^= int(rng.integers(1, 256))
        s = checks.screen(peer.peer_id, bytes(data), ctx(peer))
        assert s.reason is not None  # the signature covers every byte


# ------------------------------------------------------------------ copies
def test_global_entries_and_similarity() -> None:
    from validator.window_checks import global_entries

    sparse = {"b": (torch.tensor([1]), torch.tensor([2.0])), "a": (torch.tensor([0, 5]), torch.tensor([1.0, -1.0]))}
    idx, vals = global_entries(sparse, {"a": 0, "b": 10})
    assert idx.tolist() == [0, 5, 11] and vals.tolist() == [1.0, -1.0, 2.0]
    a = (np.array([1, 2, 3, 4]), np.array([1.0, 1.0, 1.0, 1.0], dtype=np.float32))
    b = (np.array([3, 4, 5, 6]), np.array([1.0, -1.0, 1.0, 1.0], dtype=np.float32))
    s = similarity(a, b, rare_shared=1, rare_a=2, rare_b=4)
    assert s.overlap == 0.5 and s.signs == 0.5 and s.rare == 0.5
    assert similarity((np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)), b, 0, 0, 4).overlap == 0.0


def _entry(idx: np.ndarray, sign: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    return idx.astype(np.int64), np.full(len(idx), sign, dtype=np.float32)


def test_copy_scan_later_upload_is_the_copier() -> None:
    a = np.arange(0, 100)
    idx = {"orig": _entry(a), "copier": _entry(a.copy()), "honest": _entry(np.arange(80, 180))}
    v, best = scan(idx, {"orig": 1.0, "copier": 2.0, "honest": 1.5}, CopyRule())
    assert set(v) == {"copier"} and v["copier"].original == "orig" and v["copier"].similarity.overlap == 1.0
    # the overlap is measured with each peer's closest candidates (those sharing rare positions)
    assert best["orig"] == best["copier"] == 1.0 and best["honest"] <= 0.2
    # reversed order: now "orig" is the later one
    v, _ = scan(idx, {"orig": 3.0, "copier": 2.0, "honest": 1.5}, CopyRule())
    assert set(v) == {"orig"} and not v["orig"].tie
    # below the threshold nobody is a copier (honest overlap 0.2)
    assert scan({"x": _entry(a), "y": _entry(np.arange(80, 180))}, {"x": 1.0, "y": 2.0}, CopyRule())[0] == {}


def test_copy_scan_unknown_order_is_a_tie_not_a_copy() -> None:
    a = np.arange(50)
    v, _ = scan({"x": _entry(a), "y": _entry(a)}, {"x": 1.0, "y": 1.0}, CopyRule())
    assert set(v) == {"x", "y"} and all(c.tie for c in v.values())
    # listed in the same poll (1.0), read one after the other: which came first is unknown
    v, _ = scan({"x": _entry(a), "y": _entry(a)}, {"x": 1.01, "y": 1.02}, CopyRule(), {"x": 1.0, "y": 1.0})
    assert set(v) == {"x", "y"} and all(c.tie for c in v.values())
    # y's key appeared only after x's bytes were read: y is the copier
    v, _ = scan({"x": _entry(a), "y": _entry(a)}, {"x": 1.01, "y": 2.02}, CopyRule(), {"x": 1.0, "y": 2.0})
    assert set(v) == {"y"} and not v["y"].tie


def test_copy_scan_catches_a_partial_copy_by_its_rare_positions() -> None:
    """Six honest uploads share popular positions; a copy of 55 % of one of them plus its own
    positions stays under the overlap threshold but shares the original's rare positions."""
    rng = np.random.default_rng(0)
    popular = np.arange(0, 2000)
    entries = {}
    for i in range(6):
        own = rng.choice(np.arange(10_000, 200_000), size=300, replace=False)
        entries[f"h{i}"] = _entry(np.unique(np.concatenate([rng.choice(popular, 100, replace=False), own])))
    orig = entries["h0"][0]
    copied = rng.choice(orig, size=int(0.55 * len(orig)), replace=False)
    noise = rng.choice(np.arange(300_000, 400_000), size=len(orig) - len(copied), replace=False)
    entries["copier"] = _entry(np.unique(np.concatenate([copied, noise])))
    times = {p: float(i) for i, p in enumerate(entries)}
    v, best = scan(entries, times, CopyRule())
    assert set(v) == {"copier"} and v["copier"].original == "h0"
    assert v["copier"].similarity.overlap < 0.6 <= 0.3 + v["copier"].similarity.rare
    # flipped signs are not a copy: a free rider keeps the signs
    entries["copier"] = _entry(entries["copier"][0], -1.0)
    assert "copier" not in scan(entries, times, CopyRule())[0]


# ------------------------------------------------------------------ reputation
def test_reputation_moving_average_and_exclusion() -> None:
    cfg = ValidatorConfig(reputation_decay=0.5, exclude_after_failures=2, exclude_windows=3)
    s = update(Standing(), PeerOutcome("p", True, score=0.2, window=0), cfg)
    assert s.reputation == 0.5 and s.failures == 0
    s = update(s, PeerOutcome("p", True, score=None, window=1), cfg)  # not scored: no evidence
    assert s.reputation == 0.5
    s = update(s, PeerOutcome("p", False, "stale_base", window=2), cfg)
    assert s.reputation == pytest.approx(-0.25) and s.failures == 1 and not is_excluded(s, 3)
    s = update(s, PeerOutcome("p", False, "harmful", window=3), cfg)
    assert s.failures == 0 and s.excluded_until == 7
    assert all(is_excluded(s, w) for w in (4, 5, 6)) and not is_excluded(s, 7)
    assert update(s, PeerOutcome("p", False, EXCLUDED, window=4), cfg) == s  # exclusion does not extend itself
    assert update(s, PeerOutcome("p", False, "late", window=4), cfg) == s  # neither do late or surplus uploads
    assert update(s, PeerOutcome("p", False, "over_capacity", window=4), cfg) == s


def test_only_scored_windows_clear_failures_or_count_as_passes() -> None:
    """An identity that fails whenever it is scored is excluded at its third scored failure, however
    many accepted, unscored windows it slips through in between; those never count as passes."""
    cfg = ValidatorConfig(exclude_after_failures=3, exclude_windows=5, probation_passes=3)
    s, w = Standing(), 0
    for failure in range(3):
        assert not is_excluded(s, w)
        for _ in range(4):  # accepted while nobody looked
            s = update(s, PeerOutcome("p", True, score=None, window=w), cfg)
            w += 1
        assert s.failures == failure and s.passes == 0
        s = update(s, PeerOutcome("p", False, "harmful", 0.0, window=w), cfg)
        w += 1
    assert is_excluded(s, w) and s.excluded_until == w + cfg.exclude_windows
    # a scored, accepted window clears the count
    s = update(Standing(failures=2), PeerOutcome("p", True, score=0.1, window=0), cfg)
    assert s.failures == 0 and s.passes == 1


def test_seniority_counts_windows_since_establishment() -> None:
    cfg = ValidatorConfig(probation_passes=3, reference_seniority=2)
    s = Standing()
    for w in range(3):
        s = update(s, PeerOutcome("p", True, score=0.1, window=w), cfg)
    assert is_established(s, cfg) and s.tenure == 0 and not is_senior(s, cfg)  # just established
    s = update(s, PeerOutcome("p", True, score=None, window=3), cfg)
    assert s.tenure == 1 and not is_senior(s, cfg)
    s = update(s, PeerOutcome("p", True, score=None, window=4), cfg)
    assert s.tenure == 2 and is_senior(s, cfg)
    assert update(s, PeerOutcome("p", False, "late", window=5), cfg) == s  # neutral: no tenure


def test_standings_fold_is_order_independent_and_respects_before() -> None:
    cfg = ValidatorConfig()
    hist = [
        PeerOutcome(p, w % 2 == 0, None if w % 2 == 0 else "copied", 0.1, window=w)
        for w in range(6)
        for p in ("a", "b")
    ]
    assert standings(hist, cfg) == standings(list(reversed(hist)), cfg)
    assert standings(hist, cfg, before=2)["a"] == standings(hist[:4], cfg)["a"]


# ------------------------------------------------------------------ the window clock
def test_window_clock() -> None:
    cfg = WindowConfig(upload_deadline_s=10.0, gather_grace_s=2.0, checkpoint_every=5)
    assert upload_deadline(100.0, cfg) == 110.0 and gather_close(100.0, cfg) == 112.0
    assert not should_close(101.0, 100.0, cfg, expected={"a", "b"}, uploaded={"a"})
    assert should_close(101.0, 100.0, cfg, expected={"a", "b"}, uploaded={"a", "b", "c"})
    assert not should_close(101.0, 100.0, cfg, expected=set(), uploaded={"a"})  # nobody known: wait
    assert should_close(112.0, 100.0, cfg, expected={"a"}, uploaded=set())
    assert [w for w in range(12) if is_checkpoint_window(w, cfg)] == [0, 5, 10]
    # the window a validator stops at (max_windows) is checkpointed too: the run's final θ
    assert [w for w in range(12) if is_checkpoint_window(w, cfg, 7)] == [0, 5, 7, 10]
    assert RunSpec().windows.checkpoint_every > 0


# ------------------------------------------------------------------ window-level checks
def _screened(peer: str, idx: list[int], vals: list[float]) -> checks.Screened:
    sparse = {"w": (torch.tensor(idx, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32))}
    held = hold(b"", peer, sparse, {"w": (64, 64)}, Sketcher({"w": 0}))
    return checks.Screened(peer=peer, checks=(CheckRow("size", True),), reason=None, held=held)


def test_window_checks_norm_copy_score_capacity() -> None:
    from validator import window_checks as wc
    from validator.reference import NormReference, TensorNorms
    from validator.scoring import LossScore

    a = _screened("a", [0, 1, 2, 3], [1.0, 1.0, 1.0, 1.0])
    b = _screened("b", [10, 11, 12, 13], [1.0, -1.0, 1.0, 1.0])
    copy = _screened("c", [0, 1, 2, 3], [1.0, 1.0, 1.0, 1.1])
    huge = _screened("h", [20, 21, 22, 23], [100.0, 100.0, 100.0, 100.0])
    tiny = _screened("t", [30, 31, 32, 33], [0.01, 0.01, 0.01, 0.01])
    rejected = checks.Screened(peer="r", checks=(CheckRow("size", False, "too_large"),), reason="too_large")
    ref = NormReference({"w": TensorNorms(2.0, 1.0)})
    out = wc.norms([a, b, copy, huge, tiny, rejected], ref, max_ratio=10.0, min_ratio=0.1)
    assert [s.reason for s in out] == [None, None, None, "norm_outlier", "norm_tiny", "too_large"]
    assert out[5] is rejected  # rejected ones pass through untouched
    out = wc.copies(out, {"a": 1.0, "b": 2.0, "c": 3.0, "h": 0.0}, CopyRule())
    assert [s.reason for s in out[:4]] == [None, None, "copied", "norm_outlier"]
    assert "overlap 1.00" in (out[2].detail or "") and "with a" in (out[2].detail or "")
    out = wc.scores(out, {"a": LossScore(5.0, 4.0, 5.0, 4.5), "b": LossScore(5.0, 5.1, 5.0, 4.9)}, 0.0)
    assert [s.reason for s in out[:2]] == [None, "harmful"]
    assert out[0].checks[-1] == CheckRow("score", True)
    three = [_screened(p, [i], [1.0]) for i, p in enumerate("xyz")]
    rank = {"x": -0.1, "y": -0.5, "z": 1.0}
    kept = wc.capacity(three, rank.__getitem__, 2)
    assert [s.reason for s in kept] == [None, None, "over_capacity"]
    assert a.held is not None and a.held.norms.total == pytest.approx(2.0)
    assert wc.offsets({"b": (2,), "a": (3, 2)}) == {"a": 0, "b": 6}


def test_window_checks_ties_probation_harm_and_effect() -> None:
    from validator import window_checks as wc
    from validator.scoring import LossScore

    x, y, n = (_screened(p, [0, 1, 2, 3], [1.0] * 4) for p in "xyn")
    out = wc.copies([x, y], {"x": 1.01, "y": 1.02}, CopyRule(), {"x": 1.0, "y": 1.0})
    assert [s.reason for s in out] == [None, None] and "order unknown" in (out[1].detail or "")  # a tie
    good = LossScore(5.0, 4.0, 5.0, 4.9)
    out = wc.probation([x, n], established={"x"}, loss_scores={})
    assert [s.reason for s in out] == [None, "probation"]
    assert wc.probation([n], established=set(), loss_scores={"n": good})[0].reason is None
    # lowers the loss on its own data, raises it on held-out data: rejected, and never rewarded
    raises = LossScore(5.0, 4.0, 5.0, 5.2)
    assert raises.score == pytest.approx(0.8) and raises.score < LossScore(5.0, 4.0, 5.0, 5.0).score
    assert wc.scores([x], {"x": raises}, 0.002)[0].reason == "harmful_general"
    assert wc.scores([x], {"x": LossScore(5.0, 4.0, 5.0, 5.005)}, 0.002)[0].reason is None  # within tolerance
    # helps, but by far less than the established peers' updates did
    assert wc.scores([x], {"x": LossScore(5.0, 4.99, 5.0, 4.99)}, 0.002, min_gain=0.05)[0].reason == "ineffective"
    assert wc.stable([x, y], {"y"})[1].reason == "non_finite_result"


def test_agreement_with_established_uploads_orders_probation() -> None:
    from validator.consensus import agreement

    idx = np.arange(100, dtype=np.int64)
    up = np.ones(100, dtype=np.float32)
    entries = {
        "k1": (idx, up),
        "k2": (idx, up),
        "same": (idx[:50], up[:50]),
        "flipped": (idx[:50], -up[:50]),
        "elsewhere": (idx + 1000, up),
    }
    got = agreement(entries, {"k1", "k2"})
    assert got["same"] == 51 / 52 and got["flipped"] == 1 / 52 and got["elsewhere"] == 0.5
    assert got["k1"] == got["k2"] == 101 / 102  # an established peer is compared with the others
    assert agreement({"a": (idx, up)}, set()) == {"a": 0.5}
    # per tensor: an edit in a second tensor that nobody else makes counts, however well the rest agrees
    two = {**entries, "edit": (np.concatenate([idx, idx + 5000]), np.ones(200, dtype=np.float32))}
    starts = np.array([0, 5000], dtype=np.int64)
    assert agreement(two, {"k1", "k2"}, starts)["edit"] == 0.5 < agreement(two, {"k1", "k2"})["edit"]


# ------------------------------------------------------------------ hostile tensor tables
def _crafted(signer: Identity, table: list[tuple[str, tuple[int, ...]]], payload: bytes) -> bytes:
    """A validly signed contribution whose tensor table declares ``table`` over ``payload``."""
    from protocol.wire.fields import TensorEntry, Writer, write_base, write_codec, write_metadata, write_table
    from protocol.wire.frame import Kind, seal

    w = Writer()
    write_base(w, "ab" * 32)
    write_codec(w, CFG)
    write_metadata(w, {})
    share = len(payload) // len(table)
    lengths = [share] * (len(table) - 1) + [len(payload) - share * (len(table) - 1)]
    write_table(w, [TensorEntry(n, s, 0, (n_bytes,)) for (n, s), n_bytes in zip(table, lengths)])
    return seal(Kind.CONTRIBUTION, RUN, 3, signer, w.getvalue(), payload)


@pytest.mark.parametrize(
    "table",
    [
        [("evil", (1 << 20, 1 << 18))],  # 2^38 values: ~64 M chunks, one payload byte each would "fit"
        [("w", (1 << 20, 1 << 18))],  # a model tensor name with a huge shape
        [("b", (64,)), ("w", (64, 64)), ("zz", (1 << 30,))],  # valid tensors plus one stranger
    ],
)
def test_huge_undeclared_shape_is_schema_mismatch_before_the_codec_runs(
    peer: Identity, table: list[tuple[str, tuple[int, ...]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unpack_must_not_run(*args: object, **kw: object) -> None:
        raise AssertionError("the codec was asked to build a tensor the schema does not allow")

    monkeypatch.setattr(codec, "unpack", unpack_must_not_run)
    data = _crafted(peer, table, bytes(range(256)) * 256)  # 64 KiB standing in for a 64 MB upload
    s = checks.screen(peer.peer_id, data, ctx(peer))
    assert s.reason == "schema_mismatch" and s.held is None
    assert [c.name for c in s.checks] == [
        "size",
        "format",
        "signature",
        "run",
        "window",
        "registered",
        "codec",
        "schema",
    ]
    assert s.checks[-1] == CheckRow("schema", False, "schema_mismatch")


def test_undecodable_contribution_of_an_unregistered_peer_is_unregistered(peer: Identity) -> None:
    data = _crafted(peer, [("evil", (1 << 20,))], b"x" * 64)
    s = checks.screen(peer.peer_id, data, ctx(peer, registered=frozenset()))
    assert s.reason == "unregistered" and s.checks[-1] == CheckRow("registered", False, "unregistered")


def test_held_contributions_decode_with_the_codec_of_their_window(peer: Identity) -> None:
    s = checks.screen(peer.peer_id, blob(peer, window=3), ctx(peer))
    assert s.held is not None
    seen: list[int] = []

    def codec_of(window: int) -> CodecConfig:
        seen.append(window)
        return CFG

    assert set(decode(s.held, SCHEMA, codec_of)) == set(SCHEMA) and seen == [3]
    # A contribution with another k than its window's codec is refused.
    assert checks.screen(peer.peer_id, blob(peer), ctx(peer, codec=CodecConfig(k=128))).reason == "wrong_codec"
