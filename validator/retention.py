"""Retention: which objects of a run the validator deletes, so that its store stops growing.

Nothing in the protocol ever needs an old contribution, and a late joiner needs only the newest
checkpoint and the aggregates after it (:mod:`client.peer.sync`), yet every window adds N contributions,
one aggregate and, every ``checkpoint_every`` windows, a full fp32 θ. A retention policy is a local
choice of the validator (never part of the RunSpec: peers do not care how long objects are kept)::

    policy = Retention(windows=16, checkpoint_every=100)
    plan = plan_collection(store, run, run_hash, current=state.window, policy=policy, signers=keys)
    collect(store, plan)                      # deletes plan.delete, in order

With ``current`` the window the validator is at (aggregates ``< current`` are published) and the
*horizon* ``h = current − windows``:

* contributions of windows ``< h`` are deleted: the validator reads only the current window and the
  one before it (late uploads);
* the *anchor* is the newest checkpoint at a window ``≤ h`` whose signed manifest verifies,
  belongs to the store's launch and whose files have the sizes and sha256 it signed (genesis when
  there is none). Aggregates before the anchor are
  deleted, and so are checkpoints before it, except genesis (the root of the chain) and every
  ``checkpoint_every``-th (archival snapshots, 0: none);
* everything else stays: every checkpoint after the anchor (so the newest one), every aggregate
  from the anchor on, the dataset, announcements and anything that is not a layout key.

So a joiner always finds the newest checkpoint and every aggregate after it, and a peer that began
catching up from any checkpoint less than ``windows`` windows ago finds every aggregate it still has
to replay: only a checkpoint at least that old, with a newer one also at least that old, loses the
aggregates after it. A checkpoint is deleted manifest first, then its files (the reverse of
publishing: a manifest never names a missing file).

With several validators (:mod:`protocol.quorum`) a checkpoint ``w`` is trusted only through the
certificate of aggregate ``w − 1`` (:func:`protocol.chain.read_manifest`): that aggregate stays with
every checkpoint kept (the anchor's too), a checkpoint no certificate vouches for is never an
anchor, and the proposals, endorsements and objections of windows ``< h`` go with the contributions.

The validator applies its policy after each publish (:meth:`validator.commit.Committer.advance`),
at most ``max_deletes`` keys a window so that turning retention on for a long run spreads the
backlog over the next windows; ``sparseloco-validator gc`` applies it at once (or shows it with
``--dry-run``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Iterable, MutableSet, Sequence
from dataclasses import dataclass

from protocol import layout
from protocol.chain import checkpoint_base, read_aggregate, read_launch, read_manifest
from protocol.errors import ConfigError, MalformedPayload, ObjectNotFound, ProtocolError, StoreError
from protocol.store.base import ObjectStore
from protocol.wire import CheckpointFile

__all__ = ["MIN_WINDOWS", "Plan", "Retention", "collect", "plan_collection", "published_window"]

log = logging.getLogger(__name__)

#: The fewest windows a policy may keep: the validator reads the contributions of the window it
#: gathers and of the one before it (uploads that arrived late).
MIN_WINDOWS = 2

Signers = Collection[bytes | str]
#: Told of a store object that failed verification: (key, reason, detail).
Rejected = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Retention:
    """``windows``: keep contributions and aggregates of the last N windows (0: keep everything,
    the policy is off). ``checkpoint_every``: also keep every checkpoint whose window is a multiple
    of M (0: only the ones catch-up needs, genesis and those after the anchor)."""

    windows: int = 0
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.windows != 0 and self.windows < MIN_WINDOWS:
            raise ConfigError(f"retention must keep at least {MIN_WINDOWS} windows (or 0: keep everything)")
        if self.checkpoint_every < 0:
            raise ConfigError("retention checkpoint_every must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.windows > 0

    def archived(self, window: int) -> bool:
        """Whether the checkpoint of ``window`` is kept whatever the anchor (genesis, archival)."""
        return window == 0 or (self.checkpoint_every > 0 and window % self.checkpoint_every == 0)


@dataclass(frozen=True)
class Plan:
    """What a policy deletes at window ``current``: ``delete`` in a safe order (oldest first, a
    checkpoint's manifest before its files), ``kept`` the run's chain keys it keeps. ``horizon``
    and ``anchor`` as in the module doc. ``more`` is True when ``max_deletes`` cut the plan short."""

    current: int
    horizon: int
    anchor: int
    delete: tuple[str, ...]
    kept: tuple[str, ...]
    more: bool = False


def plan_collection(
    store: ObjectStore,
    run: str,
    run_hash: str,
    *,
    current: int,
    policy: Retention,
    signers: Signers,
    max_deletes: int | None = None,
    verified: MutableSet[tuple[str, str]] | None = None,
    rejected: Rejected | None = None,
    quorum: int | None = None,
    max_aggregate_bytes: int = 0,
) -> Plan:
    """The keys ``policy`` deletes from ``store`` when the run is at window ``current`` (see the
    module doc); an empty plan when the policy is off. Reads three listings, the manifests of the
    anchor candidates and the anchor's files (each against its signed size and sha256); deletes
    nothing. ``verified``: (key, sha256) of files already read and verified, kept by a caller that
    plans every window so that an anchor's files are read once, not once a window. ``rejected``:
    called with (key, reason, detail) for every store object that failed verification on the way
    (a checkpoint manifest, a missing or damaged checkpoint file): never a reason to delete it.

    ``quorum`` (a run with several validators, with ``max_aggregate_bytes`` the read cap of a
    certificate): a checkpoint is trusted only with the certificate of the aggregate before it
    (:func:`protocol.chain.read_manifest`), so that aggregate stays with every checkpoint kept;
    the window's proposals, endorsements and objections go with its contributions."""
    horizon = current - policy.windows
    if not policy.enabled or horizon <= 0:
        return Plan(current, max(horizon, 0), 0, (), ())
    contribs = _parsed(store.list(layout.contribs_prefix(run)), run)
    aggregates = _parsed(store.list(layout.aggregate_prefix(run)), run)
    checkpoints = _parsed(store.list(layout.checkpoints_prefix(run)), run)
    agreement: list[tuple[int, str]] = []
    if quorum is not None:
        for kind in layout.VALIDATOR_KINDS:
            agreement += _parsed(store.list(layout.validator_objects_prefix(run, kind)), run)
    seen = set() if verified is None else verified
    certified = Certified(quorum, max_aggregate_bytes)
    anchor = _anchor(store, run, run_hash, checkpoints, horizon, signers, seen, rejected or _logged, certified)
    kept_checkpoints = {w for w, _ in checkpoints if w >= anchor or policy.archived(w)}
    # several validators: aggregate w − 1 vouches for checkpoint w and stays while it does
    vouching = {w - 1 for w in kept_checkpoints if w > 0} if quorum is not None else set()
    delete: list[str] = [k for w, k in sorted(contribs + agreement) if w < horizon]
    delete += [k for w, k in aggregates if w < anchor and w not in vouching]
    delete += _checkpoint_order((w, k) for w, k in checkpoints if w not in kept_checkpoints)
    doomed = set(delete)
    kept = tuple(k for _, k in (*contribs, *agreement, *aggregates, *checkpoints) if k not in doomed)
    more = max_deletes is not None and len(delete) > max_deletes
    if more:
        delete = delete[:max_deletes]
    return Plan(current, horizon, anchor, tuple(delete), kept, more)


def collect(store: ObjectStore, plan: Plan) -> int:
    """Delete ``plan.delete`` in order; the number of keys deleted (deleting a key that is already
    gone is not an error, so a collection interrupted half-way is simply planned and run again)."""
    for key in plan.delete:
        store.delete(key)
    return len(plan.delete)


def published_window(
    store: ObjectStore, run: str, run_hash: str, *, signers: Signers, max_bytes: int, quorum: int | None = None
) -> int:
    """The window a run is at, read from its store (what ``sparseloco-validator gc`` collects
    against, without the validator's state): one past its newest aggregate that verifies (with
    several validators, ``quorum``: that a certificate vouches for), 0 when there is none. Keys that
    do not verify are skipped: a forged aggregate far ahead must not make every real object look old."""
    for window, _ in reversed(_parsed(store.list(layout.aggregate_prefix(run)), run)):
        try:
            found = read_aggregate(
                store, run, run_hash, window, allowed_signers=signers, max_bytes=max_bytes, quorum=quorum
            )
            if found is not None:
                return window + 1
        except ProtocolError as exc:
            log.warning("aggregate %d does not verify; not counted: %s", window, exc)
    return 0


def _parsed(keys: Iterable[str], run: str) -> list[tuple[int, str]]:
    """(window, key) of every layout key with a window; keys that are not ours are never touched."""
    out: list[tuple[int, str]] = []
    for key in keys:
        try:
            parsed = layout.parse_key(key, run=run)
        except MalformedPayload:
            log.debug("retention leaves the foreign key %r alone", key)
            continue
        if parsed.window is not None:
            out.append((parsed.window, key))
    return sorted(out)


def _anchor(
    store: ObjectStore,
    run: str,
    run_hash: str,
    checkpoints: Sequence[tuple[int, str]],
    horizon: int,
    signers: Signers,
    verified: MutableSet[tuple[str, str]],
    rejected: Rejected,
    certified: Certified,
) -> int:
    """The newest checkpoint window ``≤ horizon`` whose manifest verifies, belongs to the store's
    launch and whose files all have the size and sha256 it signed; 0 (genesis) when there is none.
    A forged or damaged checkpoint is never an anchor: trusting one — even one whose files are
    merely present — would delete the aggregates a joiner needs. Each object that fails is told to
    ``rejected``."""
    manifests = sorted(
        {w for w, k in checkpoints if 0 < w <= horizon and k == layout.checkpoint_manifest_key(run, w)}, reverse=True
    )
    if not manifests:
        return 0
    present = {k for _, k in checkpoints}
    try:
        launch = read_launch(store, run, run_hash, allowed_signers=signers).digest
    except (ObjectNotFound, ProtocolError) as exc:
        rejected(layout.checkpoint_manifest_key(run, 0), exc.reason, f"no verified genesis manifest: {exc}")
        return 0
    for window in manifests:
        key = layout.checkpoint_manifest_key(run, window)
        try:
            manifest = read_manifest(
                store,
                run,
                run_hash,
                window,
                allowed_signers=signers,
                quorum=certified.quorum,
                max_aggregate_bytes=certified.max_bytes,
            )
            checkpoint_base(manifest, launch)
        except (ObjectNotFound, ProtocolError) as exc:
            rejected(key, exc.reason, f"checkpoint {window} is not an anchor for retention: {exc}")
            continue
        files = manifest.value.files
        missing = next((f.key for f in files if f.key not in present), None)
        if missing is not None:
            rejected(missing, "not_found", f"checkpoint {window} misses this file; not an anchor for retention")
            continue
        damaged = next((f.key for f in files if not _file_verifies(store, f, verified)), None)
        if damaged is None:
            return window
        detail = f"checkpoint {window}: does not match its signed size and sha256; not an anchor for retention"
        rejected(damaged, "digest_mismatch", detail)
    return 0


@dataclass(frozen=True)
class Certified:
    """How a run's checkpoints are vouched for: ``quorum`` None, by the one validator's signature;
    else by the certificate (``max_bytes`` its read cap) of the aggregate before each."""

    quorum: int | None
    max_bytes: int


def _logged(key: str, reason: str, detail: str) -> None:
    """The default ``rejected``: a warning in the log."""
    log.warning("%s %s: %s", key, reason, detail)


def _file_verifies(store: ObjectStore, f: CheckpointFile, verified: MutableSet[tuple[str, str]]) -> bool:
    """Whether ``f``'s bytes in ``store`` have its signed size and sha256 (remembered in ``verified``)."""
    if (f.key, f.sha256) in verified:
        return True
    try:
        data = store.get(f.key, max_bytes=max(f.size, 1))
    except (ObjectNotFound, StoreError):
        return False
    if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
        return False
    verified.add((f.key, f.sha256))
    return True


def _checkpoint_order(items: Iterable[tuple[int, str]]) -> list[str]:
    """Checkpoint keys oldest window first, each window's manifest before its files."""
    return [k for _, _, k in sorted((w, not k.endswith("/" + layout.CHECKPOINT_MANIFEST), k) for w, k in items)]
