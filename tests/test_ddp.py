"""Data-parallel peers: 2 ranks in 2 OS processes over gloo on 127.0.0.1, against one process.

The ranks train the same windows as a :class:`client.replica.FullReplica` in this process (same
RunSpec, same data key, so the same batches): θ_local, the loss and the decoded Δ̂ must agree within
float tolerance, and both ranks must hold bit-identical parameters and moments afterwards. A rank
that dies mid-window must stop the other with RankLost within the collective timeout, never hang.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from client.ddp.ranks import RankGroup, RankLost, rank_device, torchrun_world
from client.ddp.replica import DataParallelReplica, RankModel, serve_rank, share_of
from client.demo.swarm import LocalSwarm
from client.pipeline.link import free_port
from client.replica import FullReplica
from client.window import Trained, WindowJob
from protocol.codec import Encoded, decode
from protocol.config import RunSpec
from protocol.devices import resolve_device
from protocol.errors import ConfigError
from protocol.feedback import FeedbackBuffers, FeedbackState
from protocol.layout import peer_key, run_id
from protocol.model import build_model, parameters_of
from protocol.store import open_store
from protocol.wire import decode_announcement

MODEL = dict(dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
KEY = "peer-ddp"
WINDOWS = 2
LIMIT_S = 120.0


def _spec() -> RunSpec:
    # 5 rows: the ranks' shares differ in size (3 and 2), as they do for any odd batch.
    # k = 64 in every window (warmup_k = 0): with the warm-up's 512 values per chunk, the neighbours
    # of a chunk's 2-level split lie within float rounding of each other, so a 2-rank sum can move
    # one value to the other level and Δ̂ no longer agrees within float tolerance. The torchrun peer
    # below runs the default warm-up against the validator's checks.
    return RunSpec.default().replace(
        model=MODEL,
        data={"seq_len": 16, "batch_size": 5},
        inner={"steps": 3, "warmup_steps": 1, "lr": 3e-3},
        outer={"warmup_k": 0},
    )


def _theta(spec: RunSpec) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in parameters_of(build_model(spec.model)).items()}


def _job(window: int, theta: dict[str, torch.Tensor], feedback: FeedbackState) -> WindowJob:
    return WindowJob(window, theta, "genesis", feedback, report=lambda **_: None, should_stop=lambda: False)


def _windows(trainer: FullReplica | DataParallelReplica, spec: RunSpec) -> list[tuple[Trained, dict[str, Encoded]]]:
    """``WINDOWS`` windows from the same θ, each folded into e before the next (what the peer does):
    every window's result and its Δ̂."""
    theta, e, out = _theta(spec), FeedbackBuffers(), []
    for window in range(WINDOWS):
        result = trainer.train(_job(window, theta, e.view()))
        assert isinstance(result, Trained)
        out.append((result, dict(result.fold(e, {}))))
    return out


def _params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().clone() for n, p in parameters_of(model).items()}


# ---------------------------------------------------------------------- ranks (child processes)
def _rank(rank: int, port: int, out: str, dying: int, timeout_s: float) -> None:
    """One rank of the peer; rank ``dying`` crashes at its second inner step (-1: none does)."""
    torch.set_num_threads(1)
    if rank == dying:
        real, calls = RankModel.step, [0]

        def crash(self: RankModel, batch: torch.Tensor) -> float:
            if calls[0] == 1:
                os._exit(17)  # a crash: no cleanup, sockets close under the other rank
            calls[0] += 1
            return real(self, batch)

        RankModel.step = crash  # type: ignore[method-assign]  # fault injection in this child only
    spec = _spec()
    ranks = RankGroup.open(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
    if rank == 0:
        replica = DataParallelReplica(spec, ranks, data_key=KEY)
        try:
            replica.load_state_dict(replica.state_dict())  # a restart's restore reaches every rank
            results = _windows(replica, spec)
        except RankLost as exc:
            Path(f"{out}/lost_0.txt").write_text(str(exc))
            os._exit(0)  # the group is broken: nothing left to close
        ranks.close()
        decoded = {f"{w}/{n}": decode(e) for w, (_, sent) in enumerate(results) for n, e in sent.items()}
        save_file(decoded, f"{out}/delta_0.safetensors")
        meta = [dict(r.metadata) for r, _ in results]
        Path(f"{out}/meta_0.json").write_text(json.dumps({"meta": meta, "step": replica.step}))
        local = replica.local
    else:
        local = RankModel(spec, ranks)
        try:
            serve_rank(local)
        except RankLost as exc:
            Path(f"{out}/lost_1.txt").write_text(str(exc))
            os._exit(0)
        ranks.close()
    save_file(_params_of(local.model), f"{out}/params_{rank}.safetensors")
    moments = {
        f"{i}/{k}": v.contiguous()
        for i, s in local.trainer.optimizer.state_dict()["state"].items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    }
    save_file(moments, f"{out}/moments_{rank}.safetensors")


def _run(procs: list[mp.process.BaseProcess], limit_s: float) -> None:
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


def _ranks(out: Path, *, dying: int = -1, timeout_s: float = 60.0) -> list[mp.process.BaseProcess]:
    port = free_port()
    ctx = mp.get_context("spawn")
    return [ctx.Process(target=_rank, args=(r, port, str(out), dying, timeout_s), daemon=True) for r in (0, 1)]


# ---------------------------------------------------------------------- tests
def test_shares_partition_the_batch() -> None:
    batch = torch.arange(5 * 3).reshape(5, 3)
    shares = [share_of(batch, r, 2) for r in (0, 1)]
    assert [s.shape[0] for s in shares] == [3, 2]
    assert torch.equal(torch.cat(shares), batch)
    assert share_of(batch[:1], 1, 2).shape[0] == 0  # more ranks than rows: an empty share


def test_resolve_device_checks_cuda_index(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("", default="cpu") == "cpu"
    with pytest.raises(ConfigError, match="not a torch device"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("") == "cpu"
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cuda") == "cuda"
    with pytest.raises(ConfigError, match=r"sees 2 CUDA devices \(cuda:0 … cuda:1"):
        resolve_device("cuda:2")


def test_torchrun_world_and_rank_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert torchrun_world() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun_world() == (3, 4, 1)
    assert rank_device("cpu", 1) == "cpu"
    set_to: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    assert rank_device("cuda", 1) == "cuda:1" and set_to == [torch.device("cuda:1")]
    with pytest.raises(ConfigError, match="cuda:2"):
        rank_device("cuda", 2)  # a third rank on a host with two GPUs


@pytest.mark.integration
def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    _run(_ranks(tmp_path), LIMIT_S)
    spec = _spec()
    torch.manual_seed(0)
    single = FullReplica(spec, data_key=KEY)
    expected = _windows(single, spec)
    # no drift: both ranks hold the same θ and the same moments, bit for bit
    p0, p1 = (load_file(str(tmp_path / f"params_{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(p0[n], p1[n]) for n in p0)
    m0, m1 = (load_file(str(tmp_path / f"moments_{r}.safetensors")) for r in (0, 1))
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)
    # what one process trains on the same batches
    for name, p in parameters_of(single.model).items():
        torch.testing.assert_close(p0[name], p.detach(), rtol=1e-4, atol=1e-5)
    meta = json.loads((tmp_path / "meta_0.json").read_text())
    assert meta["step"] == single.step == WINDOWS * spec.inner.steps
    for got, (want, _) in zip(meta["meta"], expected, strict=True):
        assert got["tokens"] == want.metadata["tokens"]
        assert got["loss_first"] == pytest.approx(want.metadata["loss_first"], rel=1e-5)
        assert got["loss_last"] == pytest.approx(want.metadata["loss_last"], rel=1e-5)
    delta = load_file(str(tmp_path / "delta_0.safetensors"))
    for window, (_, sent) in enumerate(expected):
        for name, enc in sent.items():
            torch.testing.assert_close(delta[f"{window}/{name}"], decode(enc), rtol=1e-3, atol=1e-6)


@pytest.mark.integration
@pytest.mark.parametrize("dying", [1, 0])
def test_a_rank_dying_mid_window_stops_the_other(tmp_path: Path, dying: int) -> None:
    """Rank 1 crashes: rank 0's window ends in RankLost (the peer stops and withdraws). Rank 0
    crashes: rank 1 stops with RankLost instead of waiting for commands forever."""
    started = time.monotonic()
    _run(_ranks(tmp_path, dying=dying, timeout_s=10.0), LIMIT_S)
    survivor = tmp_path / f"lost_{1 - dying}.txt"
    assert survivor.exists(), "the surviving rank did not report the lost rank"
    assert "rank_lost" in survivor.read_text()
    assert time.monotonic() - started < LIMIT_S


# ---------------------------------------------------------------------- a torchrun peer in a local run
SMALL: dict[str, dict[str, Any]] = {
    "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4},
    "inner": {"steps": 4, "lr": 3e-3, "warmup_steps": 2, "total_steps": 200},
    "windows": {"upload_deadline_s": 60.0, "gather_grace_s": 1.0, "checkpoint_every": 2},
    "validator": {"eval_sequences": 8, "eval_peers_per_window": 8},
}
SWARM_TIMEOUT_S = 240.0


@pytest.mark.integration
def test_torchrun_peer_joins_a_local_run(tmp_path: Path) -> None:
    """peer-0 is one process; peer-1 is ``torchrun --nproc-per-node 2 sparseloco-peer join``: one
    announcement (hardware ``2x cpu …``), one contribution per window, the same θ as everyone."""
    windows = 3
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    with LocalSwarm(tmp_path / "run", peers=2, windows=windows, store="file", overrides=SMALL) as swarm:
        swarm.start_peer(0)
        swarm.start_peer(1, launcher=torchrun)
        swarm.follow(lambda: all(v.announced for v in swarm.peers.values()), timeout_s=SWARM_TIMEOUT_S)
        swarm.start_validator()
        swarm.follow(swarm.finished, timeout_s=SWARM_TIMEOUT_S)
        swarm.wait_exit(timeout_s=60.0)
        summary = swarm.summary()
        assert swarm.spec is not None
        run_hash = swarm.spec.hash()
        with open_store(swarm.store_url) as store:
            blob = store.get(peer_key(run_id(run_hash), swarm.peers["peer-1"].peer_id))
        announced = decode_announcement(blob, run_hash=run_hash, max_bytes=len(blob))
    assert announced.value.hardware.startswith("2x cpu ")
    assert summary["windows_completed"] == windows and summary["fingerprints_equal"]
    assert summary["accepted_per_window"] == [2] * windows
    assert swarm.unaccounted() == []


def test_device_out_of_range_is_a_clear_error_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cuda:N`` past the GPUs torch sees: join/preflight (configuration error, exit 2)
    and ``sparseloco eval``/``sample`` (exit 1) say so before anything is downloaded or built."""
    from checkpoint_fixtures import make_run
    from click.testing import CliRunner

    from client.cli import _device
    from client.tools import main
    from protocol.settings import ComputeSettings, LocalSettings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"cuda:3, but torch sees 2 CUDA devices"):
        _device(LocalSettings(compute=ComputeSettings(device="cuda:3")))
    run = make_run(tmp_path, windows=(0,))
    for args in (["sample", "--prompt", "a"], ["eval", "--tasks", ""]):
        res = CliRunner().invoke(main, [*args, "--run", str(run.run_toml), "--device", "cuda:2"])
        assert res.exit_code == 1, res.output
        assert "cuda:2, but torch sees 2 CUDA devices" in res.output
