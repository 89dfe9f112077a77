"""Where a run stands, read from its store (``sparseloco status``), and whether this peer agrees.

    status = run_status(spec, store, state_dir=Path("~/.sparseloco/<run id>").expanduser())
    status.head.window, status.head.digest      # the newest signed aggregate
    status.peers                                # its window's peers (PeerOutcome): accepted or not, why, score
    status.local.matches                        # True: this peer's θ is the chain's θ

The **head** is the newest aggregate in the store signed by one of the run's validator keys (its
window, digest, ``published_at``, the fingerprint of θ after it). The **peers** of that window come
from the aggregate's manifest (the accepted contributions) and, when the validator published them,
its outcomes (:mod:`protocol.outcomes`: every uploader, accepted or rejected with a reason, its loss
score and reputation). The **local** check reads the peer state directory's ``windows.jsonl``
(:mod:`client.state`: one JSON object per applied aggregate, ``{"window", "aggregate" (its digest),
"fingerprint" (θ after it), "included", "weight", "accepted", "reason", "score", "reputation",
"time"}``) and compares its last record with the chain's aggregate of that window: the same digest
and fingerprint mean this peer holds the swarm's θ (bit-identical).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from protocol import layout
from protocol.config import RunSpec
from protocol.errors import MalformedPayload, ObjectNotFound, ProtocolError, StoreError
from protocol.outcomes import PeerOutcome, read_outcomes
from protocol.replay import Chain
from protocol.store.base import ObjectStore
from protocol.wire import Aggregate, Verified

__all__ = ["Head", "LocalPeer", "RunStatus", "run_status"]

WINDOWS_FILE = "windows.jsonl"  # client.state.LocalState.log_path (that module loads torch)


@dataclass(frozen=True)
class Head:
    """The newest signed aggregate: window ``window + 1`` opened at ``published_at``."""

    window: int
    digest: str
    published_at: float
    fingerprint: str
    accepted: int
    rejected: int | None
    val_loss: float | None


@dataclass(frozen=True)
class LocalPeer:
    """This machine's peer: its last applied window and whether it matches the chain there
    (``matches`` None: the chain has no aggregate of that window to compare with)."""

    peer_id: str | None
    window: int | None = None
    fingerprint: str | None = None
    matches: bool | None = None
    detail: str = ""


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    run_hash: str
    store: str
    head: Head | None = None
    head_error: str | None = None
    checkpoint: dict[str, Any] | None = None
    peers: list[PeerOutcome] = field(default_factory=list)  # of the head's window
    outcomes: str = "none"  # published | none (the aggregate names none) | an error
    local: LocalPeer | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_status(
    spec: RunSpec, store: ObjectStore, *, store_url: str, state_dir: Path | None, peer_id: str | None
) -> RunStatus:
    """The run's status in ``store`` (see the module docstring); ``state_dir``: a peer's state."""
    run_hash = spec.hash()
    run = layout.run_id(run_hash)
    windows = _windows(store, layout.aggregate_prefix(run), run, "aggregate")
    head_agg, head_error = None, None
    for window in reversed(windows):  # the newest one that verifies
        try:
            head_agg = _aggregate(spec, store, window)
        except ProtocolError as exc:
            head_error = head_error or f"aggregate {window}: {exc}"
            continue
        if head_agg is not None:
            break
    status = RunStatus(run, run_hash, store_url, head_error=head_error, checkpoint=_checkpoint(spec, store, run))
    if head_agg is not None:
        peers, outcomes = _peers(store, run, head_agg)
        status = replace(status, head=_head(head_agg), peers=peers, outcomes=outcomes)
    if state_dir is not None:
        status = replace(status, local=_local(spec, store, state_dir, peer_id))
    return status


def _windows(store: ObjectStore, prefix: str, run: str, kind: str) -> list[int]:
    found = set()
    for key in store.list(prefix):
        try:
            parsed = layout.parse_key(key, run=run)
        except MalformedPayload:
            continue  # a stray key names no window
        if parsed.kind == kind and parsed.window is not None:
            found.add(parsed.window)
    return sorted(found)


def _aggregate(spec: RunSpec, store: ObjectStore, window: int) -> Verified[Aggregate] | None:
    return Chain(spec, store).aggregate(window)


def _head(agg: Verified[Aggregate]) -> Head:
    a = agg.value
    rejected, val_loss = a.metadata.get("rejected"), a.metadata.get("val_loss")
    return Head(
        window=a.window,
        digest=agg.digest,
        published_at=a.published_at,
        fingerprint=a.fingerprint,
        accepted=len(a.manifest),
        rejected=rejected if isinstance(rejected, int) and not isinstance(rejected, bool) else None,
        val_loss=float(val_loss) if isinstance(val_loss, (int, float)) and not isinstance(val_loss, bool) else None,
    )


def _peers(store: ObjectStore, run: str, agg: Verified[Aggregate]) -> tuple[list[PeerOutcome], str]:
    """The head window's peers: the manifest's (accepted, with their weight), then every row of the
    outcomes the aggregate vouches for (``score``/``reputation``/``reason``)."""
    w = agg.value.window
    weights = {m.peer_id: m.weight for m in agg.value.manifest}
    rows = {p: PeerOutcome(p, True, window=w, weight=weight) for p, weight in weights.items()}
    try:
        table = read_outcomes(store, run, agg)
    except (ProtocolError, StoreError) as exc:
        return sorted(rows.values(), key=lambda r: r.peer), f"unreadable: {exc}"
    if table is None:
        return sorted(rows.values(), key=lambda r: r.peer), "none"
    for peer, o in table.rows.items():
        rows[peer] = replace(o, window=w, weight=weights.get(peer, 0.0))
    return sorted(rows.values(), key=lambda r: (not r.accepted, r.peer)), "published"


def _checkpoint(spec: RunSpec, store: ObjectStore, run: str) -> dict[str, Any] | None:
    """The newest checkpoint manifest that verifies (with several validators: that the certificate
    of the aggregate before it vouches for, :meth:`protocol.replay.Chain.manifest`): window,
    published_at, fingerprint, bytes."""
    chain = Chain(spec, store)
    for window in reversed(_windows(store, layout.checkpoints_prefix(run), run, "checkpoint")):
        try:
            v = chain.manifest(window)
        except (ProtocolError, StoreError):
            continue  # an unfinished, foreign or uncertified checkpoint: the one before it is the last good one
        m = v.value
        return {
            "window": m.window,
            "published_at": m.published_at,
            "fingerprint": m.fingerprint,
            "bytes": sum(f.size for f in m.files),
        }
    return None


def _local(spec: RunSpec, store: ObjectStore, state_dir: Path, peer_id: str | None) -> LocalPeer:
    path = state_dir / WINDOWS_FILE
    if not path.exists():
        return LocalPeer(peer_id, detail=f"no {WINDOWS_FILE} in {state_dir}: this peer has applied no aggregate")
    last: dict[str, Any] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            last = json.loads(line)
    if last is None:
        return LocalPeer(peer_id, detail=f"{path} is empty")
    window, digest, fp = int(last["window"]), str(last["aggregate"]), str(last["fingerprint"])
    try:
        chain = _aggregate(spec, store, window)
    except (ProtocolError, ObjectNotFound) as exc:
        return LocalPeer(peer_id, window, fp, None, f"the chain's aggregate {window} does not verify: {exc}")
    if chain is None:
        return LocalPeer(peer_id, window, fp, None, f"the store holds no aggregate {window}")
    same = chain.digest == digest and chain.value.fingerprint == fp
    detail = (
        f"θ after window {window} matches the chain"
        if same
        else f"θ after window {window} differs from the chain (aggregate {chain.digest[:16]}, "
        f"fingerprint {chain.value.fingerprint[:16]})"
    )
    return LocalPeer(peer_id, window, fp, same, detail)
