#!/usr/bin/env python
"""Robustness benchmark: a simulated open swarm, honest peers plus attackers, through the real Validator.

Everything runs in one process: a memory store, the real :class:`validator.node.Validator` (the same
gather, checks, scoring, aggregation and publishing as ``sparseloco-validator run``), honest peers
that train the small test model for real (AdamW on their assigned batches from θ_t, error
feedback, the run's codec, signed contributions) and attackers, one kind per scenario and then
mixed. Attackers arrive after ``--attack-from`` windows, as in a running swarm; the ones that must
first earn a record (timed ascent, harm to general loss, targeted rows) join one window earlier and
behave honestly until then. Window 0 is the same honest window in every scenario (one validator
key, the same honest identities), so differences come from the attacks.

    python scripts/bench_robustness.py --quick             # a few minutes on 2 CPU cores
    python scripts/bench_robustness.py --quick --json      # one JSON object on stdout
    python scripts/bench_robustness.py --scenarios honest,tiny_75 --windows 12
    python scripts/bench_robustness.py --quick --baseline --scenarios honest,targeted_row  # and '<name> before'

Per scenario: ``final_val_loss`` (the validator's after the last window), ``honest_val_loss`` (the
honest-only run, same peers and windows), ``bad_accepted`` / ``bad_rejected`` (attacker rows),
``bad_weight`` (attackers' share of accepted contributions), ``honest_rejected`` (share of honest
uploads rejected for any reason but ``probation``; ``honest_deferred`` counts those), ``honest_excluded``
(honest peers ever excluded), ``crashes`` (exceptions out of ``run_window``),
``validator_peak_rss_mb`` (largest growth of the process RSS during a window: what the validator
holds; the memory store's contents are in place before the window opens), and scenario extras
(``target_prob_ratio``: probability of the attacked token relative to the honest run under the
same rules; ``edits_accepted`` / ``edits``: the uploads in which an established attacker attacked,
accepted / made; ``gather_s``: mean gather time; ``reference_vs_honest``: the validator's final
norm reference relative to the honest run's). ``sybil_cost``: what the attackers paid per accepted attack upload,
in honestly trained uploads sent to earn a record (each ``inner.steps`` steps of compute): the
``cost/accepted`` column (∞: no attack upload was accepted).

``patient_sybil`` (four identities) and ``reference_drift`` (two more than the honest peers: a
majority) are groups that stay honest until all of them are established (they read the
validator's standings, a generous oracle), then sign-flip (×2) together, or send honest
directions scaled to 8× the validator's current norm reference, tensor by tensor;
``patient_sybil_early`` sign-flips as soon as its identities count unscored (provisional, one
pass, with ``probation_partial``). ``honest_probation_1`` / ``honest_probation_2`` are the honest
run with one or two scored passes to establish, ``honest_partial`` / ``crowding_partial`` those
runs with provisional identities counted unscored at the newcomer caps: what probation costs,
and what counting identities on probation sooner lets in.

``--baseline`` runs every scenario a second time
as ``<name> before``, without the row-excess check and the ``targeted`` verdict
(:func:`baseline_rules`), under the same RunSpec.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table
from rss_peak import RssPeak

from protocol import codec, layout
from protocol.aggregate import apply_outer, clip_to_limits, sparse_of
from protocol.config import RunSpec
from protocol.data.assignment import assigned_batches, open_dataset, random_batches, validation_batches
from protocol.data.tokens import TokenDataset
from protocol.feedback import FeedbackState, compress_step
from protocol.identity import Identity
from protocol.model import build_model, lm_loss, parameters_of
from protocol.settings import LocalSettings
from protocol.store.memory import MemoryStore
from protocol.wire import Announcement, Contribution, encode_announcement, encode_contribution
from validator import concentration, decide
from validator.budgets import Budgets
from validator.logview import LogView
from validator.node import Validator
from validator.reference import clip_limits, measured
from validator.reputation import is_established, is_provisional

torch.set_num_threads(1)

MODEL = {"dim": 64, "n_layers": 1, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64}
LOCAL = LocalSettings(poll_interval_s=0.02)
TARGET_TOKEN = ord("$")  # the token the targeted-row attacker promotes (3e-5 of the corpus)
Params = dict[str, torch.Tensor]


@contextlib.contextmanager
def baseline_rules() -> Iterator[None]:
    """The validator without the row-excess check and the ``targeted`` verdict
    (:mod:`validator.concentration`), as if ``row_excess_ratio`` and ``eval_target_tolerance`` were
    0, under the same RunSpec (same run hash, same window secrets): ``--baseline``."""
    with (
        mock.patch.object(decide, "_target_tolerance", lambda spec: None),
        mock.patch.object(concentration, "row_excess", lambda norms, typical: concentration.Excess()),
    ):
        yield


def bench_spec(
    vkey: Identity, *, max_contributors: int, row_clip: bool = True, validator: dict[str, Any] | None = None
) -> RunSpec:
    return RunSpec().replace(
        model=MODEL,
        data={"seq_len": 32, "batch_size": 4},
        inner={"steps": 4, "lr": 3e-3, "warmup_steps": 1},
        windows={"upload_deadline_s": 10.0, "gather_grace_s": 0.05, "checkpoint_every": 1000},
        validator={
            "public_keys": [vkey.public_key_hex],
            "eval_sequences": 8,
            "eval_peers_per_window": 4,
            "eval_probation_peers": 2,
            "max_contributors": max_contributors,
            "max_contribution_bytes": 1 << 20,
            "row_clip": row_clip,
            **(validator or {}),
        },
    )


# ---------------------------------------------------------------------------- the swarm
class Swarm:
    """The shared store, the announced identities and what every peer needs to build updates."""

    def __init__(self, spec: RunSpec, dataset: TokenDataset | None = None) -> None:
        self.spec, self.run_hash = spec, spec.hash()
        self.run = layout.run_id(self.run_hash)
        self.name = f"bench-{uuid.uuid4().hex[:8]}"
        self.store = MemoryStore(self.name)
        self.dataset = dataset or open_dataset(spec.data)  # the peers' copy of the run's data

    def announce(self, peer: Identity) -> None:
        blob = encode_announcement(Announcement(self.run_hash, 0, "bench", "cpu"), peer)
        self.store.put(layout.peer_key(self.run, peer.peer_id), blob)

    def upload(self, peer_id: str, window: int, blob: bytes) -> None:
        self.store.put(layout.contrib_key(self.run, window, peer_id), blob)

    def sign(
        self, signer: Identity, window: int, base: str, tensors: dict[str, codec.Encoded], run_hash: str | None = None
    ) -> bytes:
        c = Contribution(run_hash or self.run_hash, window, base, self.spec.codec_at(window), tensors, {})
        return encode_contribution(c, signer)

    def train(
        self,
        key: str,
        params: Params,
        window: int,
        *,
        loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    ) -> Params:
        """θ_t − θ_local after ``inner.steps`` AdamW steps on ``key``'s assigned batches."""
        model = build_model(self.spec.model)
        with torch.no_grad():
            for n, p in parameters_of(model).items():
                p.copy_(params[n])
        opt = torch.optim.AdamW(model.parameters(), lr=self.spec.inner.lr, betas=(0.9, 0.95), weight_decay=0.0)
        d = self.spec.data
        for batch in assigned_batches(
            self.dataset, self.spec.seed, key, window, self.spec.inner.steps, d.batch_size, d.seq_len, pages=d.pages
        ):
            opt.zero_grad()
            (loss or lm_loss)(model, batch).backward()
            opt.step()
        return {n: (params[n] - p.detach()).contiguous() for n, p in parameters_of(model).items()}

    def encode(self, delta: Params, window: int) -> dict[str, codec.Encoded]:
        """``delta`` compressed with the codec of ``window`` (the Top-k warm-up's k in the first windows)."""
        cfg = self.spec.codec_at(window)
        return {n: codec.encode(t, cfg) for n, t in delta.items()}

    def close(self) -> None:
        MemoryStore.forget(self.name)


@dataclass
class Honest:
    identity: Identity
    feedback: FeedbackState = field(default_factory=FeedbackState)
    joins: int = 0  # first window it uploads in

    def blob(self, sw: Swarm, params: Params, window: int, base: str) -> tuple[bytes, dict[str, codec.Encoded]]:
        enc, self.feedback = compress_step(
            self.feedback, sw.train(self.identity.peer_id, params, window), sw.spec.outer.beta, sw.spec.codec_at(window)
        )
        return sw.sign(self.identity, window, base, enc), enc


@dataclass
class Window:
    """What attackers see of a window: its number, θ_t, base, the honest uploads (peer -> encoded)."""

    t: int
    params: Params
    base: str
    honest: dict[str, dict[str, codec.Encoded]]
    scored_guess: Callable[[list[str]], set[str]]


# An attacker: identities it controls, and for each window the (peer id, blob, delay s) it uploads.
Upload = tuple[str, bytes, float]


class Attacker:
    """Base class: ``identities`` to announce (``announce``=False: never announced), uploads per window.

    What the attack cost: ``honest_uploads`` (honestly trained uploads sent to earn a record, each
    ``inner.steps`` steps of compute) and ``attacks`` (the (window, peer) of every attack upload)."""

    announce = True

    def __init__(self, sw: Swarm, n: int) -> None:
        self.sw = sw
        self.ids = [Identity.generate() for _ in range(n)]
        self.honest_uploads = 0
        self.attacks: set[tuple[int, str]] = set()

    def observe(self, v: Validator) -> None:
        """What the attacker learns of the validator before a window (the bench's attackers may read
        its standings and reference: a generous oracle)."""

    def uploads(self, w: Window) -> list[Upload]:
        return []

    @property
    def peer_ids(self) -> set[str]:
        return {i.peer_id for i in self.ids}


class Every(Attacker):
    """Every upload is an attack (nothing honest was paid for it)."""

    def uploads(self, w: Window) -> list[Upload]:
        out = self.attack_uploads(w)
        self.attacks.update((w.t, peer) for peer, _, _ in out)
        return out

    def attack_uploads(self, w: Window) -> list[Upload]:
        return []


def _honest_norm(w: Window) -> float:
    any_enc = next(iter(w.honest.values()))
    return math.sqrt(sum(float(v.double().pow(2).sum()) for _, (_, v) in sparse_of(any_enc).items()))


def _noise(sw: Swarm, params: Params, norm: float, gen: torch.Generator, window: int) -> Params:
    raw = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    enc = sw.encode(raw, window)
    cur = math.sqrt(sum(float(v.double().pow(2).sum()) for _, (_, v) in sparse_of(enc).items()))
    return {n: t * (norm / cur) for n, t in raw.items()}


class Noise(Every):
    """Gaussian noise with the norm of an honest update (``scale`` × it)."""

    def __init__(self, sw: Swarm, n: int, scale: float = 1.0) -> None:
        super().__init__(sw, n)
        self.scale, self.gen = scale, torch.Generator().manual_seed(1)

    def attack_uploads(self, w: Window) -> list[Upload]:
        norm = _honest_norm(w) * self.scale
        return [
            (
                i.peer_id,
                self.sw.sign(i, w.t, w.base, self.sw.encode(_noise(self.sw, w.params, norm, self.gen, w.t), w.t)),
                0.0,
            )
            for i in self.ids
        ]


class Scaled(Every):
    """Trains honestly, then multiplies its update by ``factor`` (−1: sign-flipped)."""

    def __init__(self, sw: Swarm, n: int, factor: float) -> None:
        super().__init__(sw, n)
        self.factor = factor

    def attack_uploads(self, w: Window) -> list[Upload]:
        out = []
        for i in self.ids:
            delta = {n: t * self.factor for n, t in self.sw.train(i.peer_id, w.params, w.t).items()}
            out.append((i.peer_id, self.sw.sign(i, w.t, w.base, self.sw.encode(delta, w.t)), 0.0))
        return out


class Huge(Every):
    """Free identities sending ×1e30 updates (finite in float32)."""

    def attack_uploads(self, w: Window) -> list[Upload]:
        out = []
        gen = torch.Generator().manual_seed(w.t)
        for i in self.ids:
            delta = {n: t * 1e30 for n, t in _noise(self.sw, w.params, _honest_norm(w), gen, w.t).items()}
            out.append((i.peer_id, self.sw.sign(i, w.t, w.base, self.sw.encode(delta, w.t)), 0.0))
        return out


class Established(Attacker):
    """Honest until ``attack_from``, then ``attack``s (it has earned a record first)."""

    def __init__(self, sw: Swarm, n: int, attack_from: int) -> None:
        super().__init__(sw, n)
        self.attack_from = attack_from
        self.pushes: list[tuple[float, float]] = []
        self.last: dict[str, codec.Encoded] | None = None

    def uploads(self, w: Window) -> list[Upload]:
        out = []
        for i in self.ids:
            honest = self.sw.train(i.peer_id, w.params, w.t)
            delta = self.attack(i, w, honest) if self.attacking(w) else honest
            if delta is honest:
                self.honest_uploads += 1
            else:
                self.attacks.add((w.t, i.peer_id))
            out.append((i.peer_id, self.sw.sign(i, w.t, w.base, self.sw.encode(delta, w.t)), 0.0))
        return out

    def attacking(self, w: Window) -> bool:
        return w.t >= self.attack_from

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        """The update sent in an attack window (``delta`` itself: an honest one)."""
        return delta


class TimedAscent(Established):
    """Gradient ascent (its negated update, ×2) in windows where the *public* scoring formula says it
    is not scored; honest otherwise."""

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        live = sorted({*w.honest, i.peer_id})
        if i.peer_id in w.scored_guess(live):
            return delta
        return {n: -2.0 * t for n, t in delta.items()}


class TargetedRow(Established):
    """An honest update plus one edited row of the output matrix: the row of ``TARGET_TOKEN``,
    moved along the mean final hidden state so that the token's logit rises everywhere, by as much
    norm as the whole honest output update has (the rest stays honest, so the update still helps
    and agrees with the others)."""

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        name = "head.output.weight"
        model = build_model(self.sw.spec.model)
        with torch.no_grad():
            for n, p in parameters_of(model).items():
                p.copy_(w.params[n])
            d = self.sw.spec.data
            batch = random_batches(self.sw.dataset, w.t, 1, d.batch_size, d.seq_len)[0][:, :-1]
            h = _final_hidden(model, batch)
        direction = h.reshape(-1, h.shape[-1]).mean(0)
        direction = direction / direction.norm()
        edit = delta[name].clone()
        budget = float(sparse_of(self.sw.encode({name: delta[name]}, w.t))[name][1].norm())
        edit[TARGET_TOKEN] = -budget * direction  # θ ← θ − α·Δ̄: the row moves along +direction
        self.last = self.sw.encode({**delta, name: edit}, w.t)
        return {**delta, name: edit}

    def push(self, v: Validator, honest: dict[str, dict[str, codec.Encoded]]) -> None:
        """What this window's edit alone, clipped as the validator clips an established peer's
        update (caps from its reference and this window's honest uploads), does to the target's
        probability, with and without the row caps: the influence bound measured directly,
        whether or not the edit is accepted."""
        st, cfg = v.state, self.sw.spec.validator
        if st is None or st.reference.empty or self.last is None:
            return
        schema = {n: tuple(p.shape) for n, p in st.params.items()}
        others = [measured(sparse_of(enc), schema) for enc in honest.values()]
        out = []
        for rows in (True, False):
            limits = clip_limits(st.reference, others, schema, headroom=cfg.clip_headroom, rows=rows)
            (clipped,) = clip_to_limits([sparse_of(self.last)], limits)
            params = {n: p.clone() for n, p in st.params.items()}
            apply_outer(params, clipped, self.sw.spec.outer.alpha)
            out.append(_target_prob_at(self.sw, params) / _target_prob_at(self.sw, st.params))
        self.pushes.append((out[0], out[1]))
        self.last = None


class TargetedRowTimed(TargetedRow):
    """The targeted row edit from several established identities, each attacking only in windows
    where the public scoring formula says it is not scored, and in at most ``share`` of those (the
    rest honest): it trades influence for a lower chance of being scored while it attacks."""

    def __init__(self, sw: Swarm, n: int, attack_from: int, share: float = 1.0) -> None:
        super().__init__(sw, n, attack_from)
        self.share = share
        self.unscored: dict[str, int] = {}
        self.edits: dict[str, int] = {}

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        live = sorted({*w.honest, *self.peer_ids})
        if i.peer_id in w.scored_guess(live):
            return delta
        seen = self.unscored[i.peer_id] = self.unscored.get(i.peer_id, 0) + 1
        done = self.edits.get(i.peer_id, 0)
        if done + 1 > self.share * seen:
            return delta
        self.edits[i.peer_id] = done + 1
        return super().attack(i, w, delta)


def _final_hidden(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The normalised hidden state the output matrix reads (what ``logits`` multiplies)."""
    captured: list[torch.Tensor] = []
    handle = model.head.output.register_forward_hook(lambda mod, inp, out: captured.append(inp[0].detach()))
    model(tokens)
    handle.remove()
    return captured[0]


class HarmsGeneral(Established):
    """Lowers the loss on its own batches while raising it on other data: descent on its own
    batches, ascent on batches it was not given."""

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        other = self.sw.train(f"elsewhere-{i.peer_id}", w.params, w.t)
        return {n: t - 1.5 * other[n] for n, t in delta.items()}


def near_copy(params: Params, enc: dict[str, codec.Encoded], share: float, gen: torch.Generator) -> Params:
    """The largest ``share`` of an upload's values, plus noise (0.3 × its mean |value|) at every
    position, dense: what a copier re-encodes and signs."""
    dense = {}
    for n, (idx, vals) in sparse_of(enc).items():
        keep = torch.argsort(vals.abs(), descending=True)[: int(share * len(vals))]
        t = torch.zeros(params[n].numel())
        t[idx[keep]] = vals[keep]
        t += torch.randn(t.shape, generator=gen) * float(vals.abs().mean()) * 0.3
        dense[n] = t.view(params[n].shape)
    return dense


class PatientSybil(Established):
    """A group honest until every one of its identities is established (read from the validator's
    standings), then all sign-flipping (×2) together in the same windows."""

    def __init__(self, sw: Swarm, n: int, attack_from: int, *, early: bool = False) -> None:
        super().__init__(sw, n, attack_from)
        self.ready, self.early = False, early  # early: attack once counted unscored (provisional)

    def observe(self, v: Validator) -> None:
        st, cfg = v.state, self.sw.spec.validator
        if st is not None and not self.ready:
            standing = v._standings(st.window)
            ready = lambda s: is_established(s, cfg) or (self.early and s is not None and is_provisional(s, cfg))  # noqa: E731
            self.ready = all(ready(standing.get(p)) for p in self.peer_ids)

    def attacking(self, w: Window) -> bool:
        return self.ready and w.t >= self.attack_from

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        return {n: -2.0 * t for n, t in delta.items()}


class ReferenceDrift(PatientSybil):
    """An established group sending honest directions scaled, tensor by tensor, to ``factor`` × the
    validator's current norm reference every window (below ``norm_max_ratio``): dragging the
    reference up, and honest updates below ``norm_min_ratio`` of it."""

    factor = 8.0

    def __init__(self, sw: Swarm, n: int, attack_from: int) -> None:
        super().__init__(sw, n, attack_from)
        self.reference: dict[str, float] = {}

    def observe(self, v: Validator) -> None:
        super().observe(v)
        st = v.state
        if st is not None:
            self.reference = {n: t.norm for n, t in st.reference.tensors.items()}

    def attack(self, i: Identity, w: Window, delta: Params) -> Params:
        sent = sparse_of(self.sw.encode(delta, w.t))
        out = {}
        for n, t in delta.items():
            norm, ref = float(sent[n][1].double().norm()), self.reference.get(n, 0.0)
            out[n] = t * (self.factor * ref / norm) if norm > 0.0 and ref > 0.0 else t
        return out


class PerturbedCopy(Every):
    """Copies the largest 55 % of an honest upload, adds noise, re-encodes and signs it; uploads
    after the original was read (``delay``), or in the same poll (``delay=0``, exact re-signed copy)."""

    def __init__(self, sw: Swarm, n: int, *, exact: bool) -> None:
        super().__init__(sw, n)
        self.exact, self.gen = exact, torch.Generator().manual_seed(2)

    def attack_uploads(self, w: Window) -> list[Upload]:
        out = []
        victims = sorted(w.honest)
        for k, i in enumerate(self.ids):
            enc = w.honest[victims[k % len(victims)]]
            if self.exact:
                out.append((i.peer_id, self.sw.sign(i, w.t, w.base, dict(enc)), 0.0))
                continue
            dense = near_copy(w.params, enc, 0.55, self.gen)
            out.append((i.peer_id, self.sw.sign(i, w.t, w.base, self.sw.encode(dense, w.t)), 0.3))
        return out


class NearCopies(Every):
    """One identity per level of ``levels``: each copies the largest ``level`` share of an honest
    upload plus noise (:func:`near_copy`), after the original was read. The report gives each
    level's index overlap and weight."""

    LEVELS = (0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.7, 0.9)

    def __init__(self, sw: Swarm, levels: tuple[float, ...] = LEVELS) -> None:
        super().__init__(sw, len(levels))
        self.levels = {i.peer_id: lvl for i, lvl in zip(self.ids, levels)}
        self.gen = torch.Generator().manual_seed(3)

    def attack_uploads(self, w: Window) -> list[Upload]:
        victims = sorted(w.honest)
        out = []
        for k, i in enumerate(self.ids):
            dense = near_copy(w.params, w.honest[victims[k % len(victims)]], self.levels[i.peer_id], self.gen)
            out.append((i.peer_id, self.sw.sign(i, w.t, w.base, self.sw.encode(dense, w.t)), 0.3))
        return out


class Junk(Every):
    """Large random bytes: under unannounced ids (``announce=False``) or announced ones."""

    def __init__(self, sw: Swarm, n: int, nbytes: int, *, announced: bool) -> None:
        super().__init__(sw, n)
        self.nbytes, self.announce = nbytes, announced

    def attack_uploads(self, w: Window) -> list[Upload]:
        return [(i.peer_id, os.urandom(self.nbytes), 0.0) for i in self.ids]


class AnnounceOnly(Attacker):
    """Announces new identities every window and never uploads (holding windows open)."""

    def uploads(self, w: Window) -> list[Upload]:
        fresh = [Identity.generate() for _ in range(len(self.ids) // 4 or 1)]
        for i in fresh:
            self.sw.announce(i)
        self.ids += fresh
        return []


class Replays(Every):
    """Replayed older contributions, objects of another run, and objects signed by another key."""

    def __init__(self, sw: Swarm, n: int) -> None:
        super().__init__(sw, max(3, n))
        self.old: bytes | None = None

    def attack_uploads(self, w: Window) -> list[Upload]:
        replay, other, forged = self.ids[:3]
        enc = next(iter(w.honest.values()))
        out = [
            (other.peer_id, self.sw.sign(other, w.t, w.base, dict(enc), run_hash="ab" * 32), 0.0),
            (forged.peer_id, self.sw.sign(Identity.generate(), w.t, w.base, dict(enc)), 0.0),
        ]
        if self.old is not None:
            out.append((replay.peer_id, self.old, 0.0))
        self.old = self.sw.sign(replay, w.t, w.base, self.sw.encode(self.sw.train(replay.peer_id, w.params, w.t), w.t))
        return out


# ---------------------------------------------------------------------------- scenarios
@dataclass
class Scenario:
    name: str
    attackers: Callable[[Swarm, int, int], list[Attacker]]  # (swarm, honest count, attack_from)
    max_contributors: int = 32
    row_clip: bool = True
    newcomer: bool = False  # an honest peer joins when the attack starts
    # Capacity of room for every honest peer (the newcomer too) and this many more, whatever the
    # honest count (None: ``max_contributors``): crowding tests whether attackers take honest
    # peers' places, not whether more honest peers than places are turned away.
    spare: int | None = None
    validator: dict[str, Any] = field(default_factory=dict)  # validator settings over the bench's
    baseline: bool = False  # under baseline_rules()
    budgets: Budgets = field(
        default_factory=lambda: Budgets(max_fetches=64, max_fetch_bytes=8 << 20, fetch_timeout_s=5.0)
    )


FEW_SCORED = {"eval_peers_per_window": 2, "eval_probation_peers": 1}


def scenarios(quick: bool) -> list[Scenario]:
    junk_n, junk_bytes = (60, 1 << 20) if quick else (200, 1 << 20)
    return [
        Scenario("honest", lambda sw, h, a: []),
        Scenario("honest_no_row_cap", lambda sw, h, a: [], row_clip=False),  # what the row caps cost honest peers
        Scenario("noise", lambda sw, h, a: [Noise(sw, 2)]),
        Scenario("scaled_x10", lambda sw, h, a: [Scaled(sw, 2, 10.0)]),
        Scenario("scaled_x1000", lambda sw, h, a: [Scaled(sw, 2, 1000.0)]),
        Scenario("sign_flip", lambda sw, h, a: [Scaled(sw, 2, -1.0)]),
        Scenario("tiny_50", lambda sw, h, a: [Noise(sw, h, 1e-3)]),
        Scenario("tiny_75", lambda sw, h, a: [Noise(sw, 3 * h, 1e-3)]),
        Scenario("huge_50", lambda sw, h, a: [Huge(sw, h)]),
        Scenario("huge_75", lambda sw, h, a: [Huge(sw, 3 * h)]),
        Scenario("ascent_unscored", lambda sw, h, a: [TimedAscent(sw, 1, a)]),
        Scenario("harms_general", lambda sw, h, a: [HarmsGeneral(sw, 1, a)]),
        Scenario("targeted_row", lambda sw, h, a: [TargetedRow(sw, 1, a)]),
        Scenario("targeted_row_no_row_cap", lambda sw, h, a: [TargetedRow(sw, 1, a)], row_clip=False),
        Scenario("targeted_row_multi", lambda sw, h, a: [TargetedRowTimed(sw, 3, a)]),
        # scoring a third of the uploads at most (budget 2, 2 more for concentrated ones), closer to
        # a large swarm where most accepted updates are never scored
        Scenario("honest_few_scored", lambda sw, h, a: [], validator=FEW_SCORED),
        Scenario("targeted_row_few_scored", lambda sw, h, a: [TargetedRow(sw, 1, a)], validator=FEW_SCORED),
        Scenario("perturbed_copy", lambda sw, h, a: [PerturbedCopy(sw, 2, exact=False)]),
        Scenario("same_poll_copy", lambda sw, h, a: [PerturbedCopy(sw, 2, exact=True)]),
        Scenario("near_copy_series", lambda sw, h, a: [NearCopies(sw)]),
        Scenario("crowding", lambda sw, h, a: [Noise(sw, 16)], spare=1, newcomer=True),
        Scenario(
            "junk_flood",
            lambda sw, h, a: [
                Junk(sw, junk_n, junk_bytes, announced=False),
                Junk(sw, junk_n // 4, junk_bytes, announced=True),
            ],
        ),
        Scenario("announce_only", lambda sw, h, a: [AnnounceOnly(sw, 64)]),
        Scenario("replay_forged", lambda sw, h, a: [Replays(sw, 3)]),
        Scenario(
            "mixed",
            lambda sw, h, a: [
                Noise(sw, 1),
                Scaled(sw, 1, 1000.0),
                Scaled(sw, 1, -1.0),
                Noise(sw, h, 1e-3),
                TimedAscent(sw, 1, a),
                TargetedRow(sw, 1, a),
                PerturbedCopy(sw, 1, exact=False),
                Junk(sw, junk_n // 2, junk_bytes, announced=False),
                AnnounceOnly(sw, 16),
                Replays(sw, 3),
            ],
        ),
        # what a longer probation costs honest peers: the honest run with one scored pass to establish
        Scenario("honest_probation_1", lambda sw, h, a: [], validator={"probation_passes": 1}),
        Scenario("honest_probation_2", lambda sw, h, a: [], validator={"probation_passes": 2}),
        Scenario("honest_partial", lambda sw, h, a: [], validator={"probation_partial": 1.0}),
        Scenario(
            "crowding_partial",
            lambda sw, h, a: [Noise(sw, 16)],
            spare=1,
            newcomer=True,
            validator={"probation_partial": 1.0},
        ),
        Scenario("patient_sybil", lambda sw, h, a: [PatientSybil(sw, 4, a)]),
        Scenario(
            "patient_sybil_early",
            lambda sw, h, a: [PatientSybil(sw, 4, a, early=True)],
            validator={"probation_partial": 1.0},
        ),
        Scenario("reference_drift", lambda sw, h, a: [ReferenceDrift(sw, h + 2, a)]),
    ]


def public_sample(spec: RunSpec, t: int) -> Callable[[list[str]], set[str]]:
    """The scoring sample as it used to be computable by anyone: a hash of (run seed, window, peer)."""
    import hashlib

    budget = spec.validator.eval_peers_per_window

    def guess(peers: list[str]) -> set[str]:
        key = lambda p: hashlib.sha256(f"score|{spec.seed}|{t}|{p}".encode()).digest()  # noqa: E731
        return set(sorted(peers, key=key)[:budget])

    return guess


# ---------------------------------------------------------------------------- running one
class LaunchClock:
    """Wall time that starts at the same instant in every scenario: genesis, the first thing the
    validator stamps, gets exactly ``T0``, so the launch (and every window secret derived from it)
    is the same in every scenario, and scenarios differ only by their attackers."""

    T0 = 1_800_000_000.0

    def __init__(self) -> None:
        self._start: float | None = None

    def __call__(self) -> float:
        now = time.monotonic()
        if self._start is None:
            self._start = now
        return self.T0 + (now - self._start)


def run_scenario(
    sc: Scenario, *, honest_ids: list[Identity], vkey: Identity, windows: int, attack_from: int
) -> dict[str, Any]:
    with baseline_rules() if sc.baseline else contextlib.nullcontext():
        return _run_scenario(sc, honest_ids=honest_ids, vkey=vkey, windows=windows, attack_from=attack_from)


def _run_scenario(
    sc: Scenario, *, honest_ids: list[Identity], vkey: Identity, windows: int, attack_from: int
) -> dict[str, Any]:
    room = sc.max_contributors if sc.spare is None else len(honest_ids) + int(sc.newcomer) + sc.spare
    spec = bench_spec(vkey, max_contributors=room, row_clip=sc.row_clip, validator=sc.validator)
    sw = Swarm(spec)
    state_dir = tempfile.mkdtemp(prefix="bench-robust-")
    honest = [Honest(i) for i in honest_ids]
    if sc.newcomer:
        honest.append(Honest(Identity.generate(), joins=attack_from))
    for h in honest:
        if h.joins == 0:
            sw.announce(h.identity)
    attackers = sc.attackers(sw, len(honest_ids), attack_from)
    early = [a for a in attackers if isinstance(a, Established)]  # join a window early to earn a record
    clock = LaunchClock()
    v = Validator(spec, MemoryStore(sw.name), vkey, state_dir, local=LOCAL, clock=clock, budgets=sc.budgets)
    v.resume()
    crashes, peak, gather_s = 0, 0, []
    for t in range(windows):
        st = v.state
        assert st is not None
        for a in attackers:
            if a.announce and t == (attack_from - 1 if a in early else attack_from):
                for i in a.ids:
                    sw.announce(i)
        for h in honest:
            if h.joins == t and t > 0:
                sw.announce(h.identity)
        encoded = {}
        for h in honest:
            if t >= h.joins:
                blob, enc = h.blob(sw, st.params, t, st.base)
                sw.upload(h.identity.peer_id, t, blob)
                encoded[h.identity.peer_id] = enc
        w = Window(t, st.params, st.base, encoded, public_sample(spec, t))
        for a in attackers:
            a.observe(v)
        delayed: list[Upload] = []
        for a in attackers:
            if t >= attack_from or (a in early and t >= attack_from - 1):
                for peer, blob, delay in a.uploads(w):
                    if delay > 0:
                        delayed.append((peer, blob, delay))
                    else:
                        sw.upload(peer, t, blob)
        for a in attackers:
            if isinstance(a, TargetedRow):
                a.push(v, encoded)
        feeder = threading.Thread(target=_feed, args=(sw, t, delayed), daemon=True)
        try:
            with RssPeak() as rss:
                feeder.start()
                report = v.run_window()
            peak = max(peak, rss.peak)
            if report is not None:
                gather_s.append(report.seconds.get("gather", 0.0))
        except Exception:
            crashes += 1
            traceback.print_exc(file=sys.stderr)
            v.close()
            v = Validator(spec, MemoryStore(sw.name), vkey, state_dir, local=LOCAL, clock=clock, budgets=sc.budgets)
            v.resume()
        feeder.join()
    out = _measure(v, sw, honest, attackers, windows)
    out.update(
        crashes=crashes,
        validator_peak_rss_mb=round(peak / 2**20, 1),
        gather_s=round(sum(gather_s) / max(1, len(gather_s)), 3),
    )
    out["target_prob"] = _target_prob(v, sw)
    levels = {p: lvl for a in attackers if isinstance(a, NearCopies) for p, lvl in a.levels.items()}
    if levels:
        out["copy_levels"] = _copy_levels(v, levels, windows)
    out["sybil_cost"] = _cost(v, spec, attackers, windows)
    assert v.state is not None
    out["reference_norm"] = math.sqrt(sum(t.norm**2 for t in v.state.reference.tensors.values()))
    attacked = set().union(*(a.attacks for a in attackers if isinstance(a, Established)))
    if attacked:  # the attacking uploads (not the honest windows of an established attacker)
        rows = {(r.window, r.peer): r for r in v.log.rows(windows=(0, windows - 1))}
        out["edits_accepted"] = sum(1 for k in attacked if k in rows and rows[k].accepted)
        out["edits"] = len(attacked)
    pushes = [p for a in attackers if isinstance(a, TargetedRow) for p in a.pushes]
    if pushes:  # geometric means over the attack windows
        out["row_push_capped"] = round(math.exp(sum(math.log(c) for c, _ in pushes) / len(pushes)), 3)
        out["row_push_uncapped"] = round(math.exp(sum(math.log(u) for _, u in pushes) / len(pushes)), 3)
    v.close()
    sw.close()
    shutil.rmtree(state_dir, ignore_errors=True)
    return out


def _cost(v: Validator, spec: RunSpec, attackers: list[Attacker], windows: int) -> dict[str, Any]:
    """What the attackers paid per accepted attack upload: honest uploads (and their inner steps)."""
    accepted = {(r.window, r.peer) for r in v.log.rows(windows=(0, windows - 1)) if r.accepted}
    honest = sum(a.honest_uploads for a in attackers)
    hits = sum(len(a.attacks & accepted) for a in attackers)
    return {
        "honest_uploads": honest,
        "inner_steps": honest * spec.inner.steps,
        "attacks": sum(len(a.attacks) for a in attackers),
        "accepted_attacks": hits,
        "per_accepted": round(honest / hits, 2) if hits else None,
    }


def _feed(sw: Swarm, t: int, delayed: list[Upload]) -> None:
    start = time.monotonic()
    for peer, blob, delay in sorted(delayed, key=lambda u: u[2]):
        time.sleep(max(0.0, start + delay - time.monotonic()))  # after the originals were read
        sw.upload(peer, t, blob)


def _measure(v: Validator, sw: Swarm, honest: list[Honest], attackers: list[Attacker], windows: int) -> dict[str, Any]:
    honest_ids = {h.identity.peer_id for h in honest}
    bad_ids = set().union(*(a.peer_ids for a in attackers)) if attackers else set()
    rows = v.log.rows(windows=(0, windows - 1))
    hon = [r for r in rows if r.peer in honest_ids]
    bad = [r for r in rows if r.peer in bad_ids]
    accepted = [r for r in rows if r.accepted]
    deferred = [r for r in hon if r.reason == "probation"]
    standing = v._standings(windows)
    last = v.log.window(windows - 1)
    reasons: dict[str, int] = {}
    for r in hon:
        if not r.accepted:
            reasons[r.reason or "?"] = reasons.get(r.reason or "?", 0) + 1
    bad_reasons: dict[str, int] = {}
    for r in bad:
        if not r.accepted:
            bad_reasons[r.reason or "?"] = bad_reasons.get(r.reason or "?", 0) + 1
    unannounced = sum((w.unannounced for w in LogView(v.log).windows()), 0)
    return {
        "final_val_loss": last.val_loss if last is not None else None,
        "bad_accepted": sum(r.accepted for r in bad),
        "bad_rejected": sum(not r.accepted for r in bad) + unannounced,
        "bad_weight": round(
            sum(r.weight for r in accepted if r.peer in bad_ids) / max(1.0, sum(r.weight for r in accepted)), 4
        ),
        "honest_rejected": round(
            (sum(not r.accepted for r in hon) - len(deferred)) / max(1, len(hon) - len(deferred)), 4
        ),
        "honest_deferred": len(deferred),
        "honest_excluded": sum(1 for p in honest_ids if standing.get(p) is not None and standing[p].excluded_until > 0),
        "honest_reasons": reasons,
        "bad_reasons": bad_reasons,
    }


def _copy_levels(v: Validator, levels: dict[str, float], windows: int) -> dict[str, dict[str, Any]]:
    """Per copy level: mean index overlap with the closest candidate, uploads accepted / copied,
    mean weight of the accepted ones and the level's share of all accepted weight."""
    rows = v.log.rows(windows=(0, windows - 1))
    total = sum(r.weight for r in rows if r.accepted)
    out = {}
    for peer, lvl in sorted(levels.items(), key=lambda kv: kv[1]):
        mine = [r for r in rows if r.peer == peer]
        overlaps = [r.overlap for r in mine if r.overlap is not None]
        acc = [r for r in mine if r.accepted]
        out[f"{lvl:g}"] = {
            "overlap": round(sum(overlaps) / len(overlaps), 3) if overlaps else None,
            "accepted": len(acc),
            "copied": sum(r.reason == "copied" for r in mine),
            "weight": round(sum(r.weight for r in acc) / len(acc), 3) if acc else None,
            "weight_share": round(sum(r.weight for r in acc) / max(1.0, total), 4),
        }
    return out


def _target_prob(v: Validator, sw: Swarm) -> float:
    """Mean probability of ``TARGET_TOKEN`` over the validation sequences under the final θ."""
    assert v.state is not None
    return _target_prob_at(sw, v.state.params)


def _target_prob_at(sw: Swarm, params: Params) -> float:
    model = build_model(sw.spec.model)
    d = sw.spec.data
    batches = validation_batches(sw.dataset, 32, d.batch_size, d.seq_len)
    with torch.no_grad():
        for n, p in parameters_of(model).items():
            p.copy_(params[n])
        probs = [torch.softmax(model(b[:, :-1]), dim=-1)[..., TARGET_TOKEN].mean() for b in batches]
    return float(torch.stack(probs).mean())


# ---------------------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer windows and smaller floods (a few minutes on 2 cores)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    ap.add_argument("--scenarios", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--windows", type=int, default=None, help="windows per scenario (quick 8, full 12)")
    ap.add_argument("--honest", type=int, default=None, help="honest peers (quick 6, full 8)")
    ap.add_argument("--attack-from", type=int, default=2, help="first window with attackers (>= 1)")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also run every scenario without the row-excess check and the targeted verdict ('<name> before')",
    )
    args = ap.parse_args()
    if args.attack_from < 1:
        ap.error("--attack-from must be at least 1: attackers that earn a record first join a window earlier")
    windows = args.windows or (8 if args.quick else 12)
    n_honest = args.honest or (6 if args.quick else 8)
    chosen = scenarios(args.quick)
    if args.scenarios:
        names = args.scenarios.split(",")
        unknown = set(names) - {s.name for s in chosen}
        if unknown:
            ap.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
        chosen = [s for s in chosen if s.name in names or s.name == "honest"]
    if args.baseline:
        chosen = [v for s in chosen for v in (s, replace(s, name=f"{s.name} before", baseline=True))]
    honest_ids = [Identity.generate() for _ in range(n_honest)]
    vkey = Identity.generate()  # one validator key: the same secrets in every scenario
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for sc in chosen:
        t0 = time.monotonic()
        results[sc.name] = run_scenario(
            sc, honest_ids=honest_ids, vkey=vkey, windows=windows, attack_from=args.attack_from
        )
        results[sc.name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"{sc.name}: {results[sc.name]['seconds']} s", file=sys.stderr)
    probs = {name: r.pop("target_prob") for name, r in results.items()}
    for name, r in results.items():
        honest = "honest before" if name.endswith(" before") else "honest"  # the honest run, same rules
        base, base_prob = results[honest], probs[honest]
        r["honest_val_loss"] = base["final_val_loss"]
        r["target_prob_ratio"] = round(probs[name] / base_prob, 3) if base_prob else None
        r["reference_vs_honest"] = (
            round(r["reference_norm"] / base["reference_norm"], 3) if base["reference_norm"] else None
        )
        r["loss_vs_honest"] = (
            round(r["final_val_loss"] / base["final_val_loss"] - 1.0, 4) if r["final_val_loss"] else None
        )
    meta = {
        "windows": windows,
        "honest": n_honest,
        "attack_from": args.attack_from,
        "seconds": round(time.monotonic() - started, 1),
    }
    console = Console(file=sys.stderr if args.json else sys.stdout, width=200)
    console.print(table(results, meta))
    if args.json:
        print(json.dumps({"scenarios": results, "setup": meta}, indent=1))


def table(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> Table:
    t = Table(
        title=f"robustness: {meta['honest']} honest peers, {meta['windows']} windows, attacks from window {meta['attack_from']}"
    )
    cols = [
        "scenario",
        "final loss",
        "vs honest",
        "bad acc/rej",
        "bad weight",
        "honest rej",
        "deferred",
        "excluded",
        "crashes",
        "RSS MB",
        "gather s",
        "target p ×",
        "copy level: overlap → weight",
        "cost/accepted",
        "edits acc",
        "row push ×",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c == "scenario" else "right")
    for name, r in results.items():
        loss = r["final_val_loss"]
        t.add_row(
            name,
            f"{loss:.4f}" if loss is not None else "–",
            f"{100 * r['loss_vs_honest']:+.2f} %" if r["loss_vs_honest"] is not None else "–",
            f"{r['bad_accepted']}/{r['bad_rejected']}",
            f"{r['bad_weight']:.3f}",
            f"{100 * r['honest_rejected']:.1f} %",
            str(r["honest_deferred"]),
            str(r["honest_excluded"]),
            str(r["crashes"]),
            f"{r['validator_peak_rss_mb']:.1f}",
            f"{r['gather_s']:.2f}",
            f"{r['target_prob_ratio']:.2f}" if r["target_prob_ratio"] is not None else "–",
            " ".join(
                f"{lvl}: {c['overlap'] or 0:.2f}→{c['weight'] if c['weight'] is not None else '–'}"
                for lvl, c in r.get("copy_levels", {}).items()
            ),
            _cost_cell(r["sybil_cost"]),
            f"{r['edits_accepted']}/{r['edits']}" if "edits" in r else "",
            f"{r['row_push_capped']:.2f}" if "row_push_capped" in r else "",
        )
    return t


def _cost_cell(cost: dict[str, Any]) -> str:
    """Honest uploads paid per accepted attack upload (∞: none accepted; –: no attack sent)."""
    if not cost["attacks"]:
        return "–"
    if cost["per_accepted"] is None:
        return f"∞ ({cost['honest_uploads']}/0)"
    return f"{cost['per_accepted']:.1f} ({cost['honest_uploads']}/{cost['accepted_attacks']})"


if __name__ == "__main__":
    main()
