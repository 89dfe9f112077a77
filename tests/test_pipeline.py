"""Pipeline replicas: stage plans, and 2 stages in 2 OS processes over gloo on 127.0.0.1.

The multi-process tests compare the pipeline against the same model run unsplit in this process
(without compression: the plain model; with compression: the unsplit model applying the same
boundary), and kill a stage mid-window to check the survivor skips the window without hanging.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from client.pipeline.boundary import Boundary, BoundaryTransformer
from client.pipeline.link import StageLink, free_port, parse_rendezvous
from client.pipeline.replica import PipelineStage, run_stage_window
from client.pipeline.schedule import clip_coefficient, pipeline_step
from client.pipeline.stage import plan_stages
from client.pipeline.subspace import Subspace, constrained_names, localize, out_of_span_ratio
from client.trainer import load_params
from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.feedback import FeedbackState
from protocol.model import build_model, lm_loss

MODEL = dict(dim=32, n_layers=4, n_heads=2, ffn_dim=64, max_seq_len=32)
TIMEOUT_S = 4.0


def _spec(ratio: int) -> RunSpec:
    return RunSpec.default().replace(
        model=MODEL,
        data={"seq_len": 16, "batch_size": 4},
        inner={"steps": 2, "warmup_steps": 1, "lr": 3e-3},
        pipeline={
            "enabled": True,
            "compression_ratio": ratio,
            "micro_batches": 2,
            "timeout_s": TIMEOUT_S,
            "rendezvous_timeout_s": 40.0,
        },
    )


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 17), generator=gen) for _ in range(n)]


def _theta(spec: RunSpec) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(spec.model).named_parameters()}


# ---------------------------------------------------------------------- workers (child processes)
# (stages, compression ratio) of the gradient checks: 2 stages with and without compression, and
# 3 stages with it (the middle stage receives and sends in both directions).
GRAD_CASES = ((2, 1), (2, 4), (3, 4))


def _grads_worker(stage: int, port: int, out: str) -> None:
    """One GPipe step per case this stage takes part in; writes its gradients and the loss."""
    torch.set_num_threads(1)
    for stages, ratio in GRAD_CASES:
        if stage >= stages:
            continue
        spec = _spec(ratio)
        ps = PipelineStage(spec, group="g", stage=stage, stages=stages)
        with StageLink(
            f"127.0.0.1:{port}",
            stage=stage,
            stages=stages,
            window=100 * stages + ratio,
            timeout_s=TIMEOUT_S,
            rendezvous_timeout_s=40,
        ) as link:
            ps.start_window(_theta(spec))
            res = pipeline_step(ps.stage, link, ps.boundary, list(_batches(1)[0].chunk(2)))
        grads = {n: p.grad.contiguous() for n, p in ps.params.items()}
        save_file(
            grads,
            f"{out}/grads_S{stages}_r{ratio}_s{stage}.safetensors",
            metadata={"loss": repr(res.loss), "grad_norm": repr(res.grad_norm)},
        )


def _grads_then_windows_worker(stage: int, port: int, out: str, windows: list[int], die_at_step: int) -> None:
    _grads_worker(stage, port, out)
    _window_worker(stage, port, out, windows, die_at_step, "")


def _third_stage_then_restart_worker(port: int, out: str, wait_for: str) -> None:
    """Stage 2 of the 3-stage gradient check, then the restarted stage 1 of the crash scenario."""
    _grads_worker(2, port, out)
    _window_worker(1, port, out, [3], -1, wait_for)


def _window_worker(stage: int, port: int, out: str, windows: list[int], die_at_step: int, wait_for: str) -> None:
    """Runs windows with run_stage_window; optionally dies (os._exit) in the middle of a window.

    ``wait_for``: a file to wait for first (a restarted stage joins once the survivor gave up).
    """
    torch.set_num_threads(1)
    while wait_for and not Path(wait_for).exists():
        time.sleep(0.05)
    import client.pipeline.replica as replica

    if die_at_step >= 0:
        real_step, calls = replica.pipeline_step, [0]

        def dying_step(*args, **kwargs):  # type: ignore[no-untyped-def]
            if calls[0] == die_at_step:
                os._exit(17)  # a crash: no cleanup, sockets close under the other stage
            calls[0] += 1
            return real_step(*args, **kwargs)

        replica.pipeline_step = dying_step
    spec = _spec(4)
    ps = PipelineStage(spec, group="g", stage=stage, stages=2)
    theta, feedback = _theta(spec), FeedbackState()
    for window in windows:
        res = run_stage_window(
            ps, theta, window, "genesis", _batches(2, seed=window), rendezvous=f"127.0.0.1:{port}", feedback=feedback
        )
        feedback = res.feedback_after or feedback
        record = {
            "ok": res.ok,
            "reason": res.reason,
            "seconds": res.seconds,
            "steps": res.steps,
            "names": sorted(res.encoded),
            "metadata": dict(res.metadata),
            "loss": res.mean_loss,
        }
        Path(f"{out}/w{window}_s{stage}.json").write_text(json.dumps(record))
    save_file({n: p.detach().contiguous() for n, p in ps.params.items()}, f"{out}/params_s{stage}.safetensors")


def _run(procs: list[mp.Process], limit_s: float) -> None:
    """Start, join within ``limit_s``; never leave a child behind."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not any(p.is_alive() for p in procs)


def _spawn(target, *args) -> mp.Process:  # type: ignore[no-untyped-def]
    return mp.get_context("spawn").Process(target=target, args=args, daemon=True)


# ---------------------------------------------------------------------- in-process
def test_plan_stages_is_contiguous_and_complete() -> None:
    plans = plan_stages(7, 3)
    assert [(p.start, p.stop) for p in plans] == [(0, 3), (3, 5), (5, 7)]
    assert plans[0].first and plans[-1].last and not plans[1].first
    assert plans[0].owns("embed.weight") and not plans[1].owns("embed.weight")
    assert plans[2].owns("head.output.weight") and plans[1].owns("blocks.4.mlp.w_down.weight")
    with pytest.raises(ConfigError):
        plan_stages(2, 3)
    with pytest.raises(ConfigError):
        parse_rendezvous("nohost")
    assert clip_coefficient(2.0, 1.0) == pytest.approx(0.5, rel=1e-5) and clip_coefficient(0.5, 1.0) == 1.0


def test_stage_slices_partition_the_model() -> None:
    spec = _spec(4)
    names = [sorted(PipelineStage(spec, group="g", stage=s, stages=2).params) for s in (0, 1)]
    assert not set(names[0]) & set(names[1])
    assert set(names[0]) | set(names[1]) == set(_theta(spec))
    with pytest.raises(ConfigError):
        PipelineStage(spec.replace(model={"tie_embeddings": True}), group="g", stage=0, stages=2)
    with pytest.raises(ConfigError):
        PipelineStage(spec, group="a/b", stage=0, stages=2)


def test_constrained_replica_trains_inside_the_subspace() -> None:
    from client.pipeline.constrained import ConstrainedReplica
    from client.trainer import InnerTrainer, pseudo_gradient

    spec = _spec(4)
    sub = Subspace.for_run(spec.hash(), spec.model.dim, 4)
    rep = ConstrainedReplica(spec.model, stages=2, subspace=sub)
    trainer = InnerTrainer(rep.model, spec.inner)
    theta = _theta(spec)
    start = rep.start_window(theta)
    for batch in _batches(2):
        trainer.train_window([batch])
        rep.after_step()
    delta = pseudo_gradient(start, rep.model)
    for name in ("embed.weight", "blocks.1.attn.wo.weight"):
        w = dict(rep.model.named_parameters())[name].detach()
        assert out_of_span_ratio(w if name == "embed.weight" else w.T, sub) < 1e-5
        assert out_of_span_ratio(delta[name] if name == "embed.weight" else delta[name].T, sub) < 1e-5
    parts = rep.split(delta)
    assert len(parts) == 2 and sum(len(p) for p in parts) == len(delta)
    plain = ConstrainedReplica(spec.model, stages=2, subspace=None)
    plain.start_window(theta)
    tokens = _batches(1)[0][:, :-1]
    with torch.no_grad():
        assert torch.equal(plain.model(tokens), build_model(spec.model)(tokens))


def test_join_pipeline_options_are_all_or_nothing() -> None:
    from client.cli import _pipeline_options

    assert _pipeline_options(None, None, None, None) is None
    assert _pipeline_options("g", 1, 2, "127.0.0.1:5000") == {
        "group": "g",
        "stage": 1,
        "stages": 2,
        "rendezvous": "127.0.0.1:5000",
    }
    for bad in [("g", None, 2, "h:1"), (None, 0, None, None), ("g", 2, 2, "h:1"), ("g", 0, 1, "h:1")]:
        with pytest.raises(ConfigError):
            _pipeline_options(*bad)


# ---------------------------------------------------------------------- multi-process
@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage processes of one replica: a GPipe step per compression ratio, windows 0 and 1, then
    stage 1 crashes at the 2nd inner step of window 2 (os._exit); a restarted stage 1 joins the
    survivor for window 3 once the survivor has given window 2 up."""
    out = tmp_path_factory.mktemp("two_stage")
    port = free_port()
    survivor = _spawn(_grads_then_windows_worker, 0, port, str(out), [0, 1, 2, 3], -1)
    crasher = _spawn(_grads_then_windows_worker, 1, port, str(out), [0, 1, 2], 5)  # 2 steps per window
    restarted = _spawn(_third_stage_then_restart_worker, port, str(out), str(out / "w2_s0.json"))
    _run([survivor, crasher, restarted], limit_s=150)
    assert (survivor.exitcode, crasher.exitcode, restarted.exitcode) == (0, 17, 0)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("stages,ratio", GRAD_CASES)
def test_pipeline_matches_unsplit_model(two_stage_run: Path, stages: int, ratio: int) -> None:
    tmp_path = two_stage_run
    tokens = _batches(1)[0]
    spec = _spec(ratio)
    model = build_model(spec.model)
    cuts = [p.start for p in plan_stages(spec.model.n_layers, stages)[1:]]
    if ratio == 1:
        reference = model
    else:  # the unsplit model applying the same projection at the same boundaries
        sub = Subspace.for_run(spec.hash(), spec.model.dim, ratio)
        local, fixed = localize(_theta(spec), sub, constrained_names(4, cuts[-1]))
        load_params(model, local)
        reference = BoundaryTransformer.wrap(model, cuts, Boundary(sub), fixed)
    loss = lm_loss(reference, tokens)
    loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for s in range(stages):
        path = tmp_path / f"grads_S{stages}_r{ratio}_s{s}.safetensors"
        got.update(load_file(str(path)))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert float(meta["loss"]) == pytest.approx(loss.item(), abs=1e-6)
    assert set(got) == set(ref_grads)
    for name, g in got.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6, rtol=1e-4), (ratio, name)


@pytest.mark.integration
def test_replica_windows_commit_and_stay_in_subspace(two_stage_run: Path) -> None:
    tmp_path = two_stage_run
    spec = _spec(4)
    records = [json.loads((tmp_path / f"w1_s{s}.json").read_text()) for s in (0, 1)]
    assert all(r["ok"] and r["steps"] == 2 for r in records)
    assert set(records[0]["names"]).isdisjoint(records[1]["names"])
    assert set(records[0]["names"]) | set(records[1]["names"]) == set(_theta(spec))
    assert records[1]["metadata"] == {
        **records[1]["metadata"],
        "pipeline_group": "g",
        "pipeline_stage": 1,
        "pipeline_stages": 2,
        "compression_ratio": 4,
    }
    assert records[0]["loss"] == pytest.approx(records[1]["loss"])  # both stages know the loss
    sub = Subspace.for_run(spec.hash(), spec.model.dim, 4)
    first = load_file(str(tmp_path / "params_s0.safetensors"))
    last = load_file(str(tmp_path / "params_s1.safetensors"))
    assert out_of_span_ratio(first["embed.weight"], sub) < 1e-5
    assert out_of_span_ratio(first["blocks.1.mlp.w_down.weight"].T, sub) < 1e-5
    assert out_of_span_ratio(last["blocks.3.attn.wo.weight"].T, sub) > 0.5  # after the last boundary: free


@pytest.mark.integration
def test_stage_dying_mid_window_skips_the_window(two_stage_run: Path) -> None:
    skipped = json.loads((two_stage_run / "w2_s0.json").read_text())
    assert not skipped["ok"] and skipped["reason"] in ("peer_lost", "timeout")
    assert skipped["names"] == [] and skipped["steps"] == 1  # one step done, none published
    assert skipped["seconds"] < 3 * TIMEOUT_S + 10  # no hang: bounded by the link timeout
    assert not (two_stage_run / "w2_s1.json").exists()  # the crashed stage never reported
    resumed = [json.loads((two_stage_run / f"w3_s{s}.json").read_text()) for s in (0, 1)]
    assert all(r["ok"] for r in resumed)  # the replica continues with a restarted stage


# ---------------------------------------------------------------------- in the swarm
@pytest.mark.integration
@pytest.mark.slow
def test_pipeline_replica_trains_in_the_swarm_beside_full_replicas(tmp_path: Path) -> None:
    """2 full peers + one 2-stage pipeline replica (2 `sparseloco-peer join --pipeline` processes)
    + the validator: every stage contributes its slice, everyone holds the same θ after every window."""
    from test_integration_swarm import TIMEOUT_S as SWARM_TIMEOUT_S
    from test_integration_swarm import small

    from client.demo.swarm import LocalSwarm

    windows = 3
    overrides = small()
    overrides["pipeline"] = {
        "enabled": True,
        "compression_ratio": 8,
        "micro_batches": 2,
        "timeout_s": 30.0,
        "rendezvous_timeout_s": 120.0,
    }
    rendezvous = f"127.0.0.1:{free_port()}"
    with LocalSwarm(tmp_path / "run", peers=4, windows=windows, store="file", overrides=overrides) as swarm:
        for i in range(4):
            stage = ["--pipeline", "g", "--stage", str(i - 2), "--stages", "2", "--rendezvous", rendezvous]
            swarm.start_peer(i, *(stage if i >= 2 else []))
        swarm.follow(lambda: all(v.announced for v in swarm.peers.values()), timeout_s=SWARM_TIMEOUT_S)
        swarm.start_validator()
        swarm.follow(swarm.finished, timeout_s=SWARM_TIMEOUT_S)
        swarm.wait_exit(timeout_s=60.0)
        summary = swarm.summary()
        rows = swarm.log_contributions()
    assert summary["windows_completed"] == windows
    assert summary["fingerprints_equal"], {v.name: v.applied for v in swarm.peers.values()}
    stage_ids = {swarm.peers[f"peer-{i}"].peer_id for i in (2, 3)}
    for w in range(windows):
        for v in swarm.peers.values():
            assert v.windows[w].outcome == "uploaded", (v.name, w, v.windows[w])
        accepted = {r.peer for r in rows if r.window == w and r.accepted}
        assert stage_ids <= accepted, (w, [r for r in rows if r.window == w])
    losses = summary["val_loss_per_window"]
    assert losses[-1] < losses[0], losses


# ---------------------------------------------------------------------- a stage as a peer
def test_stage_that_skips_after_training_keeps_feedback(tmp_path: Path) -> None:
    """Both stages of a replica train window 1 (in threads, gloo), and the window closes while
    they train: nothing is sent and e is exactly what it was before the window, also on disk."""
    import threading
    from collections.abc import Callable

    from test_peer_state import LOCAL, MiniValidator, Recorder, committed_feedback, tiny_spec

    from client.peer import Peer, Staged
    from client.pipeline.trainer import StageTrainer
    from client.state import LocalState
    from client.window import Skipped
    from protocol import layout
    from protocol.events import PeerWindow
    from protocol.identity import Identity
    from protocol.store import open_store

    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(
        pipeline={
            "enabled": True,
            "compression_ratio": 4,
            "micro_batches": 2,
            "timeout_s": 30.0,
            "rendezvous_timeout_s": 60.0,
        }
    )
    store = open_store(f"memory://stage-skip-{time.time_ns()}")
    val = MiniValidator(spec, store, vident)
    rendezvous = f"127.0.0.1:{free_port()}"
    peers, displays = [], []
    for s in (0, 1):
        state = LocalState(tmp_path / f"stage{s}")
        trainer = StageTrainer(spec, group="g", stage=s, stages=2, rendezvous=rendezvous)
        displays.append(Recorder())
        ident = Identity.load_or_create(state.key_path)
        peers.append(Peer(spec, store, ident, state, trainer, local=LOCAL, display=displays[-1]))

    def train_both(window: int) -> list[Staged | Skipped]:
        out: dict[int, Staged | Skipped] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, peers[i].train(window))) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(out) == 2, out
        return [r for _, r in sorted(out.items())]

    for p in peers:
        p.join()
    for p, staged in zip(peers, train_both(0)):  # window 0 goes through: e is no longer zero
        assert isinstance(staged, Staged)
        p.upload(staged)
        p.flush()
    val.close_window(2)
    for p in peers:
        p.catch_up(need=1)
    assert [p.pos.window for p in peers] == [1, 1] and all(p.feedback.buffers for p in peers)
    before = [{n: t.clone() for n, t in p.feedback.buffers.items()} for p in peers]
    on_disk = [committed_feedback(p) for p in peers]

    started: list[int] = []
    lock = threading.Lock()

    def closing(update: Callable[..., None]) -> Callable[..., None]:
        def report(**fields: object) -> None:  # both stages past their start: close window 1
            update(**fields)
            if fields.get("window") == 1 and str(fields.get("phase", "")).startswith("pipeline"):
                with lock:
                    started.append(1)
                    if len(started) == 2:
                        val.close_window(0, timeout=0)  # window 1 closes while the stages train

        return report

    for p in peers:
        p.display.update = closing(p.display.update)  # type: ignore[method-assign]
    for p, work in zip(peers, train_both(1)):
        assert isinstance(work, Skipped) and "deadline" in work.reason, work
        p._skip(1, work)
    for p, display, e, disk in zip(peers, displays, before, on_disk):
        last = display.of(PeerWindow)[-1]
        assert (last.window, last.outcome) == (1, "skipped")
        assert all(torch.equal(p.feedback.buffers[n], e[n]) for n in e) and p.pending is None
        assert all(torch.equal(committed_feedback(p)[n], disk[n]) for n in disk)
    assert not store.list(layout.contrib_prefix(val.run, 1))
