"""Prometheus metrics of a peer or a validator, derived from its :mod:`protocol.events` stream.

The loops never touch a metric: every process already reports what happens as typed events, and
:class:`Metrics` is one more sink of that stream (``--metrics-port PORT`` on ``sparseloco-peer
join`` and ``sparseloco-validator run``)::

    metrics = Metrics(role="peer")
    server = metrics.serve(9100)             # GET http://host:9100/metrics (Prometheus text format)
    metrics(PeerWindow(window=3, outcome="uploaded", loss=2.7, tokens=65536, inner_s=12.0, ...))
    server.close()

Every metric is prefixed ``sparseloco_``; each process exposes those its events feed (one marked
(peer) or (validator) only on that role's endpoint):

=====================================  ======  =====================================================
``window``                             gauge   the window this process works on
``phase{phase}``                       gauge   1 for the current phase (peer: starting, waiting_for_
                                               genesis, training, waiting_for_aggregate, stopped,
                                               failed; validator: starting, gathering, published, …)
``inner_loss``                         gauge   the last window's final inner loss (peer)
``tokens_per_second``                  gauge   the last window's training throughput (peer)
``upload_bytes_total``                 counter contribution bytes put in the store (peer)
``download_bytes_total``               counter contribution bytes read (validator)
``data_bytes_total``                   counter dataset bytes fetched (peer)
``wire_bytes_total{direction}``        counter bytes the peer's store sockets sent (``up``) and
                                               received (``down``): headers, grants, retries (peer)
``score`` / ``reputation``             gauge   the validator's loss score of this peer's last
                                               contribution and its reputation after it, from the
                                               window's published outcomes (peer)
``contributions_total{outcome}``       counter accepted / rejected contributions (peer: its own;
                                               validator: all)
``check_failures_total{reason}``       counter rejections by reason
``windows_total{outcome}``             counter a peer's windows: uploaded, skipped, failed, …
``phase_seconds{phase}``               gauge   the last window's time per phase (peer: inner,
                                               compress, upload; validator: gather, checks, scoring,
                                               publish)
``peers_expected``                     gauge   the validator's open window: peers it waits for, those
                                               uploaded included (0 until it has to wait for one)
``peers_uploaded``                     gauge   the last published window: peers whose upload it read
``val_loss``                           gauge   the validator's held-out loss of θ after the last window
``store_errors_total{kind}``           counter the validator's store requests that failed while it
                                               gathered, by what was asked (list_contributions,
                                               list_announcements, read_announcement,
                                               read_contribution), from each window's one
                                               ``store_errors`` event (validator)
``agreement_steps_total{step}``        counter several validators: the agreement steps this
                                               validator saw (proposed, endorsed, objected,
                                               handover, certified), its own and the others'
``certified_view``                     gauge   several validators: the view whose proposal the last
                                               published window's certificate signed (0: its first
                                               leader's)
``certified_signers``                  gauge   several validators: the endorsements in that
                                               certificate
=====================================  ======  =====================================================

A process of a run with one validator never sees an agreement step: the three agreement metrics
appear only once it does, so its ``/metrics`` is what it always was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from protocol.events import (
    AgreementStep,
    Applied,
    Event,
    Failed,
    Joined,
    PeerStarted,
    PeerWindow,
    Stopped,
    StoreErrors,
    ValidatorStarted,
    WaitingForGenesis,
    WindowOpened,
    WindowPublished,
    WindowWaiting,
)

__all__ = ["Metrics", "MetricsServer"]

PREFIX = "sparseloco_"


class MetricsServer:
    """A started ``/metrics`` HTTP endpoint (a daemon thread); :meth:`close` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Metrics:
    """An event sink holding one process's metrics in its own registry (see the module docstring)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        # What only one role's events feed is exported by that role only (unregistered, it still
        # counts, and nobody reads it): a validator shows no peer's loss at 0, and the reverse.
        peer = r if role == "peer" else None
        validator = r if role == "validator" else None
        self.window = Gauge(PREFIX + "window", "The window this process works on.", registry=r)
        self.phase = Gauge(PREFIX + "phase", "1 for the current phase of this process.", ["phase"], registry=r)
        self.inner_loss = Gauge(PREFIX + "inner_loss", "Final inner loss of the last trained window.", registry=peer)
        self.tokens_per_s = Gauge(PREFIX + "tokens_per_second", "Training tokens/s of the last window.", registry=peer)
        self.upload_bytes = Counter(PREFIX + "upload_bytes", "Contribution bytes put in the store.", registry=peer)
        self.download_bytes = Counter(PREFIX + "download_bytes", "Contribution bytes read.", registry=validator)
        self.data_bytes = Counter(PREFIX + "data_bytes", "Dataset bytes fetched.", registry=peer)
        self.wire_bytes = Counter(
            PREFIX + "wire_bytes", "Bytes on the store's sockets, by direction.", ["direction"], registry=peer
        )
        self.score = Gauge(PREFIX + "score", "The validator's score of this peer's last contribution.", registry=peer)
        self.reputation = Gauge(PREFIX + "reputation", "This peer's reputation after its last window.", registry=peer)
        self.contributions = Counter(
            PREFIX + "contributions", "Contributions decided, by outcome.", ["outcome"], registry=r
        )
        self.check_failures = Counter(PREFIX + "check_failures", "Rejections by reason.", ["reason"], registry=r)
        self.windows = Counter(PREFIX + "windows", "A peer's windows, by outcome.", ["outcome"], registry=peer)
        self.phase_seconds = Gauge(
            PREFIX + "phase_seconds", "Seconds of the last window per phase.", ["phase"], registry=r
        )
        self.peers_expected = Gauge(PREFIX + "peers_expected", "Peers the validator waits for.", registry=validator)
        self.peers_uploaded = Gauge(PREFIX + "peers_uploaded", "Peers whose upload was read.", registry=validator)
        self.val_loss = Gauge(PREFIX + "val_loss", "Held-out loss of θ after the last window.", registry=validator)
        self.store_errors = Counter(
            PREFIX + "store_errors",
            "Store requests that failed while gathering, by kind.",
            ["kind"],
            registry=validator,
        )
        self._agreement: _AgreementMetrics | None = None  # registered on the first agreement event
        self._phase: str | None = None
        self._set_phase("starting")
        self._handlers: dict[type[Event], Callable[[Event], None]] = {
            PeerStarted: lambda e: self._set_phase("starting"),
            ValidatorStarted: lambda e: self._set_phase("starting"),
            WaitingForGenesis: lambda e: self._set_phase("waiting_for_genesis"),
            Joined: self._joined,
            PeerWindow: self._peer_window,
            Applied: self._applied,
            WindowOpened: self._opened,
            WindowWaiting: self._waiting,
            WindowPublished: self._published,
            StoreErrors: self._store_errors,
            AgreementStep: self._agreement_step,
            Stopped: lambda e: self._set_phase("stopped"),
            Failed: lambda e: self._set_phase("failed"),
        }

    def __call__(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def serve(self, port: int, host: str = "0.0.0.0") -> MetricsServer:
        """Serve ``/metrics`` on ``host:port`` (0: any free port, see :attr:`MetricsServer.port`)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(server, thread)

    # ------------------------------------------------------------------ peer
    def _joined(self, e: Event) -> None:
        assert isinstance(e, Joined)
        self.window.set(e.window)
        self._set_phase("training")

    def _peer_window(self, e: Event) -> None:
        assert isinstance(e, PeerWindow)
        self.window.set(e.window)
        self.windows.labels(e.outcome).inc()
        if e.loss is not None:
            self.inner_loss.set(e.loss)
        if e.tokens and e.inner_s > 0:
            self.tokens_per_s.set(e.tokens / e.inner_s)
        if e.outcome == "uploaded":
            self.upload_bytes.inc(e.upload_bytes)
        self.data_bytes.inc(e.data_bytes)
        self.wire_bytes.labels("up").inc(e.wire_up_bytes)
        self.wire_bytes.labels("down").inc(e.wire_down_bytes)
        for phase, seconds in (("inner", e.inner_s), ("compress", e.compress_s), ("upload", e.upload_s)):
            self.phase_seconds.labels(phase).set(seconds)
        self._set_phase("waiting_for_aggregate" if e.outcome == "uploaded" else "training")

    def _applied(self, e: Event) -> None:
        assert isinstance(e, Applied)
        self.window.set(e.window + 1)
        self._set_phase("training")
        if e.accepted is None:
            return
        self.contributions.labels("accepted" if e.accepted else "rejected").inc()
        if not e.accepted:
            self.check_failures.labels(e.reason or "unknown").inc()
        if e.score is not None:
            self.score.set(e.score)
        if e.reputation is not None:
            self.reputation.set(e.reputation)

    # ------------------------------------------------------------------ validator
    def _opened(self, e: Event) -> None:
        assert isinstance(e, WindowOpened)
        self.window.set(e.window)
        self.peers_expected.set(0)
        self._set_phase("gathering")

    def _waiting(self, e: Event) -> None:
        assert isinstance(e, WindowWaiting)
        self.peers_expected.set(len(e.waiting_for) + e.uploaded)

    def _published(self, e: Event) -> None:
        assert isinstance(e, WindowPublished)
        self.window.set(e.window)
        self.contributions.labels("accepted").inc(e.accepted)
        self.contributions.labels("rejected").inc(e.rejected)
        for reason, count in e.reasons.items():
            self.check_failures.labels(reason).inc(count)
        for phase, seconds in e.seconds.items():
            self.phase_seconds.labels(phase).set(seconds)
        self.peers_uploaded.set(e.uploaded)
        self.download_bytes.inc(e.download_bytes)
        if e.val_loss == e.val_loss:  # NaN: no validation loss this window
            self.val_loss.set(e.val_loss)
        if e.signers:
            self._agreed().certified(e.view, len(e.signers))
        self._set_phase("published")

    def _store_errors(self, e: Event) -> None:
        assert isinstance(e, StoreErrors)
        for kind, n in e.failed.items():
            self.store_errors.labels(kind=kind).inc(max(0, n))

    def _agreement_step(self, e: Event) -> None:
        assert isinstance(e, AgreementStep)
        self._agreed().steps.labels(e.step).inc()

    def _agreed(self) -> _AgreementMetrics:
        if self._agreement is None:
            self._agreement = _AgreementMetrics(self.registry)
        return self._agreement

    def _set_phase(self, phase: str) -> None:
        if self._phase is not None:
            self.phase.labels(self._phase).set(0)
        self.phase.labels(phase).set(1)
        self._phase = phase


class _AgreementMetrics:
    """The metrics of a run with several validators, registered when the first agreement event comes."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.steps = Counter(PREFIX + "agreement_steps", "Agreement steps seen, by step.", ["step"], registry=r)
        self.view = Gauge(PREFIX + "certified_view", "View of the last certified aggregate.", registry=r)
        self.signers = Gauge(PREFIX + "certified_signers", "Endorsements in the last certificate.", registry=r)

    def certified(self, view: int, signers: int) -> None:
        self.view.set(view)
        self.signers.set(signers)
