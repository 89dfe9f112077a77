"""Every check and every rejection reason the validator writes into the contribution log, in one table.

A contribution's row in the log names the check that failed and a stable snake_case *reason*.
:data:`CHECKS` lists the checks: the read (``fetch``), the per-contribution checks
(:mod:`validator.checks`, ``size`` … ``excluded``), the checks over the whole window
(:mod:`validator.window_checks`, ``immutable`` … ``stable``) and ``deadline`` (an upload after the
window closed); the ``contribution`` and ``window`` ones, in this order, are
:data:`CHECK_ORDER`, the order in which the first failure decides the rejection. :data:`REASONS`
lists every reason, the checks that can give it, whether it is *neutral* (never held against the
peer, :mod:`validator.reputation`) and what it means. A failure of a check that is not
``attributable`` (the read, or bytes the peer's signature does not cover) is neutral whatever its
reason.

Derived from these tables: :data:`CHECK_ORDER`, :data:`NEUTRAL`, :data:`UNATTRIBUTABLE_CHECKS`,
the list of reasons in ``sparseloco-validator logs --help`` (:func:`help_text`) and the table in
docs/ARCHITECTURE.md (:func:`markdown_table`; ``python -m validator.reasons`` prints it). The
log's stored bit order of checks (:data:`validator.log.CHECK_BITS`) is append-only and kept there.

A new reason is one :class:`Reason` row here (its check emits it); a new check is one
:class:`Check` row here in its turn, one name appended to ``CHECK_BITS``, and the check itself.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

__all__ = [
    "CHECKS",
    "CHECK_ORDER",
    "EXCLUDED",
    "FETCH_TIMEOUT",
    "FOREIGN",
    "LATE",
    "MUTATED",
    "NEUTRAL",
    "NON_FINITE_RESULT",
    "OVER_BUDGET",
    "OVER_CAPACITY",
    "PROBATION",
    "REASONS",
    "UNATTRIBUTABLE_CHECKS",
    "Check",
    "Reason",
    "help_text",
    "markdown_table",
    "neutral_at",
    "reason",
]


@dataclass(frozen=True)
class Check:
    """One check. ``stage``: ``read`` (fetching the bytes), ``contribution`` (one upload on its own),
    ``window`` (needs the whole window, the log or the loss evaluation) or ``deadline``.
    ``attributable``: a failure can be the peer's own (False: the store's, or bytes the peer did
    not sign)."""

    name: str
    stage: str
    attributable: bool
    description: str


@dataclass(frozen=True)
class Reason:
    """One rejection reason: the checks that give it (the usual one first), whether it is neutral
    (never held against the peer, whichever check gave it) and what it means."""

    name: str
    checks: tuple[str, ...]
    neutral: bool
    description: str


CHECKS: tuple[Check, ...] = (
    Check("fetch", "read", False, "the bytes at the peer's key were read within the window's budgets"),
    Check("size", "contribution", False, "the object is not empty and within the run's size cap"),
    Check("format", "contribution", False, "the bytes are a signed envelope that parses"),
    Check("signature", "contribution", False, "the envelope is signed by the peer whose key it is at"),
    Check("run", "contribution", True, "signed for this run"),
    Check("window", "contribution", True, "signed for this window"),
    Check("registered", "contribution", True, "the peer published a signed announcement"),
    Check("codec", "contribution", True, "encoded with the run's codec parameters"),
    Check("schema", "contribution", True, "the body the peer signed decodes to a subset of the model's tensors"),
    Check("finite", "contribution", True, "every value is finite"),
    Check("sync", "contribution", True, "trained from the current aggregate"),
    Check("excluded", "contribution", True, "the peer is not serving an exclusion"),
    Check("immutable", "window", True, "the bytes are the ones first read at that key"),
    Check("norm", "window", True, "tensor norms against the validator's reference"),
    Check("copy", "window", True, "not a near-copy of an upload read before it"),
    Check("score", "window", True, "the update lowers the loss (when it is scored)"),
    Check("probation", "window", True, "a new identity counts only when its update was scored"),
    Check("capacity", "window", True, "at most max_contributors are kept"),
    Check("stable", "window", True, "the aggregate with it keeps θ and the validation loss finite"),
    Check("deadline", "deadline", True, "uploaded before the window closed"),
)

FOREIGN = "foreign"
EXCLUDED = "excluded"
FETCH_TIMEOUT = "fetch_timeout"
OVER_BUDGET = "over_budget"
MUTATED = "mutated"
PROBATION = "probation"
OVER_CAPACITY = "over_capacity"
NON_FINITE_RESULT = "non_finite_result"
LATE = "late"

_SIGNED_BODY = "(in a body the peer signed: check schema)"

REASONS: tuple[Reason, ...] = (
    Reason(
        FOREIGN,
        ("size", "format", "signature", "run", "window"),
        True,
        "bytes at the peer's key that the peer did not sign for this run and window: too large, not an "
        "envelope, a bad signature, signed by another key, or its own object of another run or window",
    ),
    Reason("not_found", ("fetch",), False, "the store had no object at the listed key when it was read"),
    Reason("store_error", ("fetch",), False, "the store failed while the object was read"),
    Reason(FETCH_TIMEOUT, ("fetch",), False, "the read did not finish in fetch_timeout_s after the close"),
    Reason(OVER_BUDGET, ("fetch",), True, "beyond the window's read budget (keys or bytes)"),
    Reason("too_large", ("size", "schema"), False, f"over the run's size cap {_SIGNED_BODY}"),
    Reason("empty", ("size",), False, "an empty object"),
    Reason("malformed", ("format", "schema"), False, f"the structure does not parse {_SIGNED_BODY}"),
    Reason("unsupported_version", ("format", "schema"), False, f"unknown magic, version or kind {_SIGNED_BODY}"),
    Reason("digest_mismatch", ("format", "schema"), False, f"content does not match its hash {_SIGNED_BODY}"),
    Reason("protocol_error", ("format", "schema"), False, f"another break of the protocol {_SIGNED_BODY}"),
    Reason("bad_signature", ("signature", "schema"), False, f"the signature does not verify {_SIGNED_BODY}"),
    Reason(
        "unknown_signer",
        ("signature", "schema"),
        False,
        f"a valid signature by a key not allowed to sign it {_SIGNED_BODY}",
    ),
    Reason(
        "no_quorum",
        ("signature", "schema"),
        False,
        f"fewer validators' endorsements than the run's quorum {_SIGNED_BODY}",
    ),
    Reason(
        "uncertified",
        ("format", "schema"),
        False,
        f"a checkpoint no certificate of the run vouches for {_SIGNED_BODY}",
    ),
    Reason("wrong_run", ("run",), False, "signed by the peer for another run"),
    Reason("wrong_window", ("window",), False, "signed by the peer for another window"),
    Reason("unregistered", ("registered",), False, "no signed announcement of this peer"),
    Reason("wrong_codec", ("codec",), False, "codec parameters differ from the run's"),
    Reason("schema_mismatch", ("schema",), False, "unknown, missing or duplicate tensors, or shapes that differ"),
    Reason("empty_contribution", ("schema",), False, "no tensors at all"),
    Reason("invalid_indices", ("schema",), False, "indices out of range, unsorted, duplicate or miscounted"),
    Reason("non_finite", ("finite",), False, "NaN or Inf among the values"),
    Reason("stale_base", ("sync",), False, "trained from another aggregate than the current one"),
    Reason(EXCLUDED, ("excluded",), True, "the peer is serving an exclusion for repeated failures"),
    Reason(MUTATED, ("immutable",), False, "other bytes than the ones first read, signed by the peer"),
    Reason("norm_outlier", ("norm",), False, "a tensor above norm_max_ratio x the validator's reference"),
    Reason("norm_tiny", ("norm",), True, "an update below norm_min_ratio x the reference: does not count"),
    Reason(
        "copied",
        ("copy",),
        False,
        "shares the values of an upload read before its key appeared (index or rare-position overlap, agreeing signs)",
    ),
    Reason("harmful", ("score",), False, "does not lower the loss on the peer's own data"),
    Reason("harmful_general", ("score",), False, "raises the loss on held-out data"),
    Reason("targeted", ("score",), False, "promotes the tokens whose rows it moves most, on held-out data"),
    Reason("ineffective", ("score",), False, "lowers it far less than established peers' updates do"),
    Reason(PROBATION, ("probation",), True, "a new identity whose update was not scored in this window"),
    Reason(OVER_CAPACITY, ("capacity",), True, "more than max_contributors passed"),
    Reason(NON_FINITE_RESULT, ("stable",), False, "with it the aggregate makes θ or the loss non-finite"),
    Reason(LATE, ("deadline",), True, "uploaded after the window closed"),
)

_BY_NAME = {r.name: r for r in REASONS}

# the order the checks run in; the first failure decides the rejection reason
CHECK_ORDER: tuple[str, ...] = tuple(c.name for c in CHECKS if c.stage in ("contribution", "window"))
# rejections that say nothing about the peer
NEUTRAL: frozenset[str] = frozenset(r.name for r in REASONS if r.neutral)
# checks whose failure concerns bytes the peer's signature does not cover (or the store)
UNATTRIBUTABLE_CHECKS: frozenset[str] = frozenset(c.name for c in CHECKS if not c.attributable)


def reason(name: str) -> Reason:
    """The row of reason ``name``; KeyError for a name the table lacks."""
    return _BY_NAME[name]


def neutral_at(r: Reason) -> tuple[str, ...]:
    """The checks at which reason ``r`` is neutral: all of them for a neutral reason, else those
    that are not attributable."""
    return r.checks if r.neutral else tuple(c for c in r.checks if c in UNATTRIBUTABLE_CHECKS)


def _mark(r: Reason) -> str:
    """``*``: never held against the peer; ``(*)``: not at some of its checks (the read, the envelope)."""
    at = neutral_at(r)
    return "*" if at == r.checks else "(*)" if at else ""


def help_text() -> str:
    """The list of reasons in ``sparseloco-validator logs --help`` (click's ``\\b``: kept as laid out)."""
    lines = [
        "\b",
        "Rejection reasons and their checks (* = never held against the peer; (*) = not when",
        "the check is fetch, size, format or signature: the store's or someone else's bytes):",
    ]
    for r in REASONS:
        head = f"  {r.name + _mark(r):<23} {'/'.join(r.checks)}"
        if len(head) > 43:  # a long list of checks gets a line of its own
            lines.append(head)
            head = ""
        lines.extend(
            textwrap.wrap(
                r.description, 92, initial_indent=f"{head:<44}", subsequent_indent=" " * 44, break_on_hyphens=False
            )
        )
    return "\n".join(lines)


def markdown_table() -> str:
    """The reasons as the Markdown table in docs/ARCHITECTURE.md."""
    rows = ["| reason | check | neutral | meaning |", "|---|---|---|---|"]
    for r in REASONS:
        at = neutral_at(r)
        neutral = "yes" if at == r.checks else f"at {', '.join(at)}" if at else "no"
        checks = ", ".join(f"`{c}`" for c in r.checks)
        rows.append(f"| `{r.name}` | {checks} | {neutral} | {r.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
