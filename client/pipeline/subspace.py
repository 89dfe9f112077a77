"""Subspace compression of the activations that cross pipeline-stage boundaries.

A pipeline replica (stages of small GPUs holding contiguous layer slices) sends, at every stage
boundary, the residual stream ``h`` minus the part the receiver can rebuild on its own — the *fixed
token embedding* of the token ids — projected on a fixed orthonormal basis ``U ∈ R^{d×k}``::

    c = (h − T_fix[tokens]) · U          # k numbers per token instead of d
    h = c · Uᵀ + T_fix[tokens]           # on the receiving stage; gradients go back as g·U, then ·Uᵀ

``U`` is the Q factor of a seeded Gaussian (computed on CPU in float64, stored as float32), seeded
from the run hash, so every stage of every replica builds it without communicating
(:meth:`Subspace.digest` lets stages check they agree). The compression is lossless for residual
streams that lie in ``span(U)`` (up to fp32 rounding) because every weight that writes into the
residual stream before the last boundary is kept there (:func:`project_parameters_`)::

    W_o    ← U Uᵀ W_o       (attention output, rows = residual dimension)
    W_down ← U Uᵀ W_down    (MLP down projection)
    E      ← E U Uᵀ         (trainable embedding)

Blocks after the last boundary write into a stream that is never sent, so they stay unconstrained.

**Drift.** Full replicas train without the constraint, so every aggregate moves the global θ out of
the subspace. :func:`localize` turns the synchronised θ into a pipeline replica's working copy at the
start of each window: the constrained block weights are re-projected, and the embedding is split as
``E = E·UUᵀ + E·(I − UUᵀ)`` — the in-span part stays trainable, the out-of-span part becomes the fixed
embedding ``T_fix``. The token embedding ``E_local[t] + T_fix[t]`` therefore equals ``E[t]`` (the
function is unchanged up to one fp32 rounding; tests and ``scripts/bench_pipeline.py`` measure it),
and ``T_fix`` is high-rank and frozen within the window. At genesis ``T_fix`` is the out-of-span part
of the seeded initial embedding. The pseudo-gradient is taken against the localized start, so a
pipeline replica never sends the projection itself as an update.

    sub = Subspace.for_run(spec.hash(), spec.model.dim, spec.pipeline.compression_ratio)
    local, fixed = localize(global_params, sub, constrained_names(spec.model.n_layers, last_boundary))
    c = sub.compress(h, fixed[tokens]); h2 = sub.decompress(c, fixed[tokens])
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from protocol.errors import ConfigError

__all__ = [
    "EMBEDDING",
    "Subspace",
    "basis_seed",
    "constrained_names",
    "localize",
    "orthonormal_basis",
    "out_of_span_ratio",
    "project_parameters_",
    "subspace_rank",
]

EMBEDDING = "embed.weight"


def subspace_rank(dim: int, compression_ratio: int) -> int:
    """k = d / ratio (at least 1). Ratio 1 means no compression (k = d)."""
    if compression_ratio < 1:
        raise ConfigError(f"compression ratio must be >= 1, got {compression_ratio}")
    if dim < 1:
        raise ConfigError(f"model dim must be >= 1, got {dim}")
    return max(1, dim // compression_ratio)


def basis_seed(run_hash: str) -> int:
    """A 63-bit seed derived from the run hash (every participant of the run derives the same)."""
    digest = hashlib.sha256(f"sparseloco/subspace/{run_hash}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def orthonormal_basis(dim: int, rank: int, seed: int) -> Tensor:
    """U [dim, rank], orthonormal columns: QR of a seeded Gaussian, signs fixed by diag(R) > 0.

    Built on CPU in float64 with its own generator, then rounded to float32, so the caller's RNG
    state and device do not matter and LAPACK differences below float64 precision do not survive.
    """
    if not 1 <= rank <= dim:
        raise ConfigError(f"subspace rank must be in 1..{dim}, got {rank}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gauss = torch.randn(dim, rank, generator=gen, dtype=torch.float64)
    q: Tensor  # torch.linalg's functions are typed Any
    r: Tensor
    q, r = torch.linalg.qr(gauss, mode="reduced")
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(torch.float32).contiguous()


@dataclass(frozen=True, eq=False)
class Subspace:
    """The fixed projection ``U`` shared by all stages of all pipeline replicas of a run."""

    basis: Tensor  # [d, k] float32, orthonormal columns

    @classmethod
    def for_run(cls, run_hash: str, dim: int, compression_ratio: int) -> Subspace:
        return cls(orthonormal_basis(dim, subspace_rank(dim, compression_ratio), basis_seed(run_hash)))

    @property
    def dim(self) -> int:
        return int(self.basis.shape[0])

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    def to(self, device: torch.device | str) -> Subspace:
        return Subspace(self.basis.to(device))

    def digest(self) -> str:
        """sha256 of U's bytes: stages compare it at rendezvous."""
        return hashlib.sha256(self.basis.detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    # ------------------------------------------------------------------ activations
    def compress(self, h: Tensor, fixed_rows: Tensor) -> Tensor:
        """c = (h − T_fix[tokens])·U : [..., d] -> [..., k]. Differentiable (backward: g_c·Uᵀ)."""
        u = self.basis.to(h.dtype)
        return (h - fixed_rows.to(h.dtype)) @ u

    def decompress(self, c: Tensor, fixed_rows: Tensor) -> Tensor:
        """h = c·Uᵀ + T_fix[tokens] : [..., k] -> [..., d]. Differentiable (backward: g_h·U)."""
        u = self.basis.to(c.dtype)
        return c @ u.T + fixed_rows.to(c.dtype)

    def project(self, x: Tensor) -> Tensor:
        """x·UUᵀ along the last dimension (the part of x the boundary transmits)."""
        u = self.basis.to(x.dtype)
        return (x @ u) @ u.T

    # ------------------------------------------------------------------ weights
    def project_writes(self, weight: Tensor) -> Tensor:
        """U Uᵀ W for a linear weight [d_out = d, d_in]: its outputs (residual writes) lie in span(U)."""
        u = self.basis.to(weight.dtype)
        return u @ (u.T @ weight)

    def split_embedding(self, embedding: Tensor) -> tuple[Tensor, Tensor]:
        """E -> (E·UUᵀ, E − E·UUᵀ): the trainable in-span part and the fixed out-of-span part."""
        in_span = self.project(embedding)
        return in_span, embedding - in_span


def constrained_names(n_layers: int, last_boundary: int) -> list[str]:
    """Parameters that write into a residual stream that crosses a boundary.

    ``last_boundary`` is the index of the first block after the last stage boundary (the last
    stage's first block); blocks from there on are never followed by a boundary and stay free.
    With no boundary (``last_boundary == 0``) nothing is constrained.
    """
    if not 0 <= last_boundary <= n_layers:
        raise ConfigError(f"last boundary {last_boundary} outside 0..{n_layers}")
    if last_boundary == 0:
        return []
    names = [EMBEDDING]
    for i in range(last_boundary):
        names += [f"blocks.{i}.attn.wo.weight", f"blocks.{i}.mlp.w_down.weight"]
    return names


@torch.no_grad()
def project_parameters_(params: Mapping[str, Tensor], sub: Subspace, names: Iterable[str]) -> None:
    """In place: keep the named residual writers in span(U) (call after every inner step)."""
    for name in names:
        p = params.get(name)
        if p is None:
            continue  # another stage holds it
        p.copy_(sub.project(p) if name == EMBEDDING else sub.project_writes(p))


@torch.no_grad()
def localize(
    params: Mapping[str, Tensor], sub: Subspace, names: Iterable[str]
) -> tuple[dict[str, Tensor], Tensor | None]:
    """Synchronised θ -> (a pipeline replica's working θ, the fixed embedding T_fix).

    Constrained block weights are re-projected into span(U); the embedding is split so that
    ``E_local + T_fix == E`` (up to one rounding): the model function of the embedding is unchanged.
    Returns new tensors; ``params`` is not modified. T_fix is None when the embedding is not
    constrained (no boundary).
    """
    chosen = set(names)
    local: dict[str, Tensor] = {}
    fixed: Tensor | None = None
    for name, p in params.items():
        if name not in chosen:
            local[name] = p.detach().clone()
        elif name == EMBEDDING:
            local[name], fixed = sub.split_embedding(p.detach())
        else:
            local[name] = sub.project_writes(p.detach())
    return local, fixed


def out_of_span_ratio(x: Tensor, sub: Subspace) -> float:
    """‖x − x·UUᵀ‖ / ‖x‖ along the last dimension (0 for x in span(U); ≈ √(1 − k/d) for random x)."""
    xf = x.detach().double()
    u = sub.basis.to(xf.device, torch.float64)
    resid = xf - (xf @ u) @ u.T
    norm = float(xf.norm())
    return float(resid.norm()) / norm if norm > 0 else 0.0
