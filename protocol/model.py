"""The LLaMA-style decoder every participant builds identically from a :class:`ModelConfig`.

RMSNorm, rotary position embeddings, SwiGLU MLP, causal attention through
``scaled_dot_product_attention``, optional tied embeddings. θ₀ is a pure function of the config:
:func:`build_model` initialises on CPU in float32 from ``cfg.init_seed`` with its own generator, so
a peer on a GPU, a peer on a CPU and the validator hold the same bytes (:func:`fingerprint`).

The model is three kinds of submodules so pipeline stages can hold contiguous slices:
``model.embed`` (token embedding), ``model.blocks[i]`` (decoder blocks) and ``model.head``
(final norm + output projection). ``model.forward_slice(x, start, stop)`` runs blocks
``[start, stop)`` only.

    model = build_model(spec.model)
    loss = lm_loss(model, tokens)            # tokens: LongTensor [B, T+1]
    fingerprint(model)                       # 64 hex chars, equal on every participant
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.config import ModelConfig

__all__ = [
    "Transformer",
    "build_model",
    "autocast_for",
    "eval_loss",
    "fingerprint",
    "lm_loss",
    "param_schema",
    "parameters_of",
    "sequence_losses",
]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 even under autocast: bf16 variance loses too much precision.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_seq_len, head_dim/2] (float32, computed on CPU so every device agrees)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, H, T, D] by the position angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, d = x.shape
        shape = (b, t, self.n_heads, self.head_dim)
        q = self.wq(x).view(shape).transpose(1, 2)
        k = self.wk(x).view(shape).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.wo(y.transpose(1, 2).reshape(b, t, d))
        return out


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return out


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class Head(nn.Module):
    """Final RMSNorm and output projection. With tied embeddings the projection is the embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor, tied_weight: Tensor | None = None) -> Tensor:
        x = self.norm(x)
        if self.output is not None:
            out: Tensor = self.output(x)
            return out
        if tied_weight is None:
            raise ValueError("a tied head needs the embedding weight")
        return F.linear(x, tied_weight)


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(tokens [B, T]) -> logits [B, T, vocab]`` (float32)."""

    rope_cos: Tensor  # buffers (register_buffer): declared so they type as tensors
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so state dicts hold parameters only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, seq_len: int) -> tuple[Tensor, Tensor]:
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    def forward_slice(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Run blocks ``[start, stop)`` on hidden states x [B, T, dim] (pipeline stages)."""
        cos, sin = self.rope(x.shape[1])
        for block in self.blocks[start:stop]:
            x = block(x, cos, sin)
        return x

    def logits(self, x: Tensor) -> Tensor:
        tied = self.embed.weight if self.head.output is None else None
        out: Tensor = self.head(x, tied)
        return out.float()

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.forward_slice(self.embed(tokens), 0, len(self.blocks))
        return self.logits(h)


def build_model(cfg: ModelConfig) -> Transformer:
    """θ₀ for ``cfg``: built on CPU in float32 from ``cfg.init_seed`` (identical everywhere).

    Every weight matrix ~ N(0, init_std²), residual output projections (``wo``, ``w_down``) scaled
    by 1/√(2·n_layers) as in GPT-2, norms = 1. Parameters are filled in sorted-name order from one
    dedicated generator, so the global RNG state of the caller neither matters nor changes.
    """
    with torch.device("cpu"):
        model = Transformer(cfg)
    gen = torch.Generator(device="cpu").manual_seed(cfg.init_seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("wo.weight", "w_down.weight")) else cfg.init_std
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    return model


def parameters_of(model: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Named parameters (tied weights once), or the mapping itself when given a state dict."""
    if isinstance(model, nn.Module):
        inner = getattr(model, "_orig_mod", model)  # unwrap torch.compile
        return dict(inner.named_parameters())
    return dict(model)


def param_schema(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter, without allocating (built on the meta device)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def fingerprint(model: nn.Module | Mapping[str, Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter, names sorted.

    Two participants hold bit-identical θ iff their fingerprints match. Tensors are hashed from a
    contiguous CPU copy so the device does not matter.
    """
    h = hashlib.sha256()
    for name, t in sorted(parameters_of(model).items()):
        cpu = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{cpu.dtype}|{tuple(cpu.shape)}|".encode())
        h.update(cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b"")
    return h.hexdigest()


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Mean next-token cross-entropy on tokens [B, T+1] (inputs tokens[:, :-1], targets [:, 1:])."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model: nn.Module, batches: Iterable[Tensor], device: torch.device | str = "cpu") -> float:
    """Mean loss over batches, weighted by sequences; the model is left in its previous mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            with autocast_for(torch.device(device)):
                loss = lm_loss(model, batch)
            total += float(loss) * batch.shape[0]
            count += batch.shape[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("eval_loss needs at least one batch")
    return total / count


@torch.no_grad()
def sequence_losses(model: nn.Module, batches: Iterable[Tensor], device: torch.device | str = "cpu") -> Tensor:
    """Each sequence's mean next-token loss (float64 on the CPU, one entry per sequence of
    ``batches`` in order): what an error bar on a mean loss, or on a paired difference of two
    models' losses on the same sequences, is computed from. Its mean is :func:`eval_loss`'s value
    (every sequence has the same number of tokens), up to rounding."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            with autocast_for(torch.device(device)):
                logits = model(batch[:, :-1])
            per_token = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
            )
            out.append(per_token.view(batch.shape[0], -1).double().mean(dim=1).cpu())
    finally:
        model.train(was_training)
    if not out:
        raise ValueError("sequence_losses needs at least one batch")
    return torch.cat(out)


def autocast_for(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; disabled elsewhere (fp32 on CPU)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)
