"""GGUF block bytes from float32 weights, so that quantized checkpoints can be written offline
(and a float model's linears served as int8 blocks, `quantization="int8"`: Q8_256, ours, where
the inputs are whole super-blocks, else Q8_0).

The `gguf` package quantizes the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) but only
dequantizes the K-quants; Q2_K, Q3_K, Q4_K, Q5_K and Q6_K are packed here, in vectorized numpy,
into llama.cpp's block layouts (ggml-common.h), 256 weights a super-block:

- block_q4_K: d (f16), dmin (f16), scales[12], qs[128]. Eight sub-blocks of 32 weights,
  y = d * sc * q - dmin * m, q in 0..15, sc and m 6-bit, packed as `get_scale_min_k4` reads them.
  qs byte l of 32-byte chunk c holds sub-block 2c's weight l (low nibble) and 2c+1's (high).
- block_q5_K: d, dmin, scales[12], qh[32], qs[128]: the same with q in 0..31; bit s of qh[l] is
  the fifth bit of sub-block s's weight l.
- block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16). Sixteen sub-blocks of 16 weights,
  y = d * sc * (q - 32), q in 0..63; each half of 128 weights is four rows of 32: its ql byte l
  holds weight l of rows 0 and 2 (low, high nibble), byte 32 + l that of rows 1 and 3, and its
  qh byte l the top two bits of all four (row r at bit 2r).

- block_q2_K: scales[16], qs[64], d (f16), dmin (f16). Sixteen sub-blocks of 16 weights,
  y = d * sc * q - dmin * m, q in 0..3, sc and m 4-bit (a byte a sub-block: sc low, m high), qs
  as Q3_K's two low bits.
- block_q3_K: hmask[32], qs[64], scales[12], d (f16). Sixteen sub-blocks of 16 weights,
  y = d * sc * q, q in -4..3 (stored + 4: two low bits in qs, the third in hmask), sc 6-bit
  (stored + 32). Each half of 128 weights is four rows of 32, row j's low bits at bits 2j of its
  32 qs bytes and its third bits at bit 4 * half + j of the hmask bytes; scale s's low nibble is
  byte s % 8's (low for s < 8), its top two bits at bits 2 * (s // 4) of byte 8 + s % 4.

The quantizer is the simple one: a sub-block's min and max (its signed peak for Q6_K) give its
scale, and the scales are rounded onto multiples of the super-block's f16 scale. llama.cpp
searches for the scales of least error instead: its files are a little more accurate and
differ bit for bit, in the same format, which is what test and benchmark checkpoints need.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from torch import nn

from paged_backend.cpu.linear import swap_linears_
from paged_backend.cpu.quant import QuantLinear, QuantWeight, vnni_gemm_built, vnni_strips

QK_K = 256  # weights in a K-quant super-block
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_CHUNK = 1 << 21  # weights quantized at once: bounds the temporaries of a large tensor


def quantize(weights: np.ndarray, type_name: str) -> np.ndarray:
    """`weights` [rows, cols] as blocks of the GGUF type `type_name` (one of `TYPES`): uint8
    [rows, bytes_per_row], what `gguf.quants.dequantize` and llama.cpp read."""
    if type_name not in TYPES:
        raise ValueError(f"cannot quantize to {type_name!r}; types: {', '.join(TYPES)}")
    if weights.ndim != 2:
        raise ValueError(f"quantize takes [rows, cols] weights, got shape {weights.shape}")
    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = weights.shape
    if cols % block_size:
        raise ValueError(f"{type_name} rows hold a multiple of {block_size} weights, not {cols}")
    out = np.empty((rows, cols // block_size * type_size), np.uint8)
    step, pack = max(1, _CHUNK // cols), _K_PACKERS.get(type_name)
    for start in range(0, rows, step):
        chunk = np.asarray(weights[start : start + step], dtype=np.float32)
        packed = gguf_quantize(chunk, qtype) if pack is None else pack(chunk.reshape(-1, QK_K))
        out[start : start + step] = packed.reshape(len(chunk), -1)
    return out


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, and 0 where b is 0: a sub-block (or super-block) of zeros has scale 0."""
    out = np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32)
    return np.divide(a, b, out=out, where=b != 0)


def _on_super_scale(scales: np.ndarray, levels: int, *, keep: bool) -> tuple[np.ndarray, ...]:
    """Sub-block scales [n, k] as d * sc: the super-block's f16 scale d [n] and the integers sc
    in [-levels, levels], rounded against d as stored (f16), which is what readers use. d stays
    within f16's range (weights below ~1e-6 would round it to 0, wiping the block). With `keep`,
    a nonzero scale keeps |sc| >= 1: a sub-block far smaller than its super-block's largest
    (beside an outlier) would otherwise collapse to one value; one step of d errs less."""
    peak = np.abs(scales).max(axis=-1)
    d = np.where(peak > 0, np.clip(peak / levels, 2.0**-24, 65504), 0).astype(np.float16)
    sc = np.clip(np.rint(_divide(scales, d.astype(np.float32)[:, None])), -levels, levels)
    if keep:
        sc = np.where((sc == 0) & (scales != 0), np.sign(scales), sc)
    return d, sc


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.reshape(-1, 1).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Eight sub-blocks of 32 4-bit values [n, 8, 32] as Q4_K's qs [n, 128]."""
    pairs = (q & 15).reshape(len(q), 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(len(q), 128)


def _min_max_levels(blocks: np.ndarray, bits: int, group: int, scale_levels: int) -> tuple:
    """Q2_K's, Q4_K's and Q5_K's shared part: (d, sc, dmin, m, q [n, 256 / group, group]). A
    sub-block spans its min (at most 0, as in llama.cpp) to its max in 2**bits - 1 steps."""
    levels = (1 << bits) - 1
    x = blocks.reshape(len(blocks), QK_K // group, group)
    low = np.minimum(x.min(axis=-1), 0)
    d, sc = _on_super_scale((x.max(axis=-1) - low) / levels, scale_levels, keep=True)
    dmin, m = _on_super_scale(-low, scale_levels, keep=False)
    step = d.astype(np.float32)[:, None, None] * sc[..., None]
    offset = dmin.astype(np.float32)[:, None, None] * m[..., None]
    q = np.clip(np.rint(_divide(x + offset, step)), 0, levels).astype(np.uint8)
    return d, sc.astype(np.uint8), dmin, m.astype(np.uint8), q


def _min_max_blocks(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's shared part: (d, dmin, scales[12] bytes [n, 16], q [n, 8, 32])."""
    d, sc, dmin, m, q = _min_max_levels(blocks, bits, 32, 63)
    packed_scales = [
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
    ]
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), *packed_scales], axis=1), q


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _min_max_blocks(blocks, 4)
    return np.concatenate([head, _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _min_max_blocks(blocks, 5)
    fifth_bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]
    qh = fifth_bits.sum(axis=1, dtype=np.uint8)  # distinct bits: the sum is their OR
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def _signed_levels(blocks: np.ndarray, bits: int, scale_levels: int) -> tuple[np.ndarray, ...]:
    """Q3_K's and Q6_K's shared part: (d, sc [n, 16], q + 2**(bits-1) [n, 16, 16]). A
    sub-block's signed peak maps to the lowest level, -2**(bits-1), so that its whole range
    serves."""
    low_level = 1 << (bits - 1)
    x = blocks.reshape(len(blocks), 16, 16)
    high, low = x.max(axis=-1), x.min(axis=-1)
    peak = np.where(high >= -low, high, low)
    d, sc = _on_super_scale(peak / -low_level, scale_levels, keep=True)
    step = d.astype(np.float32)[:, None, None] * sc[..., None]
    q = np.clip(np.rint(_divide(x, step)), -low_level, low_level - 1) + low_level
    return d, sc, q.astype(np.uint8)


_SHIFTS = np.arange(4, dtype=np.uint8)[:, None]


def _two_bits(q: np.ndarray) -> np.ndarray:
    """Levels [n, 256] as Q2_K's and Q3_K's qs [n, 64]: each half of 128 weights is four rows of
    32, row j's two low bits at bits 2j of the half's 32 bytes."""
    rows = q.reshape(len(q), 2, 4, 32)
    return ((rows & 3) << (2 * _SHIFTS)).sum(axis=2, dtype=np.uint8).reshape(len(q), 64)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, dmin, m, q = _min_max_levels(blocks, 2, 16, 15)
    return np.concatenate([sc | (m << 4), _two_bits(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    d, sc, q = _signed_levels(blocks, 3, 31)
    third = (q >> 2).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    hmask = third.sum(axis=1, dtype=np.uint8)  # distinct bits: the sum is their OR
    u = (sc + 32).astype(np.uint8)
    low = (u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)
    top = ((u >> 4).reshape(n, 4, 4) << (2 * _SHIFTS)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([hmask, _two_bits(q), low, top, _f16_bytes(d)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    d, sc, q = _signed_levels(blocks, 6, 127)
    rows = q.reshape(n, 2, 4, 32)  # two halves of four rows of 32
    ql = (rows[:, :, :2] & 15) | ((rows[:, :, 2:] & 15) << 4)
    qh = ((rows >> 4) << (2 * _SHIFTS)).sum(axis=2, dtype=np.uint8)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(d)], axis=1)


_K_PACKERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def q8_256_blocks(weight, row_scales: bool = False) -> QuantWeight:
    """`weight` [rows, cols] (cols a multiple of 256; see `int8_weight`) as Q8_256 blocks: each
    256 inputs of a row as int8 levels round(w / d), d = their largest |w| / 127, then d (fp32);
    with `row_scales`, d = the row's largest |w| / 127 (one scale an output channel, in each of
    its super-blocks). A few rows at a time, so a large table (a tied head) is never copied whole
    in fp32."""
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"Q8_256 rows hold a multiple of {QK_K} weights, not {cols}")
    out = torch.empty(rows, cols // QK_K, QK_K + 4, dtype=torch.uint8)
    step = max(1, _CHUNK // cols)
    for start in range(0, rows, step):
        w = torch.as_tensor(weight[start : start + step]).float().view(-1, cols // QK_K, QK_K)
        over = (-1, -2) if row_scales else -1
        d = w.abs().amax(over, keepdim=True).expand(-1, cols // QK_K, 1) / 127
        levels = torch.where(d > 0, w / d, 0.0).round_().clamp_(-127, 127)
        out[start : start + step, :, :QK_K] = levels.to(torch.int8).view(torch.uint8)
        out[start : start + step, :, QK_K:] = d.view(torch.uint8)
    return QuantWeight("Q8_256", out.view(rows, -1), cols, row_scales)


def int8_weight(weight, strips: bool = True, row_scales: bool = False) -> QuantWeight:
    """A float weight [out, in] as `quantization="int8"` serves it: Q8_256 where its inputs are
    whole super-blocks (its VNNI GEMM ran ~1.5x Q8_0's on a Zen 4, which spends float work on
    every 32 inputs), laid out for that GEMM (`vnni_strips`) where `strips`, it is built and the
    outputs are whole strips of 32 (not for an embedding table, whose rows are looked up); else
    Q8_0 (inputs a multiple of 32). `row_scales`: Q8_256 of one scale a row, whose products take
    activations of one scale a row (see `quantize_linears_int8_`). `weight`: a tensor, or any
    [out, in] whose row slices are float arrays (a GGUF tensor's rows, dequantized as sliced)."""
    if isinstance(weight, torch.Tensor):
        weight = weight.detach()
    rows, cols = weight.shape
    if cols % QK_K == 0:
        blocks = q8_256_blocks(weight, row_scales)
        return vnni_strips(blocks) if strips and rows % 32 == 0 and vnni_gemm_built() else blocks
    values = weight.float().numpy() if isinstance(weight, torch.Tensor) else weight
    return QuantWeight("Q8_0", torch.from_numpy(quantize(values, "Q8_0")), cols)


def quantize_linears_int8_(model: nn.Module, row_scales: bool = False) -> None:
    """`quantization="int8"`: every `nn.Linear` below `model` whose inputs are a multiple of 32
    as a `QuantLinear` of its weight's `int8_weight` (about half the bytes of bf16 for each step
    to read), and the head as such blocks in `cpu_head`: an untied one's weight, a tied one's
    the embedding table's, which stays as it is for lookups. `row_scales` (a rotated model):
    one scale an output and activations of one scale a row, so that on AMX a product's integer
    sums run through all of k (a 1B model's linears at 512 rows 1.2x the rate of scales a
    super-block, 32-row steps 1.1x; the default model's held-out agreement with bf16 95.3%
    against 94.7%); without the rotation, one scale a row lets activation outliers coarsen every
    input (8-token greedy agreement of the unrotated default model 59% against 75%+)."""
    int8 = partial(int8_weight, row_scales=row_scales)
    swap_linears_(
        model,
        lambda _, child: QuantLinear([int8(child.weight)], child.bias),
        where=lambda child: child.in_features % 32 == 0,
    )
    head = getattr(model, "lm_head", False)
    if head is None:
        model.cpu_head = QuantLinear([int8(model.embed_tokens.weight)])
    elif isinstance(head, QuantLinear):  # the model's head runs `cpu_head` where it has one
        model.cpu_head, model.lm_head = head, None
