"""Value coding of the kept entries: 2-bit sign + magnitude level.

What Top-k keeps is the tail of each chunk: large magnitudes of both signs, never values near zero.
A quantizer centred on the mean (the production scheme: 4 bins of 1.5σ around the mean) spends half
its codes on a centre bin that decodes to ≈ 0. Here the 2 bits are a **sign** and a **magnitude
level** (low/high) instead:

* per chunk the kept magnitudes are split into two groups by the exact optimal (least squares)
  2-level split — in sorted order the best split is a cut point, found for all chunks at once from
  prefix sums — and each group's level is its mean magnitude;
* the two levels are sent as 8-bit log codes relative to a per-tensor fp32 ``base``:
  ``level(c) = base · 2^((c − 255)/16)`` for c ≥ 1 (steps of 4.4 %, 16 octaves), ``level(0) = 0``;
  that is 16 bits per chunk for the scales;
* each value then takes the nearer of the two *coded* levels, so the residual the error feedback
  keeps is measured against what the receiver decodes.

Code of a value: ``bit1 = sign (1 = negative)``, ``bit0 = high level``. Decoding is a table lookup
(the 256-entry level table is built on the CPU in float64 and rounded once, so every device decodes
bit-identical values) and a negation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_STEPS = 16  # log-code steps per octave
TOP_CODE = 255
SCALES_PER_CHUNK = 2  # the low and the high level


@dataclass(frozen=True)
class Quantized:
    """Codes (same layout as the input values), per-chunk scale codes and the per-tensor base."""

    codes: Tensor  # uint8, 2 bits used: sign << 1 | high level
    scale_codes: Tensor  # uint8 (n_chunks, 2): log codes of the low and the high level
    base: float


def level_table(base: float, device: torch.device | str = "cpu") -> Tensor:
    """The 256 decodable magnitudes for ``base`` (float32, bit-identical on every device)."""
    exps = torch.arange(-TOP_CODE, 1, dtype=torch.float64) / LOG_STEPS
    table = (torch.exp2(exps) * base).to(torch.float32)
    table[0] = 0.0
    return table.to(device)


def _log_code(level: Tensor, base: float) -> Tensor:
    """Nearest log code of non-negative float32 levels; 0 for level 0."""
    if base <= 0.0:
        return torch.zeros_like(level, dtype=torch.uint8)
    c = torch.round(TOP_CODE + LOG_STEPS * torch.log2(level.double() / base))
    c = torch.where(level > 0, c.clamp(1, TOP_CODE), torch.zeros_like(c))
    return c.to(torch.uint8)


def _split_levels(mags: Tensor, ks: Tensor) -> tuple[Tensor, Tensor]:
    """Optimal 2-level split of each row's first ``ks`` magnitudes (sorted descending)."""
    width = mags.shape[1]
    top = mags[:, :1].clamp_min(torch.finfo(torch.float32).tiny)
    norm = mags / top  # normalised to [0, 1]: no overflow for huge finite inputs
    prefix = norm.cumsum(1)
    cols = torch.arange(1, width + 1, device=mags.device)
    total = prefix.gather(1, (ks - 1).unsqueeze(1))
    rest = (ks.unsqueeze(1) - cols).clamp_min(1)
    score = prefix.square() / cols + (total - prefix).square() / rest
    score = torch.where(cols < ks.unsqueeze(1), score, torch.full_like(score, -1.0))
    cut = torch.where(ks > 1, score.argmax(1) + 1, ks)  # number of values on the high level
    s_cut = prefix.gather(1, (cut - 1).unsqueeze(1)).squeeze(1)
    hi = s_cut / cut
    lo = torch.where(ks > cut, (total.squeeze(1) - s_cut) / (ks - cut).clamp_min(1), hi)
    scale = top.squeeze(1) * (mags[:, 0] > 0)
    return lo * scale, hi * scale


def quantize(vals: Tensor, ks: Tensor) -> Quantized:
    """Quantize rows of kept values (sorted by descending magnitude; row r uses ``ks[r]`` entries).

    Entries past ``ks[r]`` get arbitrary codes and are dropped by the caller.
    """
    vals = vals.float()
    if vals.numel() == 0:
        empty = torch.zeros((vals.shape[0], SCALES_PER_CHUNK), dtype=torch.uint8, device=vals.device)
        return Quantized(torch.zeros_like(vals, dtype=torch.uint8), empty, 0.0)
    mags = vals.abs()
    lo, hi = _split_levels(mags, ks)
    base = float(hi.max())
    table = level_table(base, vals.device)
    lo_c, hi_c = _log_code(lo, base), _log_code(hi, base)
    lo_q, hi_q = table[lo_c.long()].unsqueeze(1), table[hi_c.long()].unsqueeze(1)
    high = (mags - lo_q).abs() > (hi_q - mags).abs()
    codes = ((vals < 0).to(torch.uint8) << 1) | high.to(torch.uint8)
    return Quantized(codes, torch.stack([lo_c, hi_c], 1), base)


def dequantize(codes: Tensor, scale_codes: Tensor, chunk: Tensor, base: float) -> Tensor:
    """Decoded float32 values of flat ``codes``; ``chunk[i]`` is the chunk of value ``i``."""
    table = level_table(base, codes.device)
    c = codes.long()
    level = table[scale_codes.long()[chunk, c & 1]]
    return torch.where((c & 2) > 0, -level, level)
