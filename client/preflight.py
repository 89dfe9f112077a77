"""``sparseloco-peer preflight``: whether this machine can join a run, and if not, why.

    checks = Preflight(spec, local, identity, store, device="cuda")
    for check in checks.run():            # each Check as soon as it is done
        print(check.name, check.status, check.detail)
    checks.report().ok                    # no check failed

The checks, in order (each :class:`Check` is ``ok``, ``warning`` (passed, but close), ``failed``
or ``skipped``, with a stable ``reason`` and the figures it measured):

``memory``   the model's training footprint (:mod:`client.footprint`) against this device's free
             memory; suggests ``compute.micro_batch_size``
``compute``  a few inner steps of the real model on this device (synthetic tokens), the
             compression of their pseudo-gradient with the codec of the run's largest k (window
             0's when a Top-k warm-up starts above ``codec.k``, else ``codec.k``'s, from window
             ``outer.warmup_windows`` on: :func:`largest_window`), and the size of the signed
             contribution
``clock``    this machine's clock against the store's (and the grant server's) ``Date`` header
             (:mod:`client.clock`): fails when the offset is beyond
             ``min(windows.upload_deadline_s / 10, windows.gather_grace_s)``; skipped for a store
             without HTTP
``run``      the run's signed genesis checkpoint, for this run hash, in the store
``reads``    reading the chain: a listing of the checkpoints, the newest manifest, the size of its
             files and of the newest aggregate
``grant``    (with ``store.grant_url``) the grant server serves this run and would grant this
             peer's contribution to the open window
``write``    this peer writes its probe key (``<run>/probe/<peer id>``, nobody reads it) and reads
             it back: upload and download rates to the store, measured with a 1 MiB probe, then
             a 4 MiB one unless the first says it would take over a quarter of ``probe_budget_s``
``link``     the contribution (its size from ``compute``, else the codec's bound for the model)
             at the measured uplink, and the aggregate at the downlink, against
             ``windows.upload_deadline_s``: fails with the rate it needs when the contribution
             cannot be uploaded in time, warns when upload and download take over half of it;
             the checkpoint's download at join is reported
``window``   one window's time (download the aggregate, H inner steps, compress, upload) against
             ``windows.upload_deadline_s``

Nothing here joins the run: no announcement, no contribution.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from client.clock import check_clock
from client.footprint import USABLE, available_memory, footprint, suggest_micro_batch
from client.trainer import InnerTrainer, pseudo_gradient, snapshot
from client.uplink import megabits, megabytes, required_bits_per_s
from protocol import layout
from protocol.caps import contribution_bound
from protocol.config import RunSpec
from protocol.errors import ObjectNotFound, ProtocolError, ReasonedError, StoreError, Uncertified
from protocol.feedback import FeedbackState, compress_step
from protocol.identity import Identity
from protocol.model import build_model, param_schema
from protocol.replay import Chain
from protocol.settings import LocalSettings
from protocol.store.base import ObjectStore
from protocol.store.granted import GrantedStore, GrantNotGiven
from protocol.store.grants import PROBE_MAX_BYTES, GrantRequest
from protocol.wire import GENESIS, CheckpointManifest, Contribution, encode_contribution

__all__ = ["Check", "Preflight", "Report", "largest_window"]

GiB = 1 << 30
TIMED_STEPS = 2
PROBE_SIZES = (1 << 20, 4 << 20)  # smaller probes measure latency, not bandwidth; larger cost a slow link
PROBE_BUDGET_S = 20.0  # a larger probe is put only when the last one suggests it fits this
MARGINAL = 0.5  # of the upload deadline: a link that needs more is warned about
GRANT_TRIES = 3  # asks for the open window's upload grant, when a window closes in between


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` ok | failed | skipped, ``reason`` a stable snake_case name
    ("ok" when it passed), ``detail`` for people, ``figures`` what it measured."""

    name: str
    status: str
    reason: str
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason, "detail": self.detail, **self.figures}


@dataclass(frozen=True)
class Report:
    """Every check, the settings preflight suggests, and the verdict."""

    peer_id: str
    run_id: str
    run_hash: str
    store: str
    device: str
    checks: tuple[Check, ...]
    suggested: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "failed"]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "run_hash": self.run_hash,
            "store": self.store,
            "device": self.device,
            "suggested": self.suggested,
            "reasons": [c.reason for c in self.failed],
            "checks": [c.to_json() for c in self.checks],
        }


def _ok(name: str, detail: str, **figures: Any) -> Check:
    return Check(name, "ok", "ok", detail, figures)


def _failed(name: str, reason: str, detail: str, **figures: Any) -> Check:
    return Check(name, "failed", reason, detail, figures)


def _warning(name: str, reason: str, detail: str, **figures: Any) -> Check:
    return Check(name, "warning", reason, detail, figures)


def _skipped(name: str, reason: str, detail: str) -> Check:
    return Check(name, "skipped", reason, detail)


READ = "read and list the run's objects"

#: Where botocore found a credential (its ``method``), for people.
_CREDENTIAL_SOURCES = {
    "env": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment",
    "shared-credentials-file": "~/.aws/credentials",
    "config-file": "~/.aws/config",
}


def own_credential() -> str:
    """The store credential this machine uses without a grant server, for people: its access key
    id (never the secret) and where it came from."""
    try:
        import boto3

        credentials = boto3.session.Session().get_credentials()
    except Exception:  # a profile that does not parse: say so without its details
        return "this machine's store credential"
    if credentials is None:
        return "this machine's store credential (none found)"
    source = _CREDENTIAL_SOURCES.get(credentials.method, credentials.method)
    return f"this machine's store credential (access key {credentials.access_key}, from {source})"


def _reason(exc: Exception) -> str:
    """The stable reason of a failure: the grant server's own when it refused."""
    if isinstance(exc, GrantNotGiven):
        return exc.refusal
    return exc.reason if isinstance(exc, ReasonedError | StoreError) else type(exc).__name__


class Preflight:
    """The checks of one machine against one run; see the module docstring."""

    def __init__(
        self,
        spec: RunSpec,
        local: LocalSettings,
        identity: Identity,
        store: ObjectStore,
        *,
        device: str,
        clock: Callable[[], float] = time.perf_counter,
        probe_sizes: tuple[int, ...] = PROBE_SIZES,
        probe_budget_s: float = PROBE_BUDGET_S,
    ) -> None:
        self.spec, self.local, self.identity, self.store, self.device = spec, local, identity, store, device
        self.chain = Chain(spec, store)  # the run's signed objects, read as a peer reads them
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.clock = clock
        self.checks: list[Check] = []
        self.suggested: dict[str, Any] = {}
        self._micro_batch: int | None = None
        self._step_s: float | None = None
        self._compress_s = 0.0
        self._contribution_bytes: int | None = None
        self.probe_sizes, self.probe_budget_s = probe_sizes, probe_budget_s
        self._aggregate_bytes = 0
        self._checkpoint_bytes = 0
        self._waiting = False  # the validator waits for peers before genesis (the run check found)
        self._up_bps: float | None = None
        self._down_bps: float | None = None

    def run(self) -> Iterator[Check]:
        """Run every check in order, yielding each as it completes."""
        for step in (
            self._memory,
            self._compute,
            self._clock,
            self._run,
            self._reads,
            self._grant,
            self._write,
            self._link,
            self._window,
        ):
            check = step()
            self.checks.append(check)
            yield check

    def report(self) -> Report:
        return Report(
            peer_id=self.identity.peer_id,
            run_id=self.run_id,
            run_hash=self.run_hash,
            store=self.local.store.location(),
            device=self.device,
            checks=tuple(self.checks),
            suggested=dict(self.suggested),
        )

    # ------------------------------------------------------------------ this machine
    def _memory(self) -> Check:
        fp = footprint(self.spec, torch.device(self.device).type)
        free = available_memory(self.device)
        batch = self.spec.data.batch_size
        suggested = suggest_micro_batch(fp, batch, free)
        figures = {"free_bytes": free, **fp.to_json()}
        if suggested is None:
            return _failed(
                "memory",
                "does_not_fit",
                f"one sequence needs {fp.device_bytes(1) / GiB:.2f} GiB on {self.device}, "
                f"{free / GiB:.2f} GiB are free",
                **figures,
            )
        self.suggested["compute.micro_batch_size"] = suggested
        configured = self.local.compute.micro_batch_size
        use = configured or batch
        if fp.device_bytes(use) > free * USABLE:
            self._micro_batch = suggested
            what = f"compute.micro_batch_size {configured}" if configured else f"the whole batch ({batch} sequences)"
            return _failed(
                "memory",
                "micro_batch_too_large",
                f"{what} needs {fp.device_bytes(use) / GiB:.2f} GiB, {free / GiB:.2f} GiB are free: "
                f"set compute.micro_batch_size = {suggested}",
                **figures,
            )
        self._micro_batch = configured
        need = fp.device_bytes(configured or suggested or batch)
        return _ok(
            "memory",
            f"needs about {need / GiB:.2f} GiB of {free / GiB:.2f} GiB free on {self.device}"
            + (f"; suggested compute.micro_batch_size = {suggested}" if suggested else ""),
            needed_bytes=need,
            **figures,
        )

    def _compute(self) -> Check:
        if self._micro_batch is None:
            return _skipped("compute", "does_not_fit", "the model does not fit this device")
        try:
            figures = self._time_training(self._micro_batch or self.suggested.get("compute.micro_batch_size", 0))
        except torch.cuda.OutOfMemoryError as exc:
            return _failed("compute", "out_of_memory", f"{self.device} ran out of memory: {exc}")
        return _ok(
            "compute",
            f"{figures['step_s']:.3f} s per inner step, compression {figures['compress_s']:.2f} s, "
            f"contribution {figures['contribution_bytes']:,} B",
            **figures,
        )

    def _time_training(self, micro_batch: int) -> dict[str, Any]:
        spec, device = self.spec, torch.device(self.device)
        model = build_model(spec.model).to(device)
        trainer = InnerTrainer(model, spec.inner, device, micro_batch_size=micro_batch)
        theta = snapshot(model)
        tokens = torch.Generator().manual_seed(0)
        batch = torch.randint(0, spec.model.vocab_size, (spec.data.batch_size, spec.data.seq_len + 1), generator=tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.train_window([batch])  # warm-up: kernels, allocator, first-touch
        _synchronize(device)
        t0 = self.clock()
        trainer.train_window([batch] * TIMED_STEPS)
        _synchronize(device)
        self._step_s = (self.clock() - t0) / TIMED_STEPS
        t1 = self.clock()
        window = largest_window(spec)
        codec = spec.codec_at(window)
        encoded, _ = compress_step(FeedbackState(), pseudo_gradient(theta, model), beta=spec.outer.beta, cfg=codec)
        self._compress_s = self.clock() - t1
        blob = encode_contribution(Contribution(self.run_hash, window, GENESIS, codec, encoded, {}), self.identity)
        self._contribution_bytes = len(blob)
        figures: dict[str, Any] = {
            "step_s": round(self._step_s, 4),
            "compress_s": round(self._compress_s, 3),
            "contribution_bytes": len(blob),
            "micro_batch_size": micro_batch,
        }
        if device.type == "cuda":
            figures["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
        return figures

    # ------------------------------------------------------------------ the store
    def _clock(self) -> Check:
        verdict = check_clock(self.spec, self.local.store)
        return Check("clock", verdict.status, verdict.reason, verdict.detail, verdict.figures())

    def _run(self) -> Check:
        try:
            genesis = self.chain.launch().value
        except ObjectNotFound:
            waiting = self._waiting_for_peers()
            if waiting is not None:
                self._waiting = True
                wanted, announced = waiting
                return _warning(
                    "run",
                    "waiting_for_peers",
                    f"the validator is up and waits for {wanted} peer(s) to announce before it starts run "
                    f"{self.run_id}; {announced} announced: `sparseloco-peer join` announces this one and waits "
                    "for genesis",
                    waiting_for_peers=wanted,
                    announced=announced,
                )
            return _failed(
                "run",
                "run_not_found",
                f"no genesis checkpoint of run {self.run_id} (hash {self.run_hash}) in {self.local.store.location()}: "
                "the validator has not started, or this run.toml differs from the operator's "
                "(compare `sparseloco run-id run.toml`)",
            )
        except (ProtocolError, StoreError) as exc:
            return _failed("run", _reason(exc), f"cannot read the run's genesis: {exc}{self._denied(exc, READ)}")
        return _ok("run", f"run {self.run_id} started at {time.ctime(genesis.published_at)}")

    def _waiting_for_peers(self) -> tuple[int, int] | None:
        """(peers the validator waits for, announced so far) when this run's grant server says
        it waits for peers before genesis; None otherwise (no grant server, another run, no answer)."""
        if not isinstance(self.store, GrantedStore):
            return None
        try:
            info = self.store.info()
        except (ProtocolError, StoreError):
            return None
        wanted, announced = info.get("waiting_for_peers"), info.get("announced")
        if info.get("run_hash") != self.run_hash or not isinstance(wanted, int) or not isinstance(announced, int):
            return None
        return wanted, announced

    def _reads(self) -> Check:
        if self._waiting:
            return _skipped("reads", "waiting_for_peers", "nothing to read before genesis")
        try:
            windows = self._checkpoint_windows()
            if not windows:
                return _failed("reads", "not_found", "the store lists no checkpoint of this run")
            newest = self._newest_manifest(windows)
            sizes = [self.store.size(f.key) for f in newest.files]
            self._checkpoint_bytes = sum(sizes)
            try:
                self._aggregate_bytes = self.store.size(layout.aggregate_key(self.run_id, newest.window))
            except ObjectNotFound:
                self._aggregate_bytes = 0  # no window was published after it yet
        except (ProtocolError, StoreError) as exc:
            return _failed("reads", _reason(exc), f"cannot read the chain: {exc}{self._denied(exc, READ)}")
        return _ok(
            "reads",
            f"newest checkpoint: window {newest.window} ({sum(sizes):,} B)",
            checkpoint_window=newest.window,
            checkpoint_bytes=sum(sizes),
            aggregate_bytes=self._aggregate_bytes,
        )

    def _newest_manifest(self, windows: list[int]) -> CheckpointManifest:
        """The newest checkpoint's manifest; with several validators one a certificate vouches for
        (an uncertified one counts as absent, as for a joining peer)."""
        for window in reversed(windows[1:]):
            try:
                return self.chain.manifest(window).value
            except Uncertified:
                continue
        return self.chain.manifest(windows[0]).value

    def _checkpoint_windows(self) -> list[int]:
        """Windows with a checkpoint manifest, ascending (keys that do not parse are not ours)."""
        return self.chain.checkpoint_windows()

    def _grant(self) -> Check:
        """An upload grant for this peer's contribution to the open window. A window that closes
        between ``/v1/info`` and the request (a window boundary) is no fault of this machine: the
        open window is asked for again, up to :data:`GRANT_TRIES` times in all."""
        store = self.store
        if not isinstance(store, GrantedStore):
            return _skipped("grant", "no_grant_server", "no store.grant_url: writes use this machine's credential")
        for _ in range(GRANT_TRIES - 1):
            check = self._grant_open_window(store)
            if check.reason != "window_closed":
                return check
        return self._grant_open_window(store)

    def _grant_open_window(self, store: GrantedStore) -> Check:
        try:
            info = store.info()
        except (ProtocolError, StoreError) as exc:
            return _failed("grant", _reason(exc), f"the grant server {store.grant_url} does not answer: {exc}")
        if info.get("run_hash") != self.run_hash:
            return _failed(
                "grant",
                "wrong_run",
                f"the grant server serves run hash {info.get('run_hash')}, this run.toml is {self.run_hash}",
            )
        window = info.get("window")
        if not isinstance(window, int):
            return _skipped("grant", "no_open_window", "no window is open now: nothing to grant an upload for")
        key = layout.contrib_key(self.run_id, window, self.identity.peer_id)
        size = self._contribution_bytes or 1
        try:
            store.ask(GrantRequest.put(self.run_hash, key, size, if_absent=True))
        except GrantNotGiven as exc:
            if exc.refusal != "not_announced":
                return _failed("grant", _reason(exc), f"no upload grant for {key}: {exc}")
            return _ok(  # every check but the announcement passed: a peer that has not joined yet
                "grant",
                f"{store.grant_url} grants this peer's contribution to window {window} once its announcement is read",
                window=window,
            )
        except (ProtocolError, StoreError) as exc:
            return _failed("grant", _reason(exc), f"no upload grant for {key}: {exc}")
        return _ok("grant", f"{store.grant_url} grants this peer's contribution to window {window}", window=window)

    def _write(self) -> Check:
        key = layout.probe_key(self.run_id, self.identity.peer_id)
        size, up_s, down_s = 0, 0.0, 0.0
        for n in self.probe_sizes:
            if size and up_s * n / size > self.probe_budget_s / 4:
                break  # the last probe measured the rate; a larger one would cost a slow link too much
            payload = os.urandom(min(n, PROBE_MAX_BYTES))
            try:
                t0 = self.clock()
                self.store.put(key, payload)
                t1 = self.clock()
                back = self.store.get(key, max_bytes=len(payload))
                t2 = self.clock()
            except (ProtocolError, StoreError) as exc:
                denied = self._denied(exc, self._writes())
                return _failed("write", _reason(exc), f"cannot write and read back {key}: {exc}{denied}")
            if back != payload:
                return _failed("write", "corrupted", f"{key} read back different bytes")
            size, up_s, down_s = len(payload), t1 - t0, t2 - t1
        self._up_bps, self._down_bps = size / max(up_s, 1e-6), size / max(down_s, 1e-6)
        return _ok(
            "write",
            f"wrote {key} ({megabytes(size)}): up {megabits(self._up_bps)}, down {megabits(self._down_bps)}",
            probe_bytes=size,
            up_bytes_per_s=round(self._up_bps),
            down_bytes_per_s=round(self._down_bps),
        )

    def _denied(self, exc: Exception, needs: str) -> str:
        """For a store that refused this machine's own credential (no grant server): which
        credential it was, and what it needs; empty otherwise."""
        if isinstance(self.store, GrantedStore) or _reason(exc) != "access_denied":
            return ""
        return (
            f"; {own_credential()} was refused: store.grant_url is empty, so this machine uses its own "
            f"credential, which must be one the store knows and may {needs} (or set store.grant_url "
            "to the validator's grant server, as run.toml's [local.store] names it)"
        )

    def _writes(self) -> str:
        """What a peer's own credential must be allowed to write."""
        run, me = self.run_id, self.identity.peer_id
        return f"write {run}/peers/{me}, {run}/contrib/*/{me} and {run}/probe/{me}"

    def contribution_estimate(self) -> tuple[int, str]:
        """(bytes of one signed contribution, where the figure comes from): the one ``compute``
        encoded, else the codec's bound for the model (the codec of the largest k, :func:`largest_window`)."""
        if self._contribution_bytes is not None:
            return self._contribution_bytes, "measured"
        return contribution_bound(param_schema(self.spec.model), self.spec.codec_at(largest_window(self.spec))), "bound"

    def _link(self) -> Check:
        if not self._up_bps or not self._down_bps:
            return _skipped("link", "not_measured", "the write check did not measure the link")
        up, down, deadline = self._up_bps, self._down_bps, self.spec.windows.upload_deadline_s
        size, source = self.contribution_estimate()
        upload_s = size / up
        aggregate_s = self._aggregate_bytes / down
        checkpoint_s = self._checkpoint_bytes / down
        forecast = self._forecast_bytes(size)
        forecast_s = forecast / down
        needed = required_bits_per_s(size, deadline)
        figures = {
            "contribution_bytes": size,
            "contribution_source": source,
            "upload_s": round(upload_s, 2),
            "aggregate_bytes": self._aggregate_bytes,
            "aggregate_download_s": round(aggregate_s, 2),
            "checkpoint_bytes": self._checkpoint_bytes,
            "checkpoint_download_s": round(checkpoint_s, 2),
            "forecast_bytes": forecast,
            "forecast_download_s": round(forecast_s, 2),
            "upload_deadline_s": deadline,
            "up_bits_per_s": round(8 * up),
            "down_bits_per_s": round(8 * down),
            "needed_up_bits_per_s": round(needed),
        }
        uplink = (
            f"uplink {megabits(up)}: a {megabytes(size)} contribution needs {upload_s:.0f} s, "
            f"the upload window is {deadline:.0f} s"
        )
        downlink = (
            f"downlink {megabits(down)}: the aggregate ({megabytes(self._aggregate_bytes)}) takes {aggregate_s:.0f} s, "
            f"the checkpoint at join ({megabytes(self._checkpoint_bytes)}) {checkpoint_s:.0f} s"
            + (
                f", the others' contributions for the forecast ({megabytes(forecast)}) {forecast_s:.0f} s"
                if forecast
                else ""
            )
        )
        if upload_s > deadline:
            return _failed("link", "uplink_too_slow", f"{uplink}; needs ≥ {needed / 1e6:.1f} Mbit/s", **figures)
        if upload_s + aggregate_s > MARGINAL * deadline:
            return _warning(
                "link",
                "marginal",
                f"{uplink}, with the aggregate's download {upload_s + aggregate_s:.0f} s: over "
                f"{MARGINAL:.0%} of it, a slower moment misses windows; {downlink}",
                **figures,
            )
        if forecast_s > MARGINAL * deadline:
            return _warning(
                "link",
                "marginal",
                f"{downlink}: the forecast's reads (outer.eager) take over {MARGINAL:.0%} of the upload "
                f"window; the peer trains from an older θ while they last; {uplink}",
                **figures,
            )
        return _ok("link", f"{uplink}; {downlink}", **figures)

    def _forecast_bytes(self, contribution: int) -> int:
        """What the eager forecast reads a window (``outer.eager`` with ``delay`` 1): the contributions of the other
        peers of an aggregate, at most ``validator.max_contributors``, counted from the run's
        announcements (one listing); 0 without the forecast or when the listing fails."""
        if not (self.spec.outer.eager and self.spec.outer.delay):
            return 0
        try:
            announced = len(self.store.list(layout.peers_prefix(self.run_id)))
        except (ProtocolError, StoreError):
            return 0
        return max(0, min(announced + 1, self.spec.validator.max_contributors) - 1) * contribution

    def _window(self) -> Check:
        if self._step_s is None or self._contribution_bytes is None:
            return _skipped("window", "not_measured", "the compute check did not run")
        deadline = self.spec.windows.upload_deadline_s
        train_s = self.spec.inner.steps * self._step_s
        upload_s = self._contribution_bytes / self._up_bps if self._up_bps else 0.0
        download_s = self._aggregate_bytes / self._down_bps if self._down_bps else 0.0
        total = download_s + train_s + self._compress_s + upload_s
        figures = {
            "estimate_s": round(total, 2),
            "deadline_s": deadline,
            "train_s": round(train_s, 2),
            "compress_s": round(self._compress_s, 2),
            "upload_s": round(upload_s, 2),
            "download_s": round(download_s, 2),
        }
        parts = (
            f"{total:.1f} s of {deadline:.0f} s: download {download_s:.1f} s, {self.spec.inner.steps} inner steps "
            f"{train_s:.1f} s, compress {self._compress_s:.1f} s, upload {upload_s:.1f} s"
        )
        if total > deadline:
            return _failed("window", "too_slow", f"one window takes about {parts}", **figures)
        return _ok("window", f"one window takes about {parts}", **figures)


def largest_window(spec: RunSpec) -> int:
    """The first window whose codec keeps the most values per 4096, so the largest contribution:
    window 0 when the Top-k warm-up starts at or above ``codec.k``, else ``outer.warmup_windows``
    (the warm-up climbs to ``codec.k`` and stays there)."""
    outer, k = spec.outer, spec.codec.k
    return 0 if outer.k_at(0, k) >= k else outer.warmup_windows


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
