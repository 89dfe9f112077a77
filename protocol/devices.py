"""Which torch device a command computes on: ``--device`` / ``compute.device``, checked before use.

    resolve_device("cuda:1")              # "cuda:1" when torch sees at least 2 CUDA devices
    resolve_device("", default="cpu")     # the validator's default
    resolve_device("")                    # a peer's default: "cuda" when torch sees one, else "cpu"
    resolve_device("cuda:7")              # ConfigError: torch sees 2 CUDA devices (cuda:0 … cuda:1)

Peers, the validator and the model tools (``sparseloco eval``/``sample``) share this check, so a
mistyped or out-of-range device fails at start with one clear message instead of deep inside the
first forward pass. Under ``torchrun`` a bare ``cuda`` means this rank's GPU (``LOCAL_RANK``); see
:mod:`client.ddp.ranks`.
"""

from __future__ import annotations

import torch

from protocol.errors import ConfigError

__all__ = ["AUTO", "resolve_device"]

AUTO = "auto"  # the default of a peer: CUDA when torch sees it, else the CPU


def resolve_device(name: str, *, default: str = AUTO) -> str:
    """``name`` checked against what torch sees ("" → ``default``; ``auto`` → cuda or cpu).

    Raises ConfigError for a string torch cannot parse, a CUDA device when torch sees none, and
    ``cuda:N`` with N out of range."""
    name = name.strip() or default
    if name == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"compute.device {name!r} is not a torch device (cpu, cuda, cuda:1 …): {exc}") from exc
    if device.type == "cuda":
        _check_cuda(name, device.index)
    return name


def _check_cuda(name: str, index: int | None) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(f"compute.device is {name}, but torch sees no CUDA device")
    count = torch.cuda.device_count()
    if index is not None and not 0 <= index < count:
        last = f"cuda:{count - 1}"
        raise ConfigError(
            f"compute.device is {name}, but torch sees {count} CUDA device{'s' if count > 1 else ''} "
            f"(cuda:0 … {last}; CUDA_VISIBLE_DEVICES renumbers them from 0)"
        )
