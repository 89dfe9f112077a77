"""``sparseloco-validator gc``: apply a retention policy to a run's store at once, and report it.

The validator applies its policy a little after every publish (:mod:`validator.retention`); this
is the same plan for an operator: the backlog of a long run that turns retention on, a store whose
validator is stopped, or a look at what a policy would delete (``dry_run``)::

    report = collect_run(spec, local, dry_run=True)   # local: LocalSettings with retain_windows > 0
    report.to_dict()["totals"]                       # {"delete": {"objects", "bytes"}, "keep": …}

The run's window comes from the store (its newest aggregate that verifies), so no validator state
is needed; sizes are read per key (one request each on S3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from protocol import layout
from protocol.caps import published_bytes
from protocol.config import RunSpec
from protocol.errors import ConfigError, ObjectNotFound
from protocol.identity import Identity
from protocol.quorum import Quorum
from protocol.settings import LocalSettings
from protocol.store import open_from_settings
from protocol.store.base import ObjectStore
from validator.retention import Plan, Retention, collect, plan_collection, published_window

__all__ = ["CollectionReport", "collect_run"]

#: The kinds of keys a collection deletes, as reported (with several validators, the agreement's too).
KINDS = ("contrib", "aggregate", "checkpoint")


@dataclass(frozen=True)
class CollectionReport:
    """What a collection deleted (or, ``dry_run``, would delete): ``deleted`` (key, bytes) in the
    order of deletion, ``kept`` the sizes of the run's chain keys that stay, by kind (``kinds``)."""

    run: str
    plan: Plan
    policy: Retention
    dry_run: bool
    deleted: tuple[tuple[str, int], ...]
    kept: tuple[tuple[str, int], ...]
    kinds: tuple[str, ...] = KINDS

    def to_dict(self) -> dict[str, object]:
        return {
            "run": self.run,
            "current": self.plan.current,
            "horizon": self.plan.horizon,
            "anchor": self.plan.anchor,
            "retain_windows": self.policy.windows,
            "retain_checkpoint_every": self.policy.checkpoint_every,
            "dry_run": self.dry_run,
            "delete": [{"key": k, "bytes": n} for k, n in self.deleted],
            "totals": {"delete": _totals(self.deleted), "keep": _totals(self.kept)},
            "by_kind": {
                kind: {"delete": _totals(_of(self.deleted, kind)), "keep": _totals(_of(self.kept, kind))}
                for kind in self.kinds
            },
        }

    def print(self, console: Console) -> None:
        """Every key with its size, then a table of totals by kind."""
        verb = "would delete" if self.dry_run else "deleted"
        for key, size in self.deleted:
            console.print(f"{verb}  {size:>14,d}  {key}")
        console.print(
            f"run {self.run} at window {self.plan.current}: keeping contributions from window "
            f"{self.plan.horizon}, aggregates and checkpoints from window {self.plan.anchor} "
            f"(checkpoint {self.plan.anchor} is the oldest a joiner may start from)"
        )
        table = Table("kind", f"{verb} objects", f"{verb} bytes", "kept objects", "kept bytes")
        for kind in self.kinds:
            gone, stay = _totals(_of(self.deleted, kind)), _totals(_of(self.kept, kind))
            table.add_row(
                kind, f"{gone['objects']:,d}", _bytes(gone["bytes"]), f"{stay['objects']:,d}", _bytes(stay["bytes"])
            )
        gone, stay = _totals(self.deleted), _totals(self.kept)
        table.add_row(
            "total", f"{gone['objects']:,d}", _bytes(gone["bytes"]), f"{stay['objects']:,d}", _bytes(stay["bytes"])
        )
        console.print(table)


def collect_run(
    spec: RunSpec, local: LocalSettings, *, identity: Identity | None = None, dry_run: bool = False
) -> CollectionReport:
    """Plan the retention of ``local.validator`` on the run's store, delete it unless ``dry_run``
    and report. ``ConfigError`` when the policy is off (``retain_windows`` 0). ``identity``: the
    validator key, which a ``dht://`` store needs to delete records (S3 uses the AWS credentials)."""
    policy = Retention(local.validator.retain_windows, local.validator.retain_checkpoint_every)
    if not policy.enabled:
        raise ConfigError("retention is off: give --retain-windows K (or validator.retain_windows) to collect")
    run_hash = spec.hash()
    run = layout.run_id(run_hash)
    signers = spec.validator.public_keys
    # store.grant_url / public_reads are how peers reach the run; the operator holds the credential.
    settings = dataclasses.replace(local.store, grant_url="", public_reads=False)
    with open_from_settings(settings, identity=identity, validator_keys=signers) as store:
        quorum = Quorum.of(spec)
        m = quorum.m if quorum.several else None  # several validators: certificates at aggregate keys
        cap = published_bytes(spec)
        current = published_window(store, run, run_hash, signers=signers, max_bytes=cap, quorum=m)
        plan = plan_collection(
            store, run, run_hash, current=current, policy=policy, signers=signers, quorum=m, max_aggregate_bytes=cap
        )
        deleted = _sizes(store, plan.delete)
        kept = _sizes(store, plan.kept)
        if not dry_run:
            collect(store, plan)
    kinds = KINDS if m is None else (*KINDS, *layout.VALIDATOR_KINDS)
    return CollectionReport(run, plan, policy, dry_run, deleted, kept, kinds)


def _sizes(store: ObjectStore, keys: Iterable[str]) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    for key in keys:
        try:
            out.append((key, store.size(key)))
        except ObjectNotFound:  # deleted meanwhile (the validator's own retention): nothing to count
            continue
    return tuple(out)


def _of(items: Iterable[tuple[str, int]], kind: str) -> list[tuple[str, int]]:
    return [(k, n) for k, n in items if k.split("/")[1] == kind]


def _totals(items: Iterable[tuple[str, int]]) -> dict[str, int]:
    sizes = [n for _, n in items]
    return {"objects": len(sizes), "bytes": sum(sizes)}


def _bytes(n: int) -> str:
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n:,d} B" if unit == "B" else f"{size:,.1f} {unit}"
