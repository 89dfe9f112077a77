"""A window's intake: what the per-contribution checks compare against, the gather, the verdicts.

:meth:`Intake.context` fixes what every upload of window t is checked against (registered keys,
exclusions, the accepted bases, the keyed sample); :meth:`Intake.gather` reads the uploads of
announced, non-excluded peers within the window's budgets (:func:`validator.gather.gather`) until
the deadline or until every expected peer has uploaded, emitting WindowWaiting while it waits and
one StoreErrors at its end when store requests failed (:mod:`validator.outage`);
:meth:`Intake.uploads` turns what was read into :class:`Uploads`, the input of the window's
decision (:mod:`validator.decide`): one verdict per upload, when its bytes were first read (kept
in the contribution log across restarts) and its key listed, and the ``immutable`` check.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from protocol import layout
from protocol.caps import object_caps
from protocol.config import RunSpec
from protocol.events import Event, WindowWaiting
from protocol.identity import Identity
from protocol.model import param_schema
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.windows import gather_close
from protocol.wire import PipelineRole
from validator import checks, randomness, window_checks
from validator.budgets import Budgets
from validator.gather import (
    EXCLUDED,
    UNANNOUNCED,
    Gathered,
    PeerRegistry,
    Received,
    active_peers,
    gather,
    recent_windows,
)
from validator.log import ContributionLog
from validator.reputation import is_excluded
from validator.rows import shows_activity
from validator.sketch import Sketcher, expected_nnz, offsets, sample_every
from validator.state import ValidatorState
from validator.window import Window

__all__ = ["IDLE_WINDOWS", "RECHECK_S", "WAITING_REPORT_S", "Intake", "Uploads"]

# How often the validator re-reads the announcement of a peer it waits for (a withdrawal ends the
# wait) and reports whom it waits for.
RECHECK_S = 1.0
WAITING_REPORT_S = 5.0
# An announcement tracked this long (in upload deadlines) by an identity with no record may make
# room for others when the registry is full.
IDLE_WINDOWS = 4


@dataclass(frozen=True)
class Uploads:
    """A window's uploads as the decision reads them: per admitted peer what was read
    (``received``) and its verdict so far (``screened``, sorted by peer), when its bytes were
    first read and its key listed (−inf: read before a restart), the pipeline roles the peers
    announced, and the keyed sample their entries were taken at (None: every position)."""

    received: Mapping[str, Received]
    screened: Sequence[checks.Screened]
    read_at: Mapping[str, float]
    listed_at: Mapping[str, float]
    roles: Mapping[str, PipelineRole | None] = field(default_factory=dict)
    sketch: Sketcher | None = None
    unannounced: int = 0


class Intake:
    """Gathers and screens one window at a time for a validator; tracks the announced peers
    (``registry``: who may upload, who is awaited)."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        log: ContributionLog,
        *,
        local: LocalSettings,
        budgets: Budgets,
        clock: Callable[[], float],
        emit: Callable[[Event], None],
        stop: threading.Event,
    ) -> None:
        self.spec, self.store, self.log = spec, store, log
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.registry = PeerRegistry(
            store,
            self.run_id,
            self.run_hash,
            clock,
            secret=randomness.window_secret(identity, self.run_hash, -1),  # never revealed
            max_per_poll=budgets.max_announcements_per_poll,
            max_tracked=budgets.max_tracked_peers,
        )
        self.local, self.budgets = local, budgets
        self.clock, self.emit, self.stop = clock, emit, stop
        self.schema = param_schema(spec.model)
        self.offsets = offsets(self.schema)  # one global index space for sampled entries
        self.max_bytes = object_caps(spec).contribution

    def sample_every(self, window: int) -> int:
        """The sketch's sample rate in ``window``: about :data:`~validator.sketch.SKETCH_VALUES` entries of a
        contribution at the window's k (:meth:`RunSpec.codec_at`)."""
        return sample_every(expected_nnz(self.schema, self.spec.codec_at(window)))

    def context(self, w: Window, st: ValidatorState) -> checks.Context:
        """What window ``w``'s uploads are checked against."""
        registered = self.registry.refresh()
        excluded = frozenset(p for p, s in w.standing.items() if is_excluded(s, w.t))
        return checks.Context(
            run_hash=self.run_hash,
            window=w.t,
            expected_base=st.base,
            # One-window-delayed outer step: a peer trains window t from θ_{t−1} while aggregate
            # t−1 is published; its update is scored and applied against θ_t like any other.
            previous_base=st.previous_base if self.spec.outer.delay else None,
            codec=self.spec.codec_at(w.t),  # the window's k (outer.warmup_k)
            schema=self.schema,
            max_bytes=self.max_bytes,
            registered=registered,
            excluded=excluded,
            # The window's k sets how many values a contribution keeps, so the sample rate.
            sketch=Sketcher(self.offsets, self.sample_every(w.t), key=w.secret),  # peers cannot know the sample
        )

    def gather(self, w: Window, opened_at: float, ctx: checks.Context) -> Gathered:
        """Until the deadline, or until every expected peer (:func:`validator.gather.expected_peers`)
        uploaded. Identities without an upload in the previous window (newcomers) hold the window
        open only for ``budgets.newcomer_wait`` of the upload deadline. In window 0 every peer is
        a newcomer and first windows are slow (the model is built, the data opened), so there that
        share of the deadline counts from the first contribution that came in: peers that start
        late together are all waited for, while one free announcement cannot hold the first
        aggregate back. A peer slower than that misses the window (``late``, neutral) and is
        waited for in the next ``validator.expect_windows`` ones (:mod:`validator.gather`)."""
        t, registry, deadline = w.t, self.registry, self.spec.windows.upload_deadline_s
        registry.trouble.reset()  # this window's failed store requests, summed up once at its end
        expect = self.local.validator.expect_windows
        span = recent_windows(t, expect)
        recent = self.log.rows(windows=span) if span is not None else []  # O(G × uploads), not O(history)
        # forged or foreign uploads prove nothing
        active = active_peers(((r.window, r.peer) for r in recent if shows_activity(r)), t, expect)
        opened_last = self.log.window(t - 1) if t > 0 else None
        since = opened_last.opened_at if opened_last is not None else None
        registry.make_room(active | w.established, IDLE_WINDOWS * deadline)
        wait = self.budgets.newcomer_wait * deadline
        newcomers_until = opened_at + wait if t > 0 else math.inf  # window 0: from its first upload
        waiting = _WaitingReport(t, gather_close(opened_at, self.spec.windows), self.clock, self.emit)

        def expected(uploaded: frozenset[str]) -> frozenset[str]:
            nonlocal newcomers_until
            if t == 0 and uploaded and math.isinf(newcomers_until):
                newcomers_until = self.clock() + wait
            registry.refresh()
            # Re-read the announcements of the peers still awaited (a withdrawal ends the wait) and
            # of the withdrawn ones (a peer that comes back is expected again).
            awaited = registry.expected(active, since) - uploaded
            registry.recheck(awaited | registry.withdrawn, RECHECK_S)
            want = registry.expected(active, since) - ctx.excluded
            if (since is not None or t == 0) and self.clock() >= newcomers_until:
                want = frozenset(p for p in want if p in active or p in uploaded)
            waiting.report(want - uploaded, len(uploaded))
            return want

        def admit(peer: str) -> str | None:
            if peer not in registry.announcements:
                return UNANNOUNCED
            return EXCLUDED if peer in ctx.excluded else None

        def priority(peer: str) -> tuple[int, float, bytes]:
            st = w.standing.get(peer)
            rep = st.reputation if st is not None else 0.0
            return (0 if peer in w.established else 1, -rep, randomness.keyed_key(w.secret, "fetch", peer))

        def screen(peer: str, data: bytes) -> checks.Screened:
            # admitted peers are announced; checking against this one avoids sharing the registry across threads
            return checks.screen(peer, data, replace(ctx, registered=frozenset({peer})))

        gathered = gather(
            self.store,
            self.run_id,
            t,
            opened_at=opened_at,
            windows=self.spec.windows,
            poll_interval_s=self.local.poll_interval_s,
            max_bytes=self.max_bytes,
            concurrency=self.local.validator.gather_concurrency,
            expected=expected,
            admit=admit,
            screen=screen,
            priority=priority,
            budgets=self.budgets,
            writers=lambda: frozenset(registry.announcements),  # a DHT decodes no entry of anyone else
            stop=self.stop,
            clock=self.clock,
            trouble=registry.trouble,
        )
        summary = registry.trouble.summary(t)
        if summary is not None:
            self.emit(summary)
        return gathered

    def uploads(self, t: int, gathered: Gathered, ctx: checks.Context) -> Uploads:
        """The per-contribution verdicts, when each peer's bytes were first read (kept in the log
        across restarts) and its key listed, and the ``immutable`` check against the first digest."""
        received = gathered.received
        out: list[checks.Screened] = []
        read_at: dict[str, float] = {}
        listed_at: dict[str, float] = {}
        first_digest: dict[str, str | None] = {}
        for peer in sorted(received):
            r = received[peer]
            read_at[peer] = r.received_at
            listed_at[peer] = r.received_at if r.listed_at is None else r.listed_at
            if r.screened is None:
                out.append(unread(r))
                continue
            if r.screened.held is not None:  # signed by the peer: its bytes, its time
                first, first_digest[peer] = self.log.note_received(
                    t, peer, received_at=r.received_at, nbytes=r.nbytes, digest=r.screened.held.digest
                )
                if first < r.received_at:  # read before a restart: when it was listed is unknown
                    read_at[peer], listed_at[peer] = first, -math.inf
            out.append(r.screened)
        roles = {p: a.role for p, a in self.registry.announcements.items() if p in received}
        return Uploads(
            received=received,
            screened=window_checks.immutable(out, first_digest),
            read_at=read_at,
            listed_at=listed_at,
            roles=roles,
            sketch=ctx.sketch,
            unannounced=gathered.unannounced,
        )


def unread(r: Received) -> checks.Screened:
    """The verdict on an upload that was not read: excluded, over the budget, or a store failure."""
    reason = r.reason or "store_error"
    name = {"too_large": "size", EXCLUDED: "excluded"}.get(reason, "fetch")
    return checks.Screened(peer=r.peer, checks=(checks.fail(name, reason),), reason=reason, detail=r.detail)


class _WaitingReport:
    """Emits WindowWaiting for one window: the peers it waits for, at most every
    ``WAITING_REPORT_S`` seconds, the first time once it has waited that long."""

    def __init__(self, window: int, closes_at: float, clock: Callable[[], float], emit: Callable[[Event], None]):
        self.window, self.closes_at, self.clock, self.emit = window, closes_at, clock, emit
        self.last = clock()

    def report(self, missing: frozenset[str], uploaded: int) -> None:
        now = self.clock()
        if not missing or now - self.last < WAITING_REPORT_S:
            return
        self.last = now
        closes_in = round(max(0.0, self.closes_at - now), 1)
        self.emit(
            WindowWaiting(window=self.window, waiting_for=sorted(missing), uploaded=uploaded, closes_in_s=closes_in)
        )
