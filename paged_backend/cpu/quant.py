"""Linears and embeddings whose weights stay in GGUF's block formats (`csrc/quant_ops.c`, and
`csrc/quant_gemm.c` for steps of many rows).

A Q4_K_M file of an 8B model is ~4.9 GB; dequantized to bf16 it is ~16 GB, and a decode step reads
every weight once, so a dequantized copy costs both memory and one-stream speed. Here a weight is
its file's bytes, [out rows, bytes a row] (read from the memory-mapped file, then moved onto 2 MiB
pages with every weight), and the C kernels compute with them directly: activations are quantized to
int8 per block of 32, or of 256 for the K-quants (as llama.cpp does), and the integer dot products
are scaled back (see the C file for the scheme). With AVX512-VNNI, steps of 4 rows on run a GEMM on
`vpdpbusd` with the same bits a row; on AVX2 alone, steps of 6 rows on of a K-quant weight run a
GEMM of `vpmaddubsw` sums added in int16 (`csrc/avx2_gemm.c`), with the same bits. Embedding rows
are dequantized as they are looked up.

`QuantLinear` can hold several weights side by side (a fused qkv or gate/up projection whose
parts a Q4_K_M file stores in different formats): they share one quantization of the
activations and write to adjacent columns of one output.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch
from torch import nn

from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.library import load_library

# type id -> (weights a block, bytes a block), for the formats the kernels read: ggml's, and
# ours for `quantization="int8"`, which no GGUF file holds: Q8_256 (256 int8 levels, then their
# fp32 scale: a K-quant's integer super-block sums with no group scales, so its VNNI GEMM runs
# `vpdpbusd` and little else) and Q8_256_VNNI (`vnni_strips`: the same bytes laid out as that
# GEMM reads them, so no step unpacks them); and Q4_0, Q5_0 and Q8_0 with 8 rows interleaved
# (`interleave_rows_`, on AVX2 builds without the AVX-512 kernels)
BLOCK_FORMATS = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "Q8_256": (64, 256, 260),
    "Q8_256_VNNI": (65, 256, 260),
    "Q4_0_R8": (66, 32, 18),
    "Q8_0_R8": (67, 32, 34),
    "Q5_0_R8": (68, 32, 22),
}
# Formats whose weights `interleave_rows_` lays out 8 rows at a time, and the names of the results
ROWS8_FORMATS = {"Q4_0": "Q4_0_R8", "Q5_0": "Q5_0_R8", "Q8_0": "Q8_0_R8"}
_CHUNK = 256  # a super-block: the kernels' unit along the inputs


@dataclass
class QuantWeight:
    """A weight [out_features, in_features] as `data`, uint8 [out_features, bytes a row] in the
    block format `format` (a key of `BLOCK_FORMATS`)."""

    format: str
    data: torch.Tensor
    in_features: int
    # Q8_256: every super-block of a row has the row's scale (`int8_weight` of a rotated model),
    # and its products take activations with one scale a row (`activation_block`), which lets the
    # AMX kernel sum all of k in integers.
    row_scales: bool = False

    def __post_init__(self) -> None:
        if self.format not in BLOCK_FORMATS:
            raise ValueError(
                f"weight format {self.format!r} is not one the CPU kernels read "
                f"({', '.join(BLOCK_FORMATS)})"
            )
        if self.row_scales and self.format not in ("Q8_256", "Q8_256_VNNI"):
            raise ValueError(f"row_scales is for Q8_256 weights, not {self.format}")
        _, weights, size = BLOCK_FORMATS[self.format]
        row = self.in_features // weights * size
        if self.in_features % weights or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(
                f"a {self.format} weight needs rows of a multiple of {weights} inputs as uint8 "
                f"[rows, bytes]; got {self.in_features} inputs, {self.data.dtype} "
                f"{tuple(self.data.shape)}"
            )
        if self.data.shape[1] != row or self.data.stride(1) != 1:
            raise ValueError(f"{self.format} rows of {self.in_features} inputs take {row} bytes")
        if self.format in ROWS8_FORMATS.values() and not (
            rows8_built() and self.out_features % 8 == 0 and self.data.is_contiguous()
        ):
            raise ValueError(
                f"{self.format} weights need the interleaved-row kernels (AVX2 builds without "
                "AVX-512's), a multiple of 8 rows, and contiguous bytes"
            )
        if self.format == "Q8_256_VNNI" and not (
            vnni_gemm_built()
            and self.out_features % 32 == 0
            and self.data.is_contiguous()
            and self.data.data_ptr() % 64 == 0
        ):
            raise ValueError(
                "Q8_256_VNNI weights need the VNNI GEMM (AVX512-VNNI), a multiple of 32 rows, "
                "and contiguous 64-byte-aligned bytes"
            )

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def type_id(self) -> int:
        return BLOCK_FORMATS[self.format][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def vnni_gemm_built() -> bool:
    """Whether the kernels were built with the VNNI GEMM (AVX512-VNNI and -BW)."""
    return load_library().has("vnni_matmul")


def rows8_built() -> bool:
    """Whether the kernels were built with the interleaved-row products (`csrc/quant_ops.c`,
    `ROWS8`: AVX2 builds without the AVX-512 kernels, which read the files' layout)."""
    lib = load_library()
    return lib is not None and lib.has("interleave_rows8")


def interleave_rows_(weight: QuantWeight) -> bool:
    """Lay out a weight of a format of `ROWS8_FORMATS` (rows a multiple of 8, contiguous bytes in
    writable memory) 8 rows at a time, in place, where the kernels read that layout (the format
    becomes its `_R8` name): the same bytes, whose products run ~1.5-2.5x faster on AVX2 and
    whose outputs keep their bits. False (nothing done) where it does not apply."""
    if (
        weight.format not in ROWS8_FORMATS
        or weight.out_features % 8
        or not weight.data.is_contiguous()
        or not rows8_built()
    ):
        return False
    fmt = ROWS8_FORMATS[weight.format]
    load_library().interleave_rows8(
        type=BLOCK_FORMATS[fmt][0],
        w=weight.data.data_ptr(),
        n=weight.out_features,
        row_bytes=weight.data.stride(0),
        threads=torch.get_num_threads(),
    )
    weight.format = fmt
    return True


def interleave_model_rows_(model: nn.Module) -> None:
    """`interleave_rows_` on the weights of `model`'s `QuantLinear`s and `QuantEmbedding`s, after
    `memory.move_to_huge_pages_` (their bytes then in writable memory); a tied head's weight,
    its embedding's, once."""
    weights = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            weights.update((id(w), w) for w in module.weights)
        elif isinstance(module, QuantEmbedding):
            weights[id(module.weight_q)] = module.weight_q
    for weight in weights.values():
        interleave_rows_(weight)


# A strip's bytes, [strip, block of 16 outputs, output, super-block, 4-input step, 4] in row-major
# Q8_256 (scales: one "step" of 4 bytes), to `vnni_strips`' order: it swaps (block, output) with
# (super-block, step), so it is its own inverse
_STRIP_AXES = (0, 3, 4, 1, 2, 5)


def vnni_strips(weight: QuantWeight) -> QuantWeight:
    """A Q8_256 weight (rows a multiple of 32) as Q8_256_VNNI: the same bytes, each 32 rows
    (a strip) per super-block as its 16 x 16-output blocks' levels plus 128, inputs 4q..4q+3 of
    block b at byte (2q + b) * 64 (16 outputs x 4 inputs), then the 32 rows' scales (fp32): what
    `csrc/quant_gemm.c`'s GEMM would otherwise unpack each step, for every strip."""
    if weight.format != "Q8_256" or weight.out_features % 32:
        raise ValueError(f"vnni_strips takes Q8_256 weights of 32k rows, not {weight.format}")
    n, blocks = weight.out_features, weight.in_features // 256
    rows = weight.data.reshape(n // 32, 2, 16, blocks, 260)
    levels = (rows[..., :256] ^ 0x80).reshape(n // 32, 2, 16, blocks, 64, 4).permute(_STRIP_AXES)
    scales = rows[..., 256:].reshape(n // 32, 2, 16, blocks, 1, 4).permute(_STRIP_AXES)
    parts = [levels.reshape(n // 32, blocks, 8192), scales.reshape(n // 32, blocks, 128)]
    data = torch.cat(parts, dim=-1).reshape(n, -1)
    return QuantWeight("Q8_256_VNNI", data, weight.in_features, weight.row_scales)


def _rows_of_strips(weight: QuantWeight) -> QuantWeight:
    """`vnni_strips`' inverse: the Q8_256 weight whose bytes a Q8_256_VNNI one lays out."""
    n, blocks = weight.out_features, weight.in_features // 256
    strips = weight.data.reshape(n // 32, blocks, 8320)
    levels = (strips[..., :8192] ^ 0x80).reshape(n // 32, blocks, 64, 2, 16, 4)
    scales = strips[..., 8192:].reshape(n // 32, blocks, 1, 2, 16, 4)
    parts = [
        levels.permute(_STRIP_AXES).reshape(n // 32, 2, 16, blocks, 256),
        scales.permute(_STRIP_AXES).reshape(n // 32, 2, 16, blocks, 4),
    ]
    data = torch.cat(parts, dim=-1).reshape(n, -1)
    return QuantWeight("Q8_256", data, weight.in_features, weight.row_scales)


def activation_block(fmt: str, row_scales: bool = False) -> int:
    """Inputs that share one activation scale for weights of format `fmt`: the whole row (0) for
    weights of `row_scales`; a super-block (256) for the K-quants, whose kernel then sums a
    super-block in integers (as llama.cpp's Q8_K); a block (32) for the others."""
    if row_scales:
        return 0
    return 256 if BLOCK_FORMATS[fmt][1] == 256 else 32


ROW_SCALES = 4096  # the type bit of `row_scales` weights (csrc/common.h's)


def activation_stride(k: int) -> int:
    """The row stride of quantized activations, as the C kernels' `act_stride`: k rounded up to
    a super-block, plus one (which keeps a step's rows off a common L1 set)."""
    return -(-k // _CHUNK) * _CHUNK + _CHUNK


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, ...]:
    """Rows x [rows, k] (fp32 or bf16, unit stride in a row) as the kernels read them, in blocks
    of `block` (32 or 256; 0: the whole row) inputs: int8 levels [rows, kp] (kp:
    `activation_stride(k)`), each 32's scale [rows, kp/32] (its block's) and each 16's level sum
    (int16) [rows, kp/16]."""
    if block not in (0, 32, 256):
        raise ValueError(f"block must be 0 (a row), 32 or 256, got {block}")
    rows, k = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
        x = x.float().contiguous()
    kp = activation_stride(k)
    xq = torch.empty(rows, kp, dtype=torch.int8)
    xd = torch.empty(rows, kp // 32)
    bsum = torch.empty(rows, kp // 16, dtype=torch.int16)
    load_library().quantize_activations(
        x=x.data_ptr(),
        x_bf16=x.dtype == torch.bfloat16,
        rows=rows,
        k=k,
        x_stride=x.stride(0),
        block=block,
        xq=xq.data_ptr(),
        xd=xd.data_ptr(),
        bsum=bsum.data_ptr(),
        threads=torch.get_num_threads(),
    )
    return xq, xd, bsum


def _product(x: torch.Tensor, weights: list[QuantWeight], out_dtype: torch.dtype, run_part):
    """Rows x [rows, k] times the parts of a (fused) linear, side by side: [rows, sum of
    out_features] in `out_dtype` (fp32, or bf16 rounded once), each part's columns written by
    `run_part(weight, address of its first column, out's row stride, out_bf16)`."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    rows, k = x.shape
    out = torch.empty(rows, sum(w.out_features for w in weights), dtype=out_dtype)
    column = 0
    for w in weights:
        if w.in_features != k:
            raise ValueError(f"x has {k} features, the weight takes {w.in_features}")
        run_part(w, out[:, column:].data_ptr(), out.stride(0), out_dtype == torch.bfloat16)
        column += w.out_features
    return out


def quant_matmul(
    x: torch.Tensor, weights: list[QuantWeight], out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`x @ cat(weights).T` for rows x [rows, k]: [rows, sum of out_features] in `out_dtype`
    (fp32, or bf16 rounded once); x quantized to int8 per row, as llama.cpp does."""
    activations = {}  # by block size: the parts of a fused linear share them
    lib = load_library()

    def run_part(w: QuantWeight, out: int, out_stride: int, out_bf16: bool) -> None:
        block = activation_block(w.format, w.row_scales)
        if block not in activations:
            activations[block] = quantize_activations(x, block)
        xq, xd, bsum = activations[block]
        lib.quant_matmul(
            type=w.type_id | (ROW_SCALES if w.row_scales else 0),
            w=w.data.data_ptr(),
            n=w.out_features,
            k=w.in_features,
            row_bytes=w.data.stride(0),
            xq=xq.data_ptr(),
            xd=xd.data_ptr(),
            bsum=bsum.data_ptr(),
            rows=x.shape[0],
            out=out,
            out_bf16=out_bf16,
            out_stride=out_stride,
            threads=torch.get_num_threads(),
        )

    return _product(x, weights, out_dtype, run_part)


def can_dequantize_to_bf16(weights: list[QuantWeight]) -> bool:
    """Whether `quant_gemm_bf16` takes these weights (with bf16 rows): the AVX512-BF16 kernels
    built, and weights of whole blocks of 16 outputs and 32 inputs, row-major or in VNNI strips."""
    return load_library().has("quant_gemm_bf16") and all(
        w.out_features % 16 == 0
        and w.in_features % 32 == 0
        and w.format not in ROWS8_FORMATS.values()
        for w in weights
    )


_GEMM_WORK = threading.local()  # .buffers: (threads, k) -> `dequantize_work`
DEQUANTIZED_ROWS = 128  # weight rows a thread dequantizes at most (csrc/common.h's)


def dequantize_work(threads: int, k: int) -> torch.Tensor:
    """The buffer `quant_gemm_bf16` dequantizes into (`DEQUANTIZED_ROWS` weight rows of k + 32
    bf16 a thread), one per (threads, k) for the calling Python thread: the modules' steps and
    the one-call decode step share it, engines stepping in other threads have their own (one
    buffer for the process mixed two engines' weights)."""
    buffers = getattr(_GEMM_WORK, "buffers", None)
    if buffers is None:
        buffers = _GEMM_WORK.buffers = {}
    work = buffers.get((threads, k))
    if work is None:
        work = buffers[threads, k] = torch.empty(
            threads * DEQUANTIZED_ROWS * (k + 32), dtype=torch.bfloat16
        )
    return work


def quant_gemm_bf16(
    x: torch.Tensor, weights: list[QuantWeight], out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`quant_matmul`'s product for many rows of bf16 x (weights `can_dequantize_to_bf16`): the
    dequantized to bf16, 32-48 outputs at a time into a buffer the caches hold, and multiplied
    in the bf16 GEMM (on AMX tiles where the CPU has them), with no int8 rounding of x: the bits
    of the bf16 GEMM on the dequantized weight. A step of many rows then runs at the bf16 GEMM's
    rate; the kernel choice times it against the int8 product (whose VNNI GEMM beat it at every
    row count on a Zen 4; on a Xeon with AMX the tiles, the weights their A operand, run a Q4_K
    8192 x 2048 weight from memory at 32 rows in ~1.2 ms against the VNNI GEMM's ~2.1, and win
    from 4-16 rows)."""
    lib = load_library()

    def run_part(w: QuantWeight, out: int, out_stride: int, out_bf16: bool) -> None:
        lib.quant_gemm_bf16(
            **_dequantized_operands(x, w), out=out, out_bf16=out_bf16, out_stride=out_stride
        )

    return _product(x, weights, out_dtype, run_part)


def _dequantized_operands(x: torch.Tensor, w: QuantWeight) -> dict:
    """The arguments the dequantizing kernels (`quant_gemm_bf16`, `quant_argmax_amx`) take for
    rows x and weight w, with a work buffer for torch's threads."""
    threads = torch.get_num_threads()
    rows, k = x.shape
    return dict(
        type=w.type_id,
        w=w.data.data_ptr(),
        n=w.out_features,
        k=k,
        row_bytes=w.data.stride(0),
        x=x.data_ptr(),
        rows=rows,
        x_stride=x.stride(0),
        work=dequantize_work(threads, k).data_ptr(),
        threads=threads,
    )


def _tiles_dequantize(x: torch.Tensor, weights: list[QuantWeight]) -> bool:
    """Whether rows x and `weights` are what the AMX kernels that dequantize weight rows into
    the tiles (`quant_glu_amx`, `quant_argmax_amx`) take: bf16 rows of unit stride, weights
    `can_dequantize_to_bf16` in rows of blocks (not Q8_256_VNNI's strips)."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(-1) == 1
        and all(w.format != "Q8_256_VNNI" for w in weights)
        and can_dequantize_to_bf16(weights)
    )


def glu_serves(x: torch.Tensor, gate: QuantWeight, up: QuantWeight) -> bool:
    """Whether `quant_glu_bf16` takes these rows and weights: AMX tiles built, rows and weights
    `_tiles_dequantize` takes, as many rows each, a multiple of 32."""
    return (
        load_library().has("quant_glu_amx")
        and up.out_features == gate.out_features
        and gate.out_features % 32 == 0
        and _tiles_dequantize(x, [gate, up])
    )


def quant_glu_bf16(
    x: torch.Tensor, gate: QuantWeight, up: QuantWeight, gelu: bool
) -> torch.Tensor | None:
    """`act(x @ gate.T) * (x @ up.T)` (SiLU, or GeGLU where `gelu`) for many rows of bf16 x, in
    bf16, where `glu_serves`: `quant_gemm_bf16` of both and `cpu_ops.silu_and_mul`
    (`gelu_tanh_and_mul`) of the result, with their bits, in one kernel that never writes the
    2 x dim products (`csrc/amx_gemm.c`'s `quant_glu_amx`). None where the kernel could not get
    the tiles or its buffer."""
    threads = torch.get_num_threads()
    (rows, k), n = x.shape, gate.out_features
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    done = load_library().quant_glu_amx(
        gate_type=gate.type_id,
        gate=gate.data.data_ptr(),
        gate_row_bytes=gate.data.stride(0),
        up_type=up.type_id,
        up=up.data.data_ptr(),
        up_row_bytes=up.data.stride(0),
        n=n,
        k=k,
        x=x.data_ptr(),
        rows=rows,
        x_stride=x.stride(0),
        out=out.data_ptr(),
        out_stride=out.stride(0),
        gelu=int(gelu),
        work=dequantize_work(threads, k).data_ptr(),
        threads=threads,
    )
    return out if done else None


def quant_argmax_bf16(
    x: torch.Tensor, w: QuantWeight, columns: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's largest of its first `columns` outputs of `quant_gemm_bf16(x, [w])` (fp32,
    the same bits) and its column (int64), the first of equal values, the first NaN where one
    is, without writing the outputs (`csrc/amx_gemm.c`'s `quant_argmax_amx`): a greedy step's
    head on AMX. None where that kernel does not serve (no AMX tiles, rows not bf16, a weight
    it does not dequantize, or no buffer to be had)."""
    lib = load_library()
    if not (lib.has("quant_argmax_amx") and w.out_features % 16 == 0 and _tiles_dequantize(x, [w])):
        return None
    top = torch.empty(x.shape[0])
    column = torch.empty(x.shape[0], dtype=torch.int64)
    done = lib.quant_argmax_amx(
        **_dequantized_operands(x, w), columns=columns, top=top.data_ptr(), at=column.data_ptr()
    )
    return (top, column) if done else None


# Block formats whose values are exact products (a scale times a level of at most 8 bits) plus
# one offset: `linear_blocks_f32` reproduces `dequantize`'s values bit for bit.
EXACT_F32_FORMATS = ("Q4_0", "Q4_1", "Q8_0")


def linear_blocks_f32(
    x: torch.Tensor, weights: list[QuantWeight], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`cpu_ops.linear_f32(x, cat(dequantize(w) for w in weights), bias)`, its bits, read from
    the blocks (formats of `EXACT_F32_FORMATS`, rows contiguous): a small step of an fp32 model
    served from a GGUF file reads 0.56-1.06 bytes a weight instead of 4."""
    rows, k = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be fp32 with unit stride in a row, got {x.dtype}")
    out = torch.empty(rows, sum(w.out_features for w in weights))
    lib, column = load_library(), 0
    for w in weights:
        if w.format not in EXACT_F32_FORMATS or w.in_features != k:
            raise ValueError(
                f"linear_blocks_f32 takes {', '.join(EXACT_F32_FORMATS)} weights of {k} inputs, "
                f"got {w.format} of {w.in_features}"
            )
        if not w.data.is_contiguous():
            raise ValueError("linear_blocks_f32 needs contiguous block rows")
        lib.linear_blocks_f32(
            x=x.data_ptr(),
            rows=rows,
            x_stride=x.stride(0),
            type=w.type_id,
            w=w.data.data_ptr(),
            n=w.out_features,
            k=k,
            y=out[:, column:].data_ptr(),
            y_stride=out.stride(0),
            threads=torch.get_num_threads(),
        )
        column += w.out_features
    return out if bias is None else out.add_(bias)


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """A weight [n, k] of random blocks of 32 of `fmt` whose scales (fp16, a block's first 2
    bytes; Q4_1's and Q5_1's minimum the next 2) are small normal values: for kernel timing."""
    _, per, size = BLOCK_FORMATS[fmt]
    if per != 32:
        raise ValueError(f"random_blocks writes blocks of 32, not {fmt}'s {per}")
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=gen)
    scales = 2 if fmt in ("Q4_1", "Q5_1") else 1
    values = torch.randn(n, k // 32, scales, generator=gen) * 0.01
    data[:, :, : 2 * scales] = values.half().view(torch.uint8).view(n, k // 32, 2 * scales)
    return QuantWeight(fmt, data.view(n, -1), k)


def dequantize(weight: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's rows `rows` (int64 ids; all where None) as fp32 [len(rows), in_features]."""
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    if (
        ids is not None
        and ids.numel()
        and not 0 <= int(ids.min()) <= int(ids.max()) < weight.out_features
    ):
        raise IndexError(f"row ids must lie in [0, {weight.out_features})")
    count = weight.out_features if ids is None else ids.numel()
    if weight.format == "Q8_256_VNNI":  # the C kernels read its blocks row by row
        weight = _rows_of_strips(weight)
    out = torch.empty(count, weight.in_features)
    load_library().dequantize_rows(
        type=weight.type_id,
        w=weight.data.data_ptr(),
        k=weight.in_features,
        row_bytes=weight.data.stride(0),
        ids=None if ids is None else ids.data_ptr(),
        count=count,
        out=out.data_ptr(),
        threads=torch.get_num_threads(),
    )
    return out


class QuantLinear(nn.Module):
    """`F.linear(x, cat(weights), bias)` on quantized weights (see the module docstring)."""

    def __init__(self, weights: list[QuantWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("the parts of a fused linear must take the same inputs")
        self.weights = weights
        self.bias = bias
        self.in_features = weights[0].in_features
        self.out_features = sum(w.out_features for w in weights)
        # Steps of more bf16 rows than this run `quant_gemm_bf16` (set only where the weights
        # `can_dequantize_to_bf16`); None: every step the int8 product
        # (`kernel_choice.int8_max_rows`).
        self.int8_max_rows: int | None = None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        kernel_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
        rows = x.reshape(-1, self.in_features)
        out = self._product(rows)(rows, self.weights, kernel_dtype)
        out = out.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.to(out_dtype)

    def _product(self, rows: torch.Tensor):
        """The kernel a step of `rows` runs on (`int8_max_rows`)."""
        most = self.int8_max_rows
        if most is not None and rows.shape[0] > most and rows.dtype == torch.bfloat16:
            return quant_gemm_bf16
        return quant_matmul

    def fuses_act_and_mul(self, x: torch.Tensor) -> bool:
        """Whether `act_and_mul(x)` runs as one kernel (`quant_glu_bf16`): for a gate/up
        projection without bias, on steps `quant_gemm_bf16` serves, where `glu_serves`."""
        return self._gate_and_up(x.reshape(-1, self.in_features)) is not None

    def act_and_mul(self, x: torch.Tensor, gelu: bool) -> torch.Tensor:
        """`act(gate) * up` of this gate/up projection's outputs `self(x)` (gate the first half),
        as `cpu_ops.silu_and_mul` (`gelu_tanh_and_mul` where `gelu`) gives it: in one kernel
        where `fuses_act_and_mul`, the two passes otherwise."""
        rows = x.reshape(-1, self.in_features)
        halves = self._gate_and_up(rows)
        out = None if halves is None else quant_glu_bf16(rows, *halves, gelu)
        if out is None:
            out = (cpu_ops.gelu_tanh_and_mul if gelu else cpu_ops.silu_and_mul)(self(rows))
        return out.view(*x.shape[:-1], -1)

    def _gate_and_up(self, rows: torch.Tensor) -> tuple[QuantWeight, QuantWeight] | None:
        """The gate and up weights `quant_glu_bf16` runs this step on, or None."""
        if self.bias is not None or self._product(rows) is not quant_gemm_bf16:
            return None
        parts = self.weights
        if len(parts) == 1 and parts[0].out_features % 2 == 0:
            w, half = parts[0], parts[0].out_features // 2
            parts = [dataclasses.replace(w, data=d) for d in (w.data[:half], w.data[half:])]
        if len(parts) != 2 or not glu_serves(rows, *parts):
            return None
        return parts[0], parts[1]

    def argmax(self, x: torch.Tensor, columns: int) -> torch.Tensor:
        """`forward(x, torch.float32)[:, :columns].argmax(-1)` (`cpu_ops.argmax_of_slices`'
        ties and NaNs), with no outputs written where `quant_argmax_bf16` serves, else from
        outputs computed `ARGMAX_SLICE_BYTES` at a time: a greedy step at a 262,144-token
        vocabulary never holds its 1 MB a row of logits. A slice's outputs have the whole
        product's bits: the kernels compute each output on its own, and slices start at
        multiples of 32 outputs (the VNNI GEMM's strips)."""
        if not 0 < columns <= self.out_features:
            raise ValueError(f"columns must lie in [1, {self.out_features}], got {columns}")
        rows = x.reshape(-1, self.in_features)
        runs = self._argmax_runs(rows, columns)
        if runs is not None:
            return cpu_ops.argmax_of_candidates(runs, rows.shape[0])
        width = cpu_ops.argmax_slice_width(rows.shape[0], 32)
        if any(w.out_features % 32 for w in self.weights):  # kernels chosen by n's shape
            width = self.out_features
        return cpu_ops.argmax_of_slices(self._slices(rows, columns, width), rows.shape[0])

    def _argmax_runs(self, rows: torch.Tensor, columns: int) -> list | None:
        """Each part's (largest output, its column) of each row from `quant_argmax_bf16`, where
        it serves a step `quant_gemm_bf16` runs (no outputs written); else None."""
        if self.bias is not None or self._product(rows) is not quant_gemm_bf16:
            return None
        runs, column = [], 0
        for w in self.weights:
            if column < columns:
                run = quant_argmax_bf16(rows, w, min(w.out_features, columns - column))
                if run is None:
                    return None
                runs.append((run[0], run[1] + column))
            column += w.out_features
        return runs

    def _slices(self, rows: torch.Tensor, columns: int, width: int):
        """(first column, fp32 outputs) of `width` outputs at a time, up to `columns`."""
        product, column = self._product(rows), 0
        for w in self.weights:
            for first in range(0, min(w.out_features, columns - column), width):
                part = dataclasses.replace(w, data=w.data[first : first + width])
                out = product(rows, [part], torch.float32)
                start = column + first
                if self.bias is not None:
                    out += self.bias[start : start + part.out_features]
                yield start, out[:, : columns - start]
            column += w.out_features

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)


def check_block_shape(name: str, shape: torch.Size, weights: list[QuantWeight]) -> None:
    """That `weights` side by side are a [shape] weight, the one module `name` takes."""
    rows = sum(w.out_features for w in weights)
    if rows != shape[0] or weights[0].in_features != shape[1]:
        raise ValueError(
            f"quantized weight of {name} is {rows}x{weights[0].in_features}, the model takes "
            f"{tuple(shape)}"
        )


def place_block_linear_(model: nn.Module, module_name: str, weights: list[QuantWeight]) -> None:
    """Put a `QuantLinear` of `weights` (the parts of a fused projection, in output order) in
    place of linear `module_name` of `model`, keeping its bias; the head (`lm_head`) becomes
    `model.cpu_head`."""
    module = model.get_submodule(module_name)
    check_block_shape(module_name, module.weight.shape, weights)
    if module_name == "lm_head":
        model.cpu_head, model.lm_head = QuantLinear(weights), None
        return
    parent_name, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, QuantLinear(weights, module.bias))


class QuantEmbedding(nn.Module):
    """An embedding table in a block format: the rows of a step's tokens are dequantized."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight_q, ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)
