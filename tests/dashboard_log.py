"""A small contribution log written by the real ContributionLog, as a validator writes one: a few
windows of decided rows (accepted, rejected for several reasons, one peer whose id and detail are
markup), the last window decided but not published, and uploads read in the window now open."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from validator.log import AgreementRecord, CheckRow, ContributionLog, ContributionRecord, WindowRecord

PEERS = (
    "k7n2q4xw3bvd5mfa6hzq2rpt4syc7ue3",
    "a2b4c6d7e3f5g2h4j6k7m3n5p2q4r6s7",
    "z7y6x5w4v3u2t7s6r5q4p3o2n7m6l5k4",
    "q2w3e4r5t6y7u2i3o4p5a6s7d2f3g4h5",
)
EVIL = '<script>alert("x")</script>&"\''  # the log holds whatever it was given; nothing of it may run
T0 = 1_750_000_000.0
WINDOW_S = 120.0
VALIDATORS = (
    "v1aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "v2bbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    "v3cccccccccccccccccccccccccccccc",
)
LIAR_WINDOW = 3  # with several validators: the leader of view 0 lies here, two object, view 1 is certified


@dataclass(frozen=True)
class Built:
    """What the log holds: per peer its (windows, accepted) counts; rejections per reason."""

    path: Path
    windows: int  # decided window rows, 0 .. windows - 1
    open_window: int
    counts: dict[str, tuple[int, int]]
    reasons: dict[str, int]
    val_loss: list[float]
    pending: tuple[str, ...]  # peers whose upload to the open window was read
    agreement: dict[int, tuple[str, int, tuple[str, ...]]]  # window -> (leader, view, signers); several validators


def _row(
    w: int, peer: str, i: int, accepted: bool, reason: str | None = None, detail: str | None = None
) -> ContributionRecord:
    score = 0.02 * (i + 1) - 0.01 * (w % 3) if accepted else None
    return ContributionRecord(
        window=w,
        peer=peer,
        bytes=17_000 + 37 * i,
        digest=f"{w:032x}{i:032x}",
        accepted=accepted,
        reason=reason,
        detail=detail or (None if accepted else f"rejected: {reason}"),
        norm=1.0 + 0.1 * i,
        loss_own_before=5.0 - 0.4 * w,
        loss_own_after=4.9 - 0.4 * w if accepted else None,
        score=score,
        reputation=0.1 * w * (1 if accepted else -1),
        weight=1.0 if accepted else 0.0,
        checks=(CheckRow("size", True), CheckRow("norm", accepted, None if accepted else reason)),
    )


def agreement_steps(w: int, opened: float) -> tuple[list[AgreementRecord], tuple[str, int, tuple[str, ...]]]:
    """Window ``w``'s agreement among :data:`VALIDATORS` (2 of 3 sign): the leader of view 0
    proposes and the others endorse; in :data:`LIAR_WINDOW` the two others object (one reason is
    markup), the next leader takes over in view 1 and is certified. (steps, (leader, view, signers))"""
    n, at = len(VALIDATORS), opened + WINDOW_S - 4
    view = 1 if w == LIAR_WINDOW else 0
    steps: list[AgreementRecord] = []
    if view:
        liar = VALIDATORS[w % n]
        steps.append(AgreementRecord(window=w, validator=liar, event="proposed", digest="bad" * 21 + "b", at=at))
        for i, other in enumerate(v for v in VALIDATORS if v != liar):
            reason = f"delta -: Δ̄ differs from the re-computed one by {4 + i}x" if i == 0 else f"caps {EVIL}: {EVIL}"
            steps.append(
                AgreementRecord(
                    window=w, validator=other, event="objected", digest="bad" * 21 + "b", detail=reason, at=at + 1
                )
            )
    leader = VALIDATORS[(w + view) % n]
    digest = f"{w:064x}"
    if view:
        steps.append(AgreementRecord(window=w, validator=leader, event="handover", view=view, at=at + 2))
    steps.append(AgreementRecord(window=w, validator=leader, event="proposed", digest=digest, view=view, at=at + 3))
    signers = tuple(sorted([leader, VALIDATORS[(w + view + 1) % n]]))
    for s in signers:
        steps.append(AgreementRecord(window=w, validator=s, event="endorsed", digest=digest, view=view, at=at + 4))
    steps.append(
        AgreementRecord(
            window=w, validator=leader, event="certified", digest=digest, view=view, detail=",".join(signers), at=at + 5
        )
    )
    return steps, (leader, view, signers)


def build_log(path: Path, *, windows: int = 8, markup_peer: bool = True, several: bool = False) -> Built:
    """Write ``windows`` decided windows (all published but the last) and two uploads read in the
    open window; with ``markup_peer`` a peer whose id and details are markup (EVIL) sends in every
    other window; with ``several`` the published windows' agreement among three validators
    (:func:`agreement_steps`). Returns what a reader must find."""
    agreement: dict[int, tuple[str, int, tuple[str, ...]]] = {}
    reasons_cycle = ("harmful", "norm_outlier", "copied")
    counts: dict[str, tuple[int, int]] = {}
    reasons: dict[str, int] = {}
    losses: list[float] = []
    with ContributionLog(path) as log:
        for w in range(windows):
            opened = T0 + w * WINDOW_S
            rows: list[ContributionRecord] = []
            for i, peer in enumerate(PEERS):
                if i == 3 and w < 2:
                    continue  # a later joiner: first seen in window 2
                rejected = (i + w) % 4 == 0
                reason = reasons_cycle[w % 3] if rejected else None
                log.note_received(w, peer, received_at=opened + 10 + i, nbytes=17_000)
                rows.append(_row(w, peer, i, not rejected, reason))
            if (
                markup_peer and w % 2 == 1
            ):  # a peer whose id and detail are markup, rejected for a reason that is markup too
                rows.append(_row(w, EVIL, 9, False, "foreign", detail=EVIL))
            for r in rows:
                n, a = counts.get(r.peer, (0, 0))
                counts[r.peer] = (n + 1, a + int(r.accepted))
                if not r.accepted and r.reason:
                    reasons[r.reason] = reasons.get(r.reason, 0) + 1
            loss = round(4.9 - 2.6 * (1 - 0.72**w), 4)
            losses.append(loss)
            accepted = sum(r.accepted for r in rows)
            log.record_window(
                WindowRecord(
                    window=w,
                    opened_at=opened,
                    closed_at=opened + WINDOW_S - 5,
                    base=f"{w:064x}",
                    fingerprint=f"{w + 1:064x}",
                    val_loss=loss,
                    accepted=accepted,
                    rejected=len(rows) - accepted,
                    unannounced=w % 3,
                ),
                rows,
            )
            if w < windows - 1:
                if several:
                    steps, agreement[w] = agreement_steps(w, opened)
                    log.record_agreement(steps)
                log.mark_published(w, digest=f"{w:064x}", published_at=opened + WINDOW_S - 2)
        pending = PEERS[:2]
        for i, peer in enumerate(pending):
            log.note_received(windows, peer, received_at=T0 + windows * WINDOW_S + 5 + i, nbytes=17_100)
    return Built(
        path=path,
        windows=windows,
        open_window=windows,
        counts=counts,
        reasons=reasons,
        val_loss=losses,
        pending=pending,
        agreement=agreement,
    )
