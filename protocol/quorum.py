"""Several validators, one chain: who proposes a window, when the next one takes over, what counts.

A run names n validator keys (``validator.public_keys``) and a quorum m (``validator.signing_quorum``).
An aggregate counts — peers apply it, the chain continues from it — once m distinct keys of the run
signed its digest (:mod:`protocol.wire.quorum`: the leader's proposal, the others' endorsements,
the certificate that bundles them). With n = m = 1 the one validator's aggregate is the chain, as
it always was, and nothing else of this module is used.

**Rotation.** Window t has views 0, 1, 2, …; the leader of view v is key ``(t + v) mod n`` of the
sorted keys, so consecutive windows start with different leaders and a leader that censors peers
does so only in its own turns. A validator waits ``handover_s`` (:func:`handover_s`) after it closed
the window's intake for the leader of view 0; with no proposal it can endorse by then, view 1 begins,
and so on, each view one ``handover_s`` longer than the one before: view v starts
``handover_s × v(v + 1)/2`` after the close (0, 1, 3, 6 … timeouts). Views that grow let a slow
but honest leader's proposal arrive before the next leader starts deciding a competing one, which
would split the honest signatures between two digests.

**Safety.** An honest validator signs at most one aggregate digest per window, and persists that it
did before the signature leaves it (:mod:`validator.signed`). Two quorums share at least 2m − n
validators; when at most f validators are faulty and 2m − n ≥ f + 1, every two quorums share an
honest one, so two different aggregates of one window never both count. Liveness needs m honest,
running validators. What a configuration tolerates (:func:`tolerance`):

====  ====  ==================  ====================
n     m     crashed (liveness)  lying (safety, f)
====  ====  ==================  ====================
1     1     0                   0
2     2     0                   0 (a fork needs both)
3     2     1                   0
4     3     1                   1
5     4     1                   1   (m = 3: 2 crashed, 0 lying)
7     5     2                   2
====  ====  ==================  ====================

f lying validators are tolerated in both respects when 2m − n ≥ f + 1 and m ≤ n − f, which
needs n ≥ 3f + 1 (n = 3f + 1: m = 2f + 1; n = 5: m = 4 for f = 1, m = 3 tolerates no lie).
``protocol.config`` rejects a quorum that two groups of honest validators could each reach
(2m ≤ n) or that no n validators can (m > n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.config import RunSpec
from protocol.events import AwaitingSignatures, describe
from protocol.identity import peer_id_of, public_key_from_hex

__all__ = ["Quorum", "Signatures", "Tolerance", "handover_s", "tolerance"]

MIN_HANDOVER_S = 10.0  # the derived handover timeout's floor (seconds)


@dataclass(frozen=True)
class Tolerance:
    """How many validators may be down (``crashed``: the run continues) and how many may lie
    (``lying``: no two aggregates of a window both count, and the run continues)."""

    crashed: int
    lying: int

    def describe(self) -> str:
        return f"continues with {self.crashed} validator(s) down; safe with {self.lying} lying"


def tolerance(n: int, m: int) -> Tolerance:
    """What ``m`` of ``n`` tolerates (module doc)."""
    crashed = max(0, n - m)
    return Tolerance(crashed=crashed, lying=max(0, min(crashed, 2 * m - n - 1)))


def handover_s(spec: RunSpec) -> float:
    """Seconds the validators give a view's leader to propose (``validator.handover_s`` or derived)."""
    return spec.validator.handover_s or max(MIN_HANDOVER_S, spec.windows.upload_deadline_s / 2)


@dataclass(frozen=True)
class Signatures:
    """What a reader waiting for aggregate ``window`` finds of its signatures: ``m`` of the ``n``
    validators must endorse one digest; ``endorsements`` is the most that one digest has so far,
    ``endorsed`` how many validators endorsed any (they differ only when validators disagree)."""

    window: int
    m: int
    n: int
    endorsements: int
    endorsed: int

    def event(self) -> AwaitingSignatures:
        """What a reader reports while it waits (:class:`protocol.events.AwaitingSignatures`)."""
        return AwaitingSignatures(
            window=self.window, quorum=self.m, validators=self.n, endorsements=self.endorsements, endorsed=self.endorsed
        )

    def describe(self) -> str:
        """ "waiting for 3 of 4 validators to sign aggregate 7 (2 endorsements so far)"."""
        return describe(self.event())


@dataclass(frozen=True)
class Quorum:
    """The validators of a run: ``keys`` (sorted hex public keys), ``m`` signatures needed."""

    keys: tuple[str, ...]
    m: int
    handover_s: float

    @classmethod
    def of(cls, spec: RunSpec) -> Quorum:
        return cls(tuple(sorted(spec.validator.public_keys)), spec.validator.signing_quorum, handover_s(spec))

    @property
    def n(self) -> int:
        return len(self.keys)

    @property
    def several(self) -> bool:
        """Whether aggregates travel as proposals, endorsements and certificates (any run but 1 of 1)."""
        return self.n > 1 or self.m > 1

    @property
    def ids(self) -> tuple[str, ...]:
        """The validators' ids (peer ids of their keys), in rotation order."""
        return tuple(peer_id_of(public_key_from_hex(k)) for k in self.keys)

    def index(self, validator_id: str) -> int:
        """The position of ``validator_id`` in the rotation; ValueError for a stranger."""
        return self.ids.index(validator_id)

    def leader(self, window: int, view: int) -> str:
        """The id of the validator that proposes ``window`` in ``view``."""
        return self.ids[(window + view) % self.n]

    def view_at(self, seconds_since_close: float) -> int:
        """The view a validator is in ``seconds_since_close`` after it closed a window's intake
        (view v begins at ``view_start(v)``)."""
        units = max(0.0, seconds_since_close / self.handover_s)
        view = int((math.sqrt(8 * units + 1) - 1) / 2)
        while self.view_start(view + 1) <= seconds_since_close:  # the square root's rounding
            view += 1
        while view > 0 and self.view_start(view) > seconds_since_close:
            view -= 1
        return view

    def view_start(self, view: int) -> float:
        """Seconds after the close at which ``view`` begins: each view lasts one handover longer."""
        return self.handover_s * view * (view + 1) / 2

    def first_view_of(self, window: int, validator_id: str) -> int:
        """The first view of ``window`` in which ``validator_id`` leads."""
        return (self.index(validator_id) - window) % self.n

    def tolerance(self) -> Tolerance:
        return tolerance(self.n, self.m)

    def quorate(self, signers: Sequence[str]) -> bool:
        """Whether ``signers`` (validator ids) are m distinct validators of the run."""
        return len(set(signers) & set(self.ids)) >= self.m
