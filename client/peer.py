"""The peer: join a run, then train, compress, sign and upload one contribution per window.

    peer = Peer(spec, store, identity, LocalState(dir), device="cpu", display=PeerDisplay())
    peer.run(until_window=20)          # returns when θ opens window 20 (or on stop())

One window, as :meth:`Peer.run` reads it::

    catch_up    wait for / pull / verify / apply aggregate t−1 (fingerprint check, resync on mismatch)
    train       H AdamW steps on the batches assigned to (run, peer, t), from θ_t
    compress    Δ = θ_t − θ_local; e ← β·e + Δ; Δ̂ = Q(TopK(e)); e ← e − Δ̂; sign
    upload      stage the signed bytes and the new e in the state dir, then put contrib/<t>/<peer>
    (next)      catch_up applies aggregate t and commits θ_{t+1}'s position with e

Error feedback across failures (the rule both restart and skip follow): e changes only together
with a contribution that is staged for upload. A window whose deadline passes before its
contribution is staged (slow hardware, a stalled store) is *skipped*: its Δ is dropped and e keeps
its pre-window value, so e never loses mass that was not sent and never absorbs a Δ computed against
a θ_t the swarm has moved past. A staged contribution is uploaded even after a restart (the bytes
are in the state dir); if the validator rejects it or it arrives late, its Δ̂ is lost exactly as in
production SparseLoCo — e already had it subtracted.

Failures at a window boundary (store errors, bad aggregates, missed deadlines) become recorded
outcomes (a ``window`` event with ``outcome`` and ``reason``); only configuration and identity
errors stop the peer.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

from client.progress import PeerDisplay
from client.state import LocalState, Snapshot
from client.sync import Position, Sync
from client.trainer import InnerTrainer, load_params, pseudo_gradient
from protocol import layout
from protocol.config import RunSpec
from protocol.data import assigned_batches, open_dataset
from protocol.errors import ObjectExists, ProtocolError, StoreError
from protocol.feedback import FeedbackState, compress_step
from protocol.identity import Identity
from protocol.model import build_model
from protocol.store.base import ObjectStore, put_once
from protocol.windows import upload_deadline
from protocol.wire import Aggregate, Announcement, Contribution, Verified, encode_announcement, encode_contribution

CLIENT_VERSION = "sparseloco-peer/0.1"
UPLOAD_RETRIES = 3


@dataclass
class Trained:
    """One window of local training, compressed and signed."""

    window: int
    blob: bytes
    loss_first: float
    loss_last: float
    tokens: int
    inner_s: float
    compress_s: float


class Peer:
    """One participant; see the module docstring for the window loop."""

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        identity: Identity,
        state: LocalState,
        *,
        device: str = "cpu",
        display: PeerDisplay | None = None,
    ) -> None:
        self.spec, self.store, self.identity, self.state = spec, store, identity, state
        self.device = torch.device(device)
        self.display = display or PeerDisplay(json_lines=True)
        self.run_id = layout.run_id(spec.hash())
        self.sync = Sync(spec, store)
        self.model = build_model(spec.model).to(self.device)
        self.trainer = InnerTrainer(self.model, spec.inner, self.device, micro_batch_size=spec.data.micro_batch_size)
        self.dataset = open_dataset(spec.data)
        self.feedback = FeedbackState()
        self.params: dict[str, torch.Tensor] = {}  # θ master copy: CPU float32, changed only by Sync
        self.pos = Position(0, "", "")
        self.pending: Trained | None = None  # staged, not yet known to be aggregated
        self._previous_feedback: dict[str, torch.Tensor] = {}
        self._unsent = False  # e holds a compress step that was neither staged nor undone
        self._checkpoint_window = 0
        self._diverged = False  # θ must be rebuilt from a checkpoint before training again
        self.inner_s = 0.0
        self.windows_trained = 0
        self._stop = False

    def stop(self) -> None:
        """Ask the loop to stop at the next phase boundary (Ctrl-C raises instead, also safely)."""
        self._stop = True

    # ------------------------------------------------------------------ the loop
    def run(self, *, until_window: int | None = None, max_windows: int | None = None) -> None:
        """Join, then one iteration per window until θ opens ``until_window`` or
        ``max_windows`` windows were trained here (or :meth:`stop`)."""
        self.join()
        while not self._done(until_window, max_windows):
            try:
                self.catch_up()  # pull/verify/apply aggregate t−1 (and every other one published)
                if self._done(until_window, max_windows) or self._diverged:
                    continue
                trained = self.train_and_compress(self.pos.window)  # H steps → Δ → e, Δ̂ → signed bytes
                if trained is not None:
                    self.upload(trained)  # stage + put before the deadline; skip the window otherwise
            except (ProtocolError, StoreError) as exc:
                self._failed(exc)  # a recorded outcome; the next iteration retries or moves on
        self.display.event("stopped", window=self.pos.window, windows_trained=self.windows_trained,
                           inner_s=round(self.inner_s, 3), fingerprint=self.pos.fingerprint)  # fmt: skip

    def _done(self, until_window: int | None, max_windows: int | None) -> bool:
        if self._stop:
            return True
        if max_windows is not None and self.windows_trained >= max_windows and self.pending is None:
            return True
        return until_window is not None and self.pos.window >= until_window

    # ------------------------------------------------------------------ join
    def join(self) -> None:
        """Announce, restore local state, load the newest checkpoint and replay aggregates."""
        t0 = time.time()
        self.announce()
        self.display.event("announced", peer_id=self.identity.peer_id)
        snap = self.state.load(self.spec.hash())
        if snap is not None:
            self.feedback.load_state_dict(snap.feedback)
            if snap.optimizer is not None:
                self.trainer.load_state_dict(snap.optimizer)
        self.pos = self._wait_for_genesis()
        if snap is not None and snap.pending == self.pos.window and snap.pending_blob is not None:
            self._resume_pending(snap)
        self.display.update(peer_id=self.identity.peer_id, window=self.pos.window, fingerprint=self.pos.fingerprint)
        self.display.event(
            "joined",
            replayed_from=self._checkpoint_window,
            peer_id=self.identity.peer_id,
            window=self.pos.window,
            fingerprint=self.pos.fingerprint,
            resumed=snap is not None,
            resumed_window=snap.window if snap else None,
            feedback_norm=round(self._feedback_norm(), 6),
            inner_step=self.trainer.step,
            join_s=round(time.time() - t0, 3),
        )

    def announce(self) -> None:
        hardware = f"{self.device.type} {platform.machine()} torch {torch.__version__}"
        ann = Announcement(self.spec.hash(), 0, CLIENT_VERSION, hardware)
        self._put_with_retry(layout.peer_key(self.run_id, self.identity.peer_id), encode_announcement(ann, self.identity))

    def _wait_for_genesis(self) -> Position:
        """Newest checkpoint (waiting for genesis if the validator is not up yet), then replay."""
        while True:
            try:
                pos = self.sync.resync(self.params)
                break
            except ProtocolError as exc:
                if exc.reason != "not_ready" or self._stop:
                    raise
                self.display.update(phase="waiting for genesis")
                time.sleep(self.sync.poll_s)
        self._checkpoint_window = pos.window
        return self.sync.advance(self.params, pos, on_apply=self._applied, on_resync=self._resynced)

    def _resume_pending(self, snap: Snapshot) -> None:
        """A contribution staged before a restart: upload it if its window is still open."""
        assert snap.pending is not None and snap.pending_blob is not None
        staged = Trained(snap.pending, snap.pending_blob, float("nan"), float("nan"), 0, 0.0, 0.0)
        if self._window_open(staged.window):
            outcome, reason = self._put_contribution(staged)
            self.pending = staged if outcome == "uploaded" else None
            self.display.event("resumed_upload", window=staged.window, outcome=outcome, reason=reason)

    # ------------------------------------------------------------------ catch-up
    def catch_up(self) -> None:
        """Wait for the aggregate of the window we contributed to, then apply every published one."""
        before = self.pos.window
        if self.pending is not None and self.pending.window == self.pos.window:
            self.display.update(phase="waiting for aggregate")
            self.sync.wait_until_published(self.pos.window, should_stop=lambda: self._stop)
        try:
            if self._diverged:
                self.pos = self.sync.bootstrap(self.params, on_apply=self._applied)
                self._diverged = False
            else:
                self.pos = self.sync.advance(self.params, self.pos, on_apply=self._applied, on_resync=self._resynced)
        except (ProtocolError, StoreError) as exc:
            # A bad object or a failing store: record it, and rebuild θ from the newest checkpoint
            # on the next try (θ may be half-updated, so it cannot be trusted any more).
            self.display.event("sync_failed", window=self.pos.window, reason=exc.reason, detail=str(exc))
            self._diverged = True
            time.sleep(max(self.sync.poll_s, 1.0))  # a persistent fault must not spin
            return
        if self.pending is not None and self.pending.window < self.pos.window:
            self.pending = None
        if self.pos.window != before:
            self._commit(tensors_unchanged=True)

    def _applied(self, agg: Verified[Aggregate], pos: Position) -> None:
        """Report aggregate ``agg`` (the fingerprint of θ after it, whether our contribution is in it)."""
        mine = [m for m in agg.value.manifest if m.peer_id == self.identity.peer_id]
        weight = mine[0].weight if mine else None
        self.state.record({"window": agg.value.window, "fingerprint": pos.fingerprint, "aggregate": agg.digest,
                           "included": bool(mine), "weight": weight, "time": round(time.time(), 3)})  # fmt: skip
        self.display.update(window=pos.window, fingerprint=pos.fingerprint, score=weight)
        self.display.event("applied", window=agg.value.window, fingerprint=pos.fingerprint, included=bool(mine),
                           weight=weight, contributors=len(agg.value.manifest))  # fmt: skip

    def _resynced(self, pos: Position, exc: ProtocolError) -> None:
        self.display.event("resync", window=pos.window, reason=exc.reason, detail=str(exc))

    # ------------------------------------------------------------------ train + compress
    def train_and_compress(self, window: int) -> Trained | None:
        """H inner steps from θ_window on this peer's batches, then error feedback + codec + sign."""
        if not self._window_open(window):
            self._skip(window, "window closed before training started")
            return None
        self._previous_feedback = dict(self.feedback.buffers)  # compress_step replaces, never mutates
        load_params(self.model, self.params)
        batches = assigned_batches(self.dataset, self.spec.seed, self.identity.peer_id, window,
                                   self.spec.inner.steps, self.spec.data.batch_size, self.spec.data.seq_len)  # fmt: skip
        t0 = time.perf_counter()
        losses, tokens = [], 0
        for i, batch in enumerate(batches):
            stats = self.trainer.train_window([batch])
            losses.append(stats.mean_loss)
            tokens += stats.tokens
            elapsed = time.perf_counter() - t0
            self.display.update(phase="training", window=window, step=i + 1, steps=len(batches),
                                loss=stats.mean_loss, tokens_per_s=tokens / max(elapsed, 1e-9))  # fmt: skip
            if self._stop:
                return None
        inner_s = time.perf_counter() - t0
        self.inner_s += inner_s
        t1 = time.perf_counter()
        delta = pseudo_gradient(self.params, self.model)
        encoded = compress_step(self.feedback, delta, beta=self.spec.outer.beta, cfg=self.spec.codec)
        self._unsent = True  # e now includes a step that is not staged yet
        meta = {"loss_first": losses[0], "loss_last": losses[-1], "tokens": tokens, "inner_s": round(inner_s, 3)}
        contribution = Contribution(self.spec.hash(), window, self.pos.base, self.spec.codec, encoded, meta)
        blob = encode_contribution(contribution, self.identity)
        return Trained(window, blob, losses[0], losses[-1], tokens, inner_s, time.perf_counter() - t1)

    # ------------------------------------------------------------------ upload
    def upload(self, trained: Trained) -> None:
        """Stage (state dir) then put the contribution; a closed window or failed put skips it."""
        if not self._window_open(trained.window):
            self._undo_unsent()  # nothing sent: e keeps its pre-window value
            self._skip(trained.window, "deadline passed during training", trained)
            return
        self.pending = trained
        self._commit()  # write-ahead: a restart re-uploads these exact bytes with this e
        self._unsent = False
        t0 = time.perf_counter()
        outcome, reason = self._put_contribution(trained)
        upload_s = time.perf_counter() - t0
        if outcome != "uploaded":  # never reached the store: undo the staged e step as well
            self.pending = None
            self._unsent = True
            self._undo_unsent()
            self._commit()
        self.windows_trained += 1
        self.display.update(upload_bytes=len(trained.blob), upload_s=upload_s)
        self.display.event("window", window=trained.window, outcome=outcome, reason=reason,
                           loss_first=round(trained.loss_first, 5), loss=round(trained.loss_last, 5),
                           tokens=trained.tokens, inner_s=round(trained.inner_s, 3),
                           compress_s=round(trained.compress_s, 3), upload_bytes=len(trained.blob),
                           upload_s=round(upload_s, 3), feedback_norm=round(self._feedback_norm(), 6))  # fmt: skip
        if outcome != "uploaded":
            self._wait_window_closed(trained.window)  # retraining the same window would fail alike

    def _put_contribution(self, trained: Trained) -> tuple[str, str | None]:
        key = layout.contrib_key(self.run_id, trained.window, self.identity.peer_id)
        try:
            # Our own earlier attempt (a restart, a retried put that did land) counts when identical.
            created = self._put_with_retry(key, trained.blob, once=True)
        except ObjectExists:
            return "failed", "a different contribution exists"
        except StoreError as exc:
            return "failed", f"{exc.reason}: {exc}"
        return "uploaded", None if created else "already present"

    def _put_with_retry(self, key: str, data: bytes, *, once: bool = False) -> bool:
        """``store.put``, or with ``once`` :func:`put_once`, retried on store errors other than
        ``ObjectExists``; whether this call created the object."""
        for attempt in range(UPLOAD_RETRIES):
            try:
                if once:
                    return put_once(self.store, key, data)
                self.store.put(key, data)
                return True
            except ObjectExists:
                raise
            except StoreError:
                if attempt == UPLOAD_RETRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("UPLOAD_RETRIES is at least 1")

    def _failed(self, exc: ProtocolError | StoreError) -> None:
        """A window that broke on a store or protocol error: undo an unsent e step, record it."""
        self._undo_unsent()
        self.display.event("window", window=self.pos.window, outcome="failed", reason=exc.reason, detail=str(exc))
        self._wait_window_closed(self.pos.window)
        time.sleep(max(self.sync.poll_s, 1.0))  # a persistent fault (a forged aggregate) must not spin

    def _undo_unsent(self) -> None:
        """Put e back to its pre-window value if this window's step was never staged for upload."""
        if self._unsent:
            self.feedback.buffers = self._previous_feedback
            self._unsent = False

    def _skip(self, window: int, reason: str, trained: Trained | None = None) -> None:
        self.display.event("window", window=window, outcome="skipped", reason=reason,
                           inner_s=round(trained.inner_s, 3) if trained else 0.0)  # fmt: skip
        self._wait_window_closed(window)

    def _wait_window_closed(self, window: int) -> None:
        """Wait for ``window``'s aggregate, so the next iteration moves on instead of retraining it."""
        try:
            self.sync.wait_until_published(window, should_stop=lambda: self._stop)
        except StoreError:
            time.sleep(self.sync.poll_s)  # the store is failing too: the loop retries and records it

    def _window_open(self, window: int) -> bool:
        if self.sync.aggregate_published(window):
            return False
        if self.pos.opened_at is None or window != self.pos.window:
            return True
        return time.time() < upload_deadline(self.pos.opened_at, self.spec.windows)

    # ------------------------------------------------------------------ state
    def _commit(self, *, tensors_unchanged: bool = False) -> None:
        pending = self.pending
        self.state.save(
            Snapshot(
                run_hash=self.spec.hash(),
                window=self.pos.window,
                base=self.pos.base,
                fingerprint=self.pos.fingerprint,
                params={},  # θ is re-derived from the store's checkpoint + aggregates on restart
                feedback=self.feedback.state_dict(),
                optimizer=self.trainer.state_dict(),
                pending=pending.window if pending else None,
                pending_blob=pending.blob if pending else None,
            ),
            tensors_unchanged=tensors_unchanged,
        )

    def _feedback_norm(self) -> float:
        total = sum(float(b.double().pow(2).sum()) for b in self.feedback.buffers.values())
        return total**0.5

    def summary(self) -> dict[str, Any]:
        return {"peer_id": self.identity.peer_id, "window": self.pos.window, "fingerprint": self.pos.fingerprint}
