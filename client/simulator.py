"""In-process swarm: R replicas on one machine, through exactly the code real participants run.

Per round (window) t, for ``sparseloco``::

    θ_r   ← InnerTrainer.train_window(assigned_batches(data, seed, r, t, H, B, T))   # client/trainer
    Δ_r    = pseudo_gradient(θ_t, θ_r)
    codec  = codec_at(codec, outer, t)                  # the window's k (outer.warmup_k), as peers and the validator
    bytes, e_r = compress_and_pack(e_r, Δ_r, β, codec)  # feedback.compress_step + codec.pack (the wire payload)
    sparse = unpack_sparse(bytes, schema, codec)        # codec.unpack + to_sparse, as the validator does
    Δ̄      = aggregate(sparse_1..R, mode, clip)         # protocol/aggregate
    tensors, e_v = publishable(Δ̄, schema, outer, codec, e_v, contributors=R, window=t)   # bfloat16 or re-compressed
    blob   = encode_aggregate(...)                      # the signed aggregate every replica downloads
    θ_t+1  = apply_outer(θ_t, delta_of(decode_aggregate(blob)), α)

With ``outer.delay = 1`` (the overlapped schedule peers run, see :mod:`client.peer`) round t starts
from θ_{t−1}, the newest θ a peer holds while aggregate t−1 is still in flight. ``arrival`` says
when that aggregate reaches the replicas, as a fraction of the round's H inner steps: a replica
that has it moves its working model by it and goes on, and its Δ is taken against θ_t (0: at the
start, the synchronous schedule bit for bit). With ``arrival = 1`` it comes after the window: Δ
is taken against where the round started and applied to θ_t one round late (a one-window-delayed
outer step). With ``outer.eager`` a replica trains from θ_{t−1} − α·Δ̄′ until then, Δ̄′ being the
forecast of the aggregate from the contributions it can see (:mod:`client.forecast`): only its
own until ``forecast_at`` of the round, every replica's after that, which is the aggregate itself
(the validator here accepts every contribution), so that the working model is exactly θ_t plus
the round's progress from then on. Before its first inner step an eager replica waits for that
(or for the aggregate) up to ``outer.forecast_wait`` of the round; the time waited is the round's
``waited`` (a fraction of H, idle time a real peer spends), and every event comes that much
earlier in its steps. Round 0 starts from θ_0.

``diloco`` averages the dense fp32 Δ_r and takes a Nesterov outer step (client/outer);
``ddp`` is one AdamW run whose gradient each step is the mean over the R replicas' batches (the same
tokens per step as the other methods). Validation loss on held-out data after every round.

    sim = Simulator(model_cfg, dataset, SimConfig(method="sparseloco", replicas=4, rounds=24, ...))
    result = sim.run()          # SimResult: per-round val loss, bytes, seconds
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from client.outer import NesterovOuter, dense_mean
from client.trainer import InnerTrainer, load_params, pseudo_gradient, snapshot
from protocol.aggregate import SparseDict, aggregate, apply_outer, sparse_of
from protocol.broadcast import publishable
from protocol.chain import delta_of
from protocol.codec import pack, unpack
from protocol.config import CodecConfig, DataConfig, InnerConfig, ModelConfig, OuterConfig, codec_at
from protocol.data.assignment import TokenDataset, assigned_batches, validation_batches
from protocol.errors import ConfigError
from protocol.feedback import FeedbackState, compress_step
from protocol.identity import Identity
from protocol.model import build_model, eval_loss, fingerprint, parameters_of
from protocol.wire import GENESIS, Aggregate, decode_aggregate, encode_aggregate

__all__ = ["METHODS", "RoundRecord", "SimConfig", "SimResult", "Simulator", "compress_and_pack", "unpack_sparse"]

METHODS = ("ddp", "diloco", "sparseloco")
_SIGNER = Identity.from_seed(b"simulated validator key, 32 byte")  # signs the simulated aggregates


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``outer.alpha`` is DiLoCo's outer lr when ``method == "diloco"``."""

    method: str = "sparseloco"
    replicas: int = 4
    rounds: int = 24
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    batch_size: int = 8
    seq_len: int = 128
    pages: int = DataConfig.pages  # data.pages: where a replica's sequences of one window come from
    micro_batch_size: int = 0
    eval_sequences: int = 64
    seed: int = 0
    arrival: float = 1.0  # outer.delay = 1: fraction of H trained before the aggregate in flight arrives
    forecast_at: float = 0.0  # outer.eager: fraction of H after which every replica's contribution is seen

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.replicas < 1 or self.rounds < 1:
            raise ConfigError("replicas and rounds must be >= 1")
        if not (0.0 <= self.arrival <= 1.0 and 0.0 <= self.forecast_at <= 1.0):
            raise ConfigError("arrival and forecast_at must be in [0, 1]")


@dataclass(frozen=True)
class RoundRecord:
    round: int
    val_loss: float
    train_loss: float  # mean inner-step loss over replicas
    bytes_per_replica: int  # what one replica sent this round
    seconds: float
    download_per_replica: int = 0  # what one replica received this round (the signed aggregate)
    waited: float = 0.0  # fraction of H an eager replica waited for the forecast before its first step


@dataclass
class SimResult:
    config: SimConfig
    initial_val_loss: float
    rounds: list[RoundRecord]
    fingerprint: str  # of the final global parameters

    @property
    def final_val_loss(self) -> float:
        return self.rounds[-1].val_loss

    @property
    def bytes_per_replica_per_round(self) -> float:
        return sum(r.bytes_per_replica for r in self.rounds) / len(self.rounds)

    @property
    def download_per_replica_per_round(self) -> float:
        return sum(r.download_per_replica for r in self.rounds) / len(self.rounds)

    @property
    def waited(self) -> float:
        """Mean fraction of a round's H spent waiting for the forecast (outer.forecast_wait)."""
        return sum(r.waited for r in self.rounds) / len(self.rounds)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rounds)


def compress_and_pack(
    state: FeedbackState, delta: Mapping[str, Tensor], beta: float, cfg: CodecConfig
) -> tuple[dict[str, bytes], FeedbackState]:
    """The peer's sparse path up to the wire: error feedback, Top-k + quantization, payload bytes.

    Returns the per-tensor payloads (byte-for-byte what ``wire.encode_contribution`` packs for the
    same state) and the next error-feedback state.
    """
    encoded, after = compress_step(state, delta, beta, cfg)
    return {name: pack(e) for name, e in encoded.items()}, after


def unpack_sparse(payloads: Mapping[str, bytes], shapes: Mapping[str, tuple[int, ...]], cfg: CodecConfig) -> SparseDict:
    """What the validator sees: strict ``codec.unpack`` of each payload, then flat sparse form."""
    return sparse_of({name: unpack(data, shapes[name], cfg) for name, data in payloads.items()})


class Simulator:
    """Runs one :class:`SimConfig` on ``dataset`` with a model built from ``model_cfg``."""

    def __init__(
        self, model_cfg: ModelConfig, dataset: TokenDataset, cfg: SimConfig, device: torch.device | str = "cpu"
    ) -> None:
        if dataset.vocab_size > model_cfg.vocab_size:
            raise ConfigError(f"dataset vocab {dataset.vocab_size} exceeds model vocab {model_cfg.vocab_size}")
        self.cfg = cfg
        self.data = dataset
        self.device = torch.device(device)
        self.model = build_model(model_cfg).to(self.device)
        self.params = parameters_of(self.model)
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.val = validation_batches(dataset, cfg.eval_sequences, cfg.batch_size, cfg.seq_len)
        if cfg.method == "ddp":
            # One model and optimizer; each step's batch is the R replicas' batches and accumulating
            # over micro-batches of one replica's size averages their gradients (the all-reduce).
            self.workers, mb = [self.model], cfg.batch_size
        else:
            self.workers = [build_model(model_cfg).to(self.device) for _ in range(cfg.replicas)]
            mb = cfg.micro_batch_size
        self.trainers = [InnerTrainer(m, cfg.inner, self.device, micro_batch_size=mb) for m in self.workers]
        self.feedback = [FeedbackState() for _ in range(cfg.replicas)]
        self.validator_feedback = FeedbackState()  # the re-compression buffer (outer.recompress)
        self._previous: dict[str, Tensor] | None = None  # θ_{t−1}, what a delayed round starts from
        self._in_flight: SparseDict = {}  # Δ̄_{t−1}, the aggregate a delayed round starts without
        self._sent: list[SparseDict] = [{} for _ in range(cfg.replicas)]  # each replica's last Δ̂
        self._waited = 0.0  # the round's wait for the forecast, a fraction of H
        self.outer = NesterovOuter(cfg.outer.alpha, cfg.outer.momentum)
        self.numel = sum(p.numel() for p in self.params.values())

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> SimResult:
        initial = eval_loss(self.model, self.val, self.device)
        records = []
        for t in range(self.cfg.rounds):
            t0 = time.perf_counter()
            step = {"ddp": self._round_ddp, "diloco": self._round_diloco, "sparseloco": self._round_sparse}
            self._waited = 0.0
            train_loss, sent, received = step[self.cfg.method](t)
            val = eval_loss(self.model, self.val, self.device)
            rec = RoundRecord(t, val, train_loss, sent, time.perf_counter() - t0, received, self._waited)
            records.append(rec)
            if on_round is not None:
                on_round(rec)
        return SimResult(self.cfg, initial, records, fingerprint(self.model))

    # ------------------------------------------------------------------ methods
    def _batches(self, replica: int, window: int) -> list[Tensor]:
        c = self.cfg
        return assigned_batches(
            self.data, c.seed, replica, window, c.inner.steps, c.batch_size, c.seq_len, pages=c.pages
        )

    def _local_rounds(self, t: int, starts: list[dict[str, Tensor]]) -> tuple[list[dict[str, Tensor]], float]:
        """Replica r trains H steps from ``starts[r]``; returns (pseudo-gradients, mean train loss)."""
        deltas, losses = [], []
        for r, (worker, trainer) in enumerate(zip(self.workers, self.trainers)):
            load_params(worker, starts[r])
            losses.append(trainer.train_window(self._batches(r, t)).mean_loss)
            deltas.append(pseudo_gradient(starts[r], worker))
        return deltas, sum(losses) / len(losses)

    def _round_sparse(self, t: int) -> tuple[float, int, int]:
        c = self.cfg
        current = snapshot(self.model)  # θ_t
        if c.outer.delay == 0 or self._previous is None:
            deltas, loss = self._local_rounds(t, [current] * c.replicas)
        else:
            deltas, loss = self._overlapped(t, self._previous, current)
        contribs, sent = [], 0
        codec = codec_at(c.codec, c.outer, t)  # the window's k (outer.warmup_k)
        for r, delta in enumerate(deltas):
            payloads, self.feedback[r] = compress_and_pack(self.feedback[r], delta, c.outer.beta, codec)
            sent = max(sent, sum(len(p) for p in payloads.values()))
            contribs.append(unpack_sparse(payloads, self.shapes, codec))
        delta_bar = aggregate(contribs, c.outer.aggregation, c.outer.clip)
        tensors, self.validator_feedback = publishable(
            delta_bar, self.shapes, c.outer, c.codec, self.validator_feedback, contributors=len(contribs), window=t
        )
        blob = encode_aggregate(Aggregate("0" * 64, t, GENESIS, c.outer.alpha, "", (), tensors, 0.0), _SIGNER)
        received = decode_aggregate(blob, run_hash=None, max_bytes=len(blob), allowed_signers=None).value
        published = delta_of(received)  # what every peer applies: the signed, decoded form
        apply_outer(self.params, published, c.outer.alpha)
        self._previous, self._in_flight, self._sent = current, published, contribs
        return loss, sent, len(blob)

    def _overlapped(
        self, t: int, previous: dict[str, Tensor], current: dict[str, Tensor]
    ) -> tuple[list[dict[str, Tensor]], float]:
        """Round t on the overlapped schedule (module docstring): each replica starts from θ_{t−1}
        less its stand-in, moves when the forecast completes and when the aggregate in flight
        arrives, and measures Δ against θ_t if it arrived during the round, else against where it
        started (less the stand-in it still holds)."""
        c = self.cfg
        alpha, steps = c.outer.alpha, c.inner.steps
        waited = min(c.outer.forecast_wait, c.forecast_at, c.arrival) if c.outer.eager else 0.0
        arrive, complete = round((c.arrival - waited) * steps), round((c.forecast_at - waited) * steps)
        self._waited = waited
        deltas, losses = [], []
        for r, (worker, trainer) in enumerate(zip(self.workers, self.trainers)):
            stand_in = self._sent[r] if c.outer.eager and complete > 0 else {}
            if c.outer.eager and complete == 0:
                stand_in = self._in_flight  # every contribution is in the store already
            start = {n: p.clone() for n, p in previous.items()}
            apply_outer(start, stand_in, alpha)
            load_params(worker, start)
            params, batches = parameters_of(worker), self._batches(r, t)
            total, done = 0.0, 0
            for stop, event in sorted([(complete, "forecast"), (arrive, "aggregate"), (steps, "end")]):
                if stop > done:
                    total += trainer.train_window(batches[done:stop]).mean_loss * (stop - done)
                    done = stop
                if event == "end":
                    break
                if stop >= steps or (event == "forecast" and (not c.outer.eager or stand_in is self._in_flight)):
                    continue
                if event == "forecast" and arrive <= complete:
                    continue  # the aggregate came first
                if stand_in is not self._in_flight:  # an exact forecast needs no move
                    apply_outer(params, stand_in, -alpha)
                    apply_outer(params, self._in_flight, alpha)
                stand_in = self._in_flight
            arrived = arrive < steps
            if arrived:
                base = current
            else:
                base = {n: p.clone() for n, p in previous.items()}
                apply_outer(base, stand_in, alpha)
            losses.append(total / steps)
            deltas.append(pseudo_gradient(base, worker))
        return deltas, sum(losses) / len(losses)

    def _round_diloco(self, t: int) -> tuple[float, int, int]:
        base = snapshot(self.model)
        deltas, loss = self._local_rounds(t, [base] * self.cfg.replicas)
        self.outer.step(self.params, dense_mean(deltas))
        return loss, 4 * self.numel, 4 * self.numel  # dense fp32 pseudo-gradient, dense fp32 mean

    def _round_ddp(self, t: int) -> tuple[float, int, int]:
        per_replica = [self._batches(r, t) for r in range(self.cfg.replicas)]
        steps = [torch.cat([b[i] for b in per_replica]) for i in range(self.cfg.inner.steps)]
        loss = self.trainers[0].train_window(steps).mean_loss
        nbytes = 4 * self.numel * self.cfg.inner.steps  # one fp32 gradient all-reduce per step
        return loss, nbytes, nbytes
