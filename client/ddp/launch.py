"""What ``sparseloco-peer join`` does on each process of a ``torchrun`` launch.

    torchrun --standalone --nproc-per-node 8 $(which sparseloco-peer) join --run run.toml

    ranks = open_ranks(local)                   # None without torchrun (or with one process)
    if ranks is not None and ranks.rank != 0:
        sys.exit(serve(spec, local, ranks))     # train on rank 0's commands; exit status
    with lead(ranks):                           # rank 0: the other ranks stop when the peer does
        ...the ordinary peer, with DataParallelReplica as its trainer...

Rank 0 sends a heartbeat while the peer waits for the swarm; a rank lost meanwhile interrupts the
peer like Ctrl-C (``ranks.lost`` tells the two apart), so it withdraws and exits with
EXIT_RANK_LOST.

Only rank 0 opens the store, holds the identity and the state directory, and prints; the other
ranks need the RunSpec and the device only. When any process exits with an error, torchrun ends the
others; when a rank dies or stalls, rank 0 stops as if interrupted and withdraws its announcement.
"""

from __future__ import annotations

import _thread
from collections.abc import Iterator
from contextlib import contextmanager

from client.ddp.ranks import RankGroup, RankLost, torchrun_world
from client.ddp.replica import RankModel, serve_rank
from protocol.config import RunSpec
from protocol.devices import resolve_device
from protocol.errors import ConfigError
from protocol.settings import LocalSettings

__all__ = ["EXIT_RANK_LOST", "lead", "open_ranks", "serve"]

EXIT_RANK_LOST = 4
EXIT_INTERRUPTED = 130


def open_ranks(local: LocalSettings) -> RankGroup | None:
    """This process's rank of a torchrun launch on ``compute.device`` (None: a single process).

    Each rank takes its own GPU: ``cuda`` (or no device on a CUDA host) means ``cuda:LOCAL_RANK``."""
    if torchrun_world() is None:
        return None
    device = resolve_device(local.compute.device)
    if device.startswith("cuda:"):
        raise ConfigError(
            f"compute.device {device} under torchrun would put every rank on one GPU: give --device cuda "
            "(each rank uses cuda:LOCAL_RANK; CUDA_VISIBLE_DEVICES picks the GPUs)"
        )
    ranks = RankGroup.from_torchrun(device, timeout_s=local.compute.rank_timeout_s)
    if ranks.rank == 0:
        # A rank lost while the peer waits for the swarm interrupts it like Ctrl-C: it withdraws,
        # and the caller finds ``ranks.lost`` set.
        ranks.keep_alive(lambda exc: _thread.interrupt_main())
    return ranks


def serve(spec: RunSpec, local: LocalSettings, ranks: RankGroup) -> int:
    """Ranks 1…N−1: train on rank 0's commands; 0 when rank 0 stopped them, else EXIT_RANK_LOST."""
    try:
        serve_rank(RankModel(spec, ranks, local.compute.micro_batch_size))
    except RankLost:
        return EXIT_RANK_LOST  # rank 0 is gone or stalled: torchrun ends the rest
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED  # torchrun passes Ctrl-C / SIGTERM to every rank
    ranks.close()
    return 0


@contextmanager
def lead(ranks: RankGroup | None) -> Iterator[RankGroup | None]:
    """Rank 0 (or a single process, ``ranks`` None) while the peer runs: the other ranks are
    stopped on the way out, unless one of them is lost (then torchrun ends them)."""
    try:
        yield ranks
    finally:
        if ranks is not None:
            ranks.close()
