"""SparseLoCo codec: chunk-wise Top-k, 2-bit values, compact index coding. Pure functions.

    enc = encode(x, spec.codec)          # Encoded: kept positions, codes, scales
    dense = decode(enc)                  # float32 tensor of x.shape, zeros where nothing was kept
    blob = pack(enc)                     # bytes of one tensor's payload
    enc2 = unpack(blob, x.shape, spec.codec)   # strict: raises ProtocolError subclasses
    flat_idx, values = to_sparse(enc)    # sorted flat indices + decoded float32 values

Selection (see :mod:`protocol.codec.chunking` for the chunk layout): in each chunk the ``k_c`` entries of
largest magnitude are kept. **Ties**: among equal magnitudes the entry with the lower position
inside the chunk wins, on every device (the common case has no tie at the boundary and uses a plain
``topk``; rows with a tie are redone with keys ``(|x| bits, −position)`` that are all distinct).
Zeros can be kept when a chunk has fewer than ``k_c`` non-zeros; they then decode to the chunk's low
level, which error feedback corrects over the next windows.

Value coding: :mod:`protocol.codec.quantizer` (2-bit sign + level codes). Index coding:
:mod:`protocol.codec.indexcoding`.

Payload layout of one tensor (little-endian; every section's length follows from the geometry,
except the Golomb unary stream, which must end exactly at the end of the payload)::

    u8   tag        (FORMAT << 4) | (index coding << 2) | value mode     — must match ``cfg``
    f32  base       per-tensor scale, finite and ≥ 0
    u8   scale codes[n_chunks × 2]       low and high level of each chunk
         codes      2-bit, bit-packed 4 per byte
                    (absent for rice: each code rides in the low bits of its A field)
         indices    packed12: 12 bits each | rice: u16 M, stream A, bit stream B·U (indexcoding)

Value mode 0 (2-bit codes) is the only one: ``unpack`` refuses any other with UnsupportedVersion.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from protocol.codec.bitpack import pack_bits, packed_size, unpack_bits
from protocol.codec.chunking import Geometry, geometry
from protocol.codec.indexcoding import decode_rice, encode_rice, pack12, unpack12
from protocol.codec.quantizer import SCALES_PER_CHUNK, dequantize, level_table, quantize
from protocol.config import CodecConfig
from protocol.errors import ConfigError, MalformedPayload, NonFiniteValues, UnsupportedVersion

FORMAT = 1
VALUE_MODE_2BIT = 0  # the value mode field of the tag: 2-bit sign + level codes
_INDEX_MODES = {"rice": 0, "packed12": 1}
_HEAD = struct.Struct("<Bf")

__all__ = ["Encoded", "encode", "decode", "pack", "unpack", "to_sparse", "geometry", "Geometry"]


@dataclass(frozen=True, eq=False)
class Encoded:
    """One compressed tensor.

    ``indices``: int64 (nnz,) chunk-local positions, chunks in order, ascending inside a chunk.
    ``codes``: (nnz,) uint8 2-bit codes (sign << 1 | high level), aligned with ``indices``.
    ``scale_codes``: uint8 (n_chunks, 2) log-coded low and high level of each chunk;
    ``base``: per-tensor scale.
    """

    shape: tuple[int, ...]
    cfg: CodecConfig
    indices: Tensor
    codes: Tensor
    scale_codes: Tensor
    base: float

    @property
    def nnz(self) -> int:
        """Number of kept values."""
        return int(self.indices.numel())

    @property
    def geometry(self) -> Geometry:
        return geometry(self.shape, self.cfg)

    def chunk_ids(self) -> Tensor:
        """int64 (nnz,): the chunk of every kept value."""
        g = self.geometry
        ks = g.chunk_ks().to(self.indices.device)
        return torch.repeat_interleave(torch.arange(g.n_chunks, device=self.indices.device), ks)

    def values(self) -> Tensor:
        """Decoded float32 kept values, aligned with ``indices``."""
        return dequantize(self.codes, self.scale_codes, self.chunk_ids(), self.base)


# --------------------------------------------------------------------------- encode
def encode(x: Tensor, cfg: CodecConfig) -> Encoded:
    """Chunk-wise Top-k of ``x`` and quantization of the kept values. Raises NonFiniteValues."""
    if not x.is_floating_point():
        raise TypeError(f"encode needs a floating tensor, got {x.dtype}")
    x = x.detach()
    g = geometry(x.shape, cfg)
    dev = x.device
    if g.n_chunks == 0:
        return _empty(g, cfg, dev)
    chunks = g.to_chunks(x.float())
    mags = chunks.abs()
    if not bool(torch.isfinite(mags.amax())):  # amax propagates NaN; one pass instead of two
        raise NonFiniteValues("input tensor has NaN or Inf")
    if g.last_size < g.chunk_len:
        mags[-1, g.last_size :] = -1.0  # padding is never selected before a real entry
    ks = g.chunk_ks().to(dev)
    pos = _select(mags, ks, g.k_full)
    vals = chunks.gather(1, pos)
    q = quantize(vals, ks)
    # Kept entries in ascending position order; entries past a short row's k go last and are dropped.
    width = pos.shape[1]
    cols = torch.arange(width, device=dev)
    valid = cols < ks.unsqueeze(1)
    pos, order = torch.sort(torch.where(valid, pos, g.chunk_len + cols), dim=1)
    codes = q.codes.gather(1, order)
    if g.k_last == g.k_full:
        flat_pos, flat_codes = pos.reshape(-1), codes.reshape(-1)
    else:
        flat_pos, flat_codes = pos[valid], codes[valid]
    return Encoded(tuple(x.shape), cfg, flat_pos, flat_codes, q.scale_codes, q.base)


def _select(mags: Tensor, ks: Tensor, kmax: int) -> Tensor:
    """Positions (rows of ``kmax``, descending magnitude) of the Top-k with lower-position ties."""
    width = mags.shape[1]
    k1 = min(kmax + 1, width)
    top, pos = torch.topk(mags, k1, dim=1, sorted=True)
    if k1 > kmax or (ks < kmax).any():
        # The set is ambiguous only when the k-th and (k+1)-th magnitudes are equal.
        inner = (ks < width).nonzero().squeeze(1)
        kth = top[inner].gather(1, (ks[inner] - 1).unsqueeze(1))
        nxt = top[inner].gather(1, ks[inner].clamp_max(k1 - 1).unsqueeze(1))
        tied = inner[(kth == nxt).squeeze(1)]
        if tied.numel():
            pos = pos.clone()
            pos[tied] = _select_exact(mags[tied], k1)
    return pos[:, :kmax]


def _select_exact(mags: Tensor, k: int) -> Tensor:
    """Top-k by the distinct keys (|x| float bits, −position): lower positions win ties."""
    width = mags.shape[1]
    shift = max(width - 1, 1).bit_length()
    rev = torch.arange(width - 1, -1, -1, device=mags.device, dtype=torch.int64)
    keys = (mags.contiguous().view(torch.int32).to(torch.int64) << shift) | rev
    top = torch.topk(keys, k, dim=1, sorted=True).values
    return (width - 1) - (top & ((1 << shift) - 1))


def _empty(g: Geometry, cfg: CodecConfig, dev: torch.device) -> Encoded:
    idx = torch.zeros(0, dtype=torch.int64, device=dev)
    codes = torch.zeros(0, dtype=torch.uint8, device=dev)
    scales = torch.zeros((0, SCALES_PER_CHUNK), dtype=torch.uint8, device=dev)
    return Encoded(g.shape, cfg, idx, codes, scales, 0.0)


# --------------------------------------------------------------------------- decode
def to_sparse(e: Encoded) -> tuple[Tensor, Tensor]:
    """Kept entries as (ascending flat indices into ``e.shape`` (int64), float32 values).

    On the CPU the result is the only allocation proportional to the kept values (12 bytes each):
    flat positions and values are written a block of chunks at a time (:data:`BLOCK` values), and
    tiled tensors are put in flat order by one in-place sort of (position, value bits) words."""
    if e.indices.device.type != "cpu" or not e.nnz:
        return _to_sparse_torch(e)
    g = e.geometry
    local, codes, scales = e.indices.numpy(), e.codes.numpy(), e.scale_codes.numpy()
    table = level_table(e.base).numpy()
    flat = np.empty(e.nnz, dtype=np.int64)
    vals = np.empty(e.nnz, dtype=np.float32)
    per = max(1, BLOCK // g.k_full)  # chunks per block; every chunk but the last keeps k_full
    for first in range(0, g.n_chunks, per):
        last = min(first + per, g.n_chunks)
        lo, hi = first * g.k_full, (last - 1) * g.k_full + (g.k_full if last < g.n_chunks else g.k_last)
        chunk = np.repeat(np.arange(first, last, dtype=np.int64), g.ks_np[first:last])
        flat[lo:hi] = g.flat_index_np(chunk, local[lo:hi])
        c = codes[lo:hi]
        level = table[scales[chunk, c & 1]]
        vals[lo:hi] = np.where(c & 2, -level, level)
    if g.tile_r > 1:  # tiles interleave rows; chunk order is not flat order
        _sort_pairs(flat, vals)
    return torch.from_numpy(flat), torch.from_numpy(vals)


#: Kept values converted per block of :func:`to_sparse` (its temporaries: a few arrays this long).
BLOCK = 1 << 14


def _sort_pairs(flat: npt.NDArray[np.int64], vals: npt.NDArray[np.float32]) -> None:
    """Sort ``flat`` ascending and ``vals`` along with it, in place: positions below 2^31 and the
    value's 32 bits share one int64 word (positions are unique, so the order is that of the
    positions), sorted in place and split again a block at a time."""
    if flat.size and int(flat.max()) >= 1 << 31:
        order = flat.argsort()
        flat[:], vals[:] = flat[order], vals[order]
        return
    bits = vals.view(np.uint32)
    for lo in range(0, flat.size, BLOCK):
        flat[lo : lo + BLOCK] <<= 32
        flat[lo : lo + BLOCK] |= bits[lo : lo + BLOCK]
    flat.sort()
    for lo in range(0, flat.size, BLOCK):
        np.bitwise_and(flat[lo : lo + BLOCK], 0xFFFFFFFF, out=bits[lo : lo + BLOCK], casting="unsafe")
        flat[lo : lo + BLOCK] >>= 32


def _to_sparse_torch(e: Encoded) -> tuple[Tensor, Tensor]:
    """:func:`to_sparse` with torch ops on ``e``'s device (an encoding made on an accelerator)."""
    flat = e.geometry.flat_index(e.chunk_ids(), e.indices)
    vals = e.values()
    if e.geometry.tile_r > 1:
        order = flat.argsort()
        flat, vals = flat[order], vals[order]
    return flat, vals


def decode(e: Encoded) -> Tensor:
    """Dense float32 tensor of ``e.shape`` on the device of ``e``; zeros where nothing was kept."""
    g = e.geometry
    out = torch.zeros(g.numel, dtype=torch.float32, device=e.indices.device)
    if e.nnz:
        out[g.flat_index(e.chunk_ids(), e.indices)] = e.values()
    return out.reshape(e.shape)


# --------------------------------------------------------------------------- bytes
def _tag(cfg: CodecConfig) -> int:
    return (FORMAT << 4) | (_INDEX_MODES[cfg.index_coding] << 2) | VALUE_MODE_2BIT


def _check_tag(tag: int, cfg: CodecConfig) -> None:
    """UnsupportedVersion for a format or value mode this codec does not have; MalformedPayload
    for an index coding other than ``cfg``'s."""
    if tag >> 4 != FORMAT:
        raise UnsupportedVersion(f"codec payload format {tag >> 4} is not supported (this client: {FORMAT})")
    if tag & 0b11 != VALUE_MODE_2BIT:
        raise UnsupportedVersion(f"value mode {tag & 0b11} is not supported (2-bit codes only)")
    if tag != _tag(cfg):
        raise MalformedPayload(f"payload tag {tag:#x} does not match the codec config ({_tag(cfg):#x})")


def _check_packable(g: Geometry, cfg: CodecConfig) -> None:
    if cfg.index_coding == "packed12" and g.chunk_len > 4096:
        raise ConfigError("codec.index_coding = packed12 needs chunks of at most 4096 values")


def pack(e: Encoded) -> bytes:
    """Serialize one tensor's payload (layout in the module doc)."""
    g, cfg = e.geometry, e.cfg
    _check_packable(g, cfg)
    parts = [_HEAD.pack(_tag(cfg), e.base), e.scale_codes.cpu().numpy().astype(np.uint8).tobytes()]
    codes = e.codes.cpu().numpy()
    local = e.indices.cpu().numpy().astype(np.int64, copy=False)
    if cfg.index_coding == "rice":  # the codes ride in the Golomb A field: one packing pass for both
        parts.append(encode_rice(local, g.ks_np, codes, 2, uniform=g.k_last == g.k_full, max_len=g.chunk_len))
    else:
        parts += [pack_bits(codes, 2), pack12(local)]
    return b"".join(parts)


def unpack(data: bytes, shape: tuple[int, ...], cfg: CodecConfig) -> Encoded:
    """Parse and validate one tensor's payload; raises ProtocolError subclasses, never crashes.

    Every section's size is derived from ``shape`` and checked against ``len(data)`` before
    anything proportional to the shape is allocated.
    """
    if any(int(d) < 0 for d in shape):
        raise MalformedPayload(f"negative dimension in shape {tuple(shape)}")
    g = geometry(shape, cfg)
    if cfg.index_coding == "packed12" and g.chunk_len > 4096:  # the sender's codec cannot be packed12
        raise MalformedPayload(f"packed12 indices in chunks of {g.chunk_len} values (at most 4096)")
    view = memoryview(data)
    n_scales = g.n_chunks * SCALES_PER_CHUNK
    code_bytes = 0 if cfg.index_coding == "rice" else packed_size(g.nnz, 2)
    fixed = _HEAD.size + n_scales + code_bytes
    if len(view) < fixed:
        raise MalformedPayload(f"payload of {len(view)} bytes is shorter than its fixed part ({fixed})")
    tag, base = _HEAD.unpack_from(view, 0)
    _check_tag(tag, cfg)
    if not np.isfinite(base):
        raise NonFiniteValues("non-finite tensor scale")
    if base < 0:
        raise MalformedPayload("negative tensor scale")
    pos = _HEAD.size
    scales = np.frombuffer(view[pos : pos + n_scales], dtype=np.uint8).reshape(g.n_chunks, SCALES_PER_CHUNK)
    pos += n_scales
    ks, sizes = g.ks_np, g.sizes_np
    if cfg.index_coding == "rice":
        local, side = decode_rice(view[pos:], ks, sizes, 2)
    else:
        side = unpack_bits(view[pos : pos + code_bytes], g.nnz, 2, "codes").astype(np.uint8)
        local = unpack12(view[pos + code_bytes :], ks, sizes)
    codes = torch.from_numpy(side)
    return Encoded(
        g.shape,
        cfg,
        torch.from_numpy(local.astype(np.int64, copy=False)),
        codes,
        torch.from_numpy(scales.copy()),
        float(base),
    )
