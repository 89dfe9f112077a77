"""The one table of checks and rejection reasons (validator/reasons.py) and what derives from it:
the check order, the neutral set, the log's stored bit order, ``logs --help``, the docs table, and
every reason a ProtocolError or a check can write into the log. Also the one outcome shape
(protocol.outcomes.PeerOutcome) as the log, the published outcomes and the demo read it."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from protocol import errors
from protocol.identity import Identity
from protocol.outcomes import PeerOutcome, decode_outcomes, encode_outcomes, outcomes_digest, verdict
from validator import checks, gather, reasons, reputation, window_checks
from validator.log import CHECK_BITS, CheckRow, ContributionRecord, pack_checks, unpack_checks

ROOT = Path(__file__).resolve().parent.parent

# The log stores a row's checks as a bit mask over CHECK_BITS: these positions never move.
STORED_BITS = (
    "size",
    "format",
    "signature",
    "run",
    "window",
    "registered",
    "codec",
    "schema",
    "finite",
    "sync",
    "excluded",
    "immutable",
    "norm",
    "copy",
    "score",
    "probation",
    "capacity",
    "stable",
    "fetch",
    "deadline",
)


def test_the_logs_bit_positions_never_move_and_cover_every_check() -> None:
    assert CHECK_BITS[: len(STORED_BITS)] == STORED_BITS  # append-only
    names = [c.name for c in reasons.CHECKS]
    assert len(set(names)) == len(names)
    assert set(names) <= set(CHECK_BITS), set(names) - set(CHECK_BITS)
    # the checks run in stored-bit order, so a row in the usual form packs into one mask
    order = [CHECK_BITS.index(n) for n in reasons.CHECK_ORDER]
    assert order == sorted(order)
    rows = (*(CheckRow(n, True) for n in reasons.CHECK_ORDER[:-1]), CheckRow(reasons.CHECK_ORDER[-1], False, "x"))
    packed = pack_checks(rows, "x")
    assert packed is not None and unpack_checks(*packed, "x") == rows


def test_the_derived_sets_are_what_they_were() -> None:
    assert checks.CHECK_ORDER == reasons.CHECK_ORDER == STORED_BITS[:18]
    assert reputation.NEUTRAL == reasons.NEUTRAL
    assert reasons.NEUTRAL == {
        "excluded",
        "late",
        "foreign",
        "over_capacity",
        "over_budget",
        "probation",
        "norm_tiny",
    }
    assert reasons.UNATTRIBUTABLE_CHECKS == {"fetch", "size", "format", "signature"}


def test_every_reason_names_known_checks_once() -> None:
    known = {c.name for c in reasons.CHECKS}
    names = [r.name for r in reasons.REASONS]
    assert len(set(names)) == len(names)
    for r in reasons.REASONS:
        assert r.checks and set(r.checks) <= known, r
        assert r.description and "\n" not in r.description, r
    assert all(any(c.name in r.checks for r in reasons.REASONS) for c in reasons.CHECKS)  # each check can fail


def _protocol_errors(cls: type[errors.ProtocolError]) -> list[type[errors.ProtocolError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _protocol_errors(sub)
    return out


def test_every_reason_a_protocol_error_carries_is_in_the_table() -> None:
    # The errors decoding and the validator's checks raise. Those that answer other requests — a
    # peer's own (client/: NotReady …), the grant desk's refusals (protocol/store/), the
    # dashboard's bad queries — never reach the log, and whether they are loaded at all depends on
    # which tests ran before this one.
    answers = ("client", "protocol.store", "validator.dashboard")
    carried = {
        cls.reason
        for cls in _protocol_errors(errors.ProtocolError)
        if not any(cls.__module__ == a or cls.__module__.startswith(a + ".") for a in answers)
    }
    # reasons given at the raise (``SchemaMismatch(..., reason="wrong_codec")``)
    for path in (ROOT / "protocol").rglob("*.py"):
        carried |= set(re.findall(r"\breason=\"([a-z_]+)\"\)", path.read_text(encoding="utf-8")))
    carried -= {"config_error"}  # a ConfigError event reason, not a ProtocolError
    missing = {r for r in carried if r not in {x.name for x in reasons.REASONS}}
    assert missing == set()
    for name in carried:
        r = reasons.reason(name)
        assert r.checks[0] in reasons.CHECK_ORDER, r  # rows_for_error places it in the order
        rows = checks.rows_for_error(name)
        assert rows[-1] == CheckRow(r.checks[0], False, name)
        signed = checks.rows_for_error(name, signed=True)[-1]
        assert signed.name in r.checks, (name, signed)


def test_the_decode_mapping_is_what_it_was() -> None:
    before = {
        "too_large": "size",
        "malformed": "format",
        "unsupported_version": "format",
        "bad_signature": "signature",
        "unknown_signer": "signature",
        "wrong_run": "run",
        "wrong_window": "window",
        "schema_mismatch": "schema",
        "invalid_indices": "schema",
        "non_finite": "finite",
        "stale_base": "sync",
        "digest_mismatch": "format",
        "wrong_codec": "codec",
        "something_new": "format",
    }
    assert {r: checks.rows_for_error(r)[-1].name for r in before} == before


def test_every_reason_a_check_writes_is_in_the_table_at_that_check() -> None:
    literal = re.compile(r"(?:fail|CheckRow)\(\"([a-z_]+)\",(?: False,)? \"([a-z_]+)\"\)")
    found = set()
    for path in (ROOT / "validator").glob("*.py"):
        found |= set(literal.findall(path.read_text(encoding="utf-8")))
    found |= {
        ("immutable", window_checks.MUTATED),
        ("probation", window_checks.PROBATION),
        ("capacity", window_checks.OVER_CAPACITY),
        ("stable", window_checks.NON_FINITE_RESULT),
        ("fetch", gather.OVER_BUDGET),
        ("fetch", gather.FETCH_TIMEOUT),
        ("fetch", "not_found"),
        ("fetch", "store_error"),
        ("excluded", gather.EXCLUDED),
        ("deadline", reputation.LATE),
    }
    # the score check writes the reason of its verdict (validator/significance.py)
    verdict = re.compile(r"Verdict\(\"([a-z_]+)\"")
    found |= {("score", name) for name in verdict.findall((ROOT / "validator" / "significance.py").read_text())}
    assert len(found) > 20
    for check, name in found:
        assert check in reasons.reason(name).checks, (check, name)


def test_logs_help_lists_every_reason_with_its_mark() -> None:
    from validator.cli import cli

    out = CliRunner().invoke(cli, ["logs", "--help"], terminal_width=200).output
    listed = re.findall(r"^ {4}([a-z_]+)(\*|\(\*\))?\s", out.split("Rejection reasons", 1)[1], re.MULTILINE)
    assert [name for name, _ in listed] == [r.name for r in reasons.REASONS]
    for name, mark in listed:
        r = reasons.reason(name)
        assert (mark == "*") == (reasons.neutral_at(r) == r.checks), name


def test_the_docs_table_is_the_generated_one() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    found = re.search(
        r"<!-- reasons: generated by python -m validator.reasons -->\n(.*?)\n<!-- /reasons -->", text, re.S
    )
    assert found is not None
    assert found.group(1) == reasons.markdown_table(), "run `python -m validator.reasons` and paste its table"


# ---------------------------------------------------------------------- one outcome shape
def test_a_log_row_projects_to_the_outcome_reputation_folds_and_peers_read() -> None:
    row = ContributionRecord(
        window=4,
        peer="p",
        accepted=False,
        reason="copied",
        score=0.5,
        reputation=-0.2,
        weight=0.0,
        digest="ab" * 32,
        checks=(CheckRow("size", True), CheckRow("copy", False, "copied")),
    )
    o = row.outcome()
    assert o == PeerOutcome("p", False, "copied", 0.5, -0.2, window=4, check="copy", weight=0.0)
    assert not reputation.is_neutral(o)
    # too_large is neutral at the read's size check, not in a body the peer signed
    at_size = ContributionRecord(window=4, peer="p", reason="too_large", checks=(CheckRow("size", False, "too_large"),))
    signed = ContributionRecord(
        window=4, peer="p", reason="too_large", checks=(CheckRow("schema", False, "too_large"),)
    )
    assert reputation.is_neutral(at_size.outcome()) and not reputation.is_neutral(signed.outcome())
    assert verdict(o) == {"accepted": False, "reason": "copied", "score": 0.5, "reputation": -0.2}
    assert verdict(None) == {"accepted": None, "reason": None, "score": None, "reputation": None}


def test_published_outcomes_carry_only_the_five_wire_fields() -> None:
    peer = Identity.generate().peer_id
    full = PeerOutcome(peer, True, None, 0.01, 0.19, window=3, check=None, weight=1.0)
    blob = encode_outcomes("ab" * 32, 3, [full])
    assert blob == encode_outcomes("ab" * 32, 3, [PeerOutcome(peer, True, None, 0.01, 0.19)])
    assert blob == (
        b'{"outcomes":[{"accepted":true,"peer":"' + peer.encode() + b'","reason":null,"reputation":0.19,'
        b'"score":0.01}],"run_hash":"' + b"ab" * 32 + b'","window":3}'
    )
    table = decode_outcomes(blob, digest=outcomes_digest(blob), run_hash="ab" * 32, window=3)
    assert table.get(peer) == PeerOutcome(peer, True, None, 0.01, 0.19)


def test_the_demo_reads_a_logs_json_row_as_its_outcome() -> None:
    from client.demo.validator_log import _outcome

    row = ContributionRecord(
        window=2,
        peer="p",
        accepted=False,
        reason="stale_base",
        weight=0.0,
        checks=(CheckRow("size", True), CheckRow("sync", False, "stale_base")),
    )
    flat = row.to_json()
    flat["checks"] = ";".join(f"{k}:{v}" for k, v in flat["checks"].items())  # as `logs --json` prints it
    assert _outcome(flat) == row.outcome()
