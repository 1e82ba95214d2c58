"""CPU linears for bf16 models: weights packed for oneDNN, plus a copy for steps of few rows.

- **Packed weights.** `F.linear` on bf16 CPU tensors runs oneDNN but reorders the plain weight
  and sets the kernel up on every call. Reordering each weight once
  (`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise`, the pair torch's
  inductor uses after freezing, runs the same kernel with the same accumulation: outputs are
  bit-identical to `F.linear` (under inference mode, as the engine runs). The default model's
  linears over 32 rows take 29.6 ms instead of 38.4 (2 AVX-512 cores). The packed weight
  replaces the plain one: no extra memory.
- **bf16 copy for steps of 1-64 rows, packed for `cpu_ops.gemm`** (on CPUs with AVX512-BF16,
  with the C kernels on): the weight in blocks of 16 outputs by pairs of inputs, read by a C
  kernel on AVX512-BF16 dot products on both threads (exact bf16 products, fp32 sums, as
  oneDNN's), 8 rows by 32 outputs at a time. Which of it and oneDNN serves a step is timed per
  machine and weight shape (`kernel_choice`): on a Zen 4 without AMX it beats oneDNN at every
  step size up to 64 rows (the default model's linears take 5.1 against 8.4 ms at one row, 7.6
  against 11.5 at 8, 22.2 against 25.9 at 32). On a Xeon with AMX the C kernel runs every step
  on the tiles too (`csrc/amx_gemm.c`; its vector loop ran ~200 GFLOP/s there from 16 rows, the
  tiles 1.6-2.4 TFLOP/s from 64 rows, as fast as oneDNN's or faster at 1-512 rows, 2 threads).
  It takes the fp16 copy's place (and memory). Prefill steps run it too at the row counts where
  it was timed as fast as oneDNN (`PREFILL_ROW_COUNTS`).
- **fp16 copy for steps of 1-2 rows** (where the bf16 copy cannot run). Such a step streams
  every weight from memory once and does little arithmetic with it, so its speed is the rate
  the kernel reads weights: torch's fp16 GEMV reads 1.5x faster than the packed bf16 one (9.8
  against 14.3 ms for the default model's linears). fp16 holds every bf16 value of normal
  magnitude and accumulates in fp32, so the outputs stay as close to the reference as the bf16
  path's, though not bit-identical. It costs the weights' memory again.
- **int4 copy for steps of 1-4 rows** (opt-in, `EngineConfig(quantization="int4")`): 4-bit
  weights in groups of 32 inputs with a scale and zero each (min/max, like GGUF's Q4_1), read
  by torch's `_weight_int4pack_mm_for_cpu` in 4.7 ms for the default model's layers at one row
  (fp16: 9.8). A model converted from a Q4 GGUF file (the default model is) has weights exactly
  on such a grid, so the copy holds them but for rounding the scales and zeros to bf16; other
  models lose precision. It replaces the fp16 copy for the layers and costs a quarter of their
  memory; the output head keeps its bf16 or fp16 copy (int4 gives bf16 logits only, and fp32
  activations run 25x slower).

An int8 copy was tried and dropped: half the bytes, but no faster than fp16 at one row, slower
than packed bf16 from two, and it moved greedy text.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.cpu import ops as cpu_ops

FP16_MAX_ROWS = 2  # the fp16 copy wins up to here (it loses from 4 rows on)
INT4_MAX_ROWS = 4  # int4 wins up to here (7.7 against 14 ms at 4 rows; it loses at 32)
INT4_GROUP = 32

Int4Weight = tuple[torch.Tensor, torch.Tensor]  # (packed 4-bit weight, scales and zeros)
GemmRows = dict[tuple[int, int], int]  # weight shape -> most rows a step runs in the C GEMM
EVERY_STEP = 1 << 62  # as `GemmRows`: the C GEMM runs steps of any size
# The prefill step sizes `kernel_choice` times the C GEMM against oneDNN at: a step of more rows
# than its `GemmRows` runs the kernel that won at the first of these it does not exceed (the last
# for more), since oneDNN's rate moves by 2x between such counts, by shape, and the C GEMM's
# does not (on an AMX Xeon: Qwen2.5-0.5B's down projection 0.84 against 1.79 TFLOP/s at 768 rows,
# 1.61 against 1.86 at 512).
PREFILL_ROW_COUNTS = (128, 256, 512, 768, 1024, 1536, 2048)
GemmPrefill = dict[tuple[int, int], tuple[int, ...]]  # weight shape -> the counts the C GEMM won


def prefill_count(rows: int) -> int:
    """The timed prefill count that stands for a step of `rows` rows."""
    return next((c for c in PREFILL_ROW_COUNTS if rows <= c), PREFILL_ROW_COUNTS[-1])


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of this dtype on this device can be packed: bf16 on CPU, oneDNN bf16."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def can_quantize_int4(weight: torch.Tensor) -> bool:
    return weight.shape[1] % INT4_GROUP == 0 and hasattr(
        torch.ops.aten, "_weight_int4pack_mm_for_cpu"
    )


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """4-bit `weight` [N, K] (K a multiple of 32): weight ~= (q - 8) * scale + zero per group of
    32 inputs, q in 0..15, scale = (max - min) / 15, zero = min + 8 * scale (the kernel's form).
    Quantize the full-precision weights: rounding them to bf16 first moves them off a Q4 grid."""
    n, k = weight.shape
    groups = weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - low) / 15).clamp(min=1e-20)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k).to(torch.int32), 1)
    scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1)
    return packed, scales_and_zeros.to(torch.bfloat16).contiguous()


class CpuLinear(nn.Module):
    """`F.linear(x, weight, bias)` for a bf16 CPU weight: packed, and/or with a copy for small
    steps (int4, else bf16 packed for `cpu_ops.gemm` where `gemm` allows and the shape fits,
    else fp16)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        fp16_copy: bool,
        int4: Int4Weight | None = None,
        gemm_rows: int | None = None,
        gemm_prefill: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.bias = bias
        self.int4 = int4
        n, k = weight.shape
        small_copy = fp16_copy and int4 is None
        gemm = small_copy and gemm_rows is not None and n % 16 == 0 and k % 2 == 0
        # Steps of up to this many rows run the C GEMM (`kernel_choice` times it against oneDNN),
        # and larger ones where it won at their `prefill_count`.
        self.gemm_rows = gemm_rows if gemm else 0
        self.gemm_prefill = frozenset(gemm_prefill) if gemm else frozenset()
        serves = self.gemm_rows or self.gemm_prefill
        self.gemm = cpu_ops.pack_gemm_weight(weight) if serves else None
        self.fp16 = weight.detach().to(torch.float16) if small_copy and not gemm else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if pack else None
        # the weight itself goes where a copy serves every step (`ModelRunner._cpu_linears`)
        every_step = self.gemm is not None and self.gemm_rows >= EVERY_STEP
        self.weight = None if pack or every_step else weight

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The product in `out_dtype` (default `x`'s). Logits ask for fp32 so that the fp16
        copy's result is not rounded to bf16 first: bf16 steps are 0.125 apart at logit 20,
        enough to tie or swap the top tokens."""
        out_dtype = out_dtype or x.dtype
        small = self._copy_product(x, out_dtype)
        if small is not None:
            out = small.to(out_dtype)
            return out if self.bias is None else out + self.bias
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).to(out_dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out.to(out_dtype)

    def argmax(self, x: torch.Tensor, columns: int) -> torch.Tensor | None:
        """`forward(x, torch.float32)[:, :columns].argmax(-1)` (`cpu_ops.argmax_of_slices`'
        ties and NaNs) from outputs computed `ARGMAX_SLICE_BYTES` at a time, where the C GEMM
        serves a step of `x`'s rows: it computes each output on its own, so a slice of its
        16-output blocks has the whole product's bits. None for the other copies."""
        if not self.gemm_rows or x.shape[0] > self.gemm_rows or self.int4 is not None:
            return None
        n = self.gemm.shape[0] * 16
        if not 0 < columns <= n:
            raise ValueError(f"columns must lie in [1, {n}], got {columns}")
        rows = x if x.stride(1) == 1 else x.contiguous()
        width = cpu_ops.argmax_slice_width(rows.shape[0], 16)

        def slices():
            for first in range(0, columns, width):
                out = cpu_ops.gemm(
                    rows, self.gemm[first // 16 : (first + width) // 16], torch.float32
                )
                if self.bias is not None:
                    out += self.bias[first : first + out.shape[1]]
                yield first, out[:, : columns - first]

        return cpu_ops.argmax_of_slices(slices(), rows.shape[0])

    def _copy_product(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """`x @ weight.T` (no bias) from the copy that serves steps of `x`'s rows, if any."""
        rows = x.shape[0]
        if self.int4 is not None and rows <= INT4_MAX_ROWS:
            packed, scales = self.int4
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales)
        if self.gemm is not None and (
            rows <= self.gemm_rows
            or (rows > cpu_ops.GEMM_MAX_ROWS and prefill_count(rows) in self.gemm_prefill)
        ):
            return cpu_ops.gemm(x if x.stride(1) == 1 else x.contiguous(), self.gemm, out_dtype)
        if self.fp16 is not None and rows <= FP16_MAX_ROWS:
            return F.linear(x.to(torch.float16), self.fp16)
        return None


def quantize_linears_int4(module: nn.Module) -> dict[str, Int4Weight]:
    """int4 copies of the weights of the `nn.Linear`s below `module` that fit, by module name."""
    return {
        name: quantize_int4(child.weight)
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear) and can_quantize_int4(child.weight)
    }


def replace_linears_(
    module: nn.Module,
    pack: bool,
    fp16_copy: bool,
    int4: dict[str, Int4Weight] | None = None,
    gemm_rows: GemmRows | None = None,
    gemm_prefill: GemmPrefill | None = None,
) -> None:
    """Replace, in place, every `nn.Linear` below `module` with a `CpuLinear` (with the int4
    copy `int4` holds under its name from `quantize_linears_int4(module)`, and the C GEMM for
    the steps `gemm_rows` and `gemm_prefill` give its weight's shape)."""
    int4 = int4 or {}

    def cpu_linear(name: str, child: nn.Linear) -> CpuLinear:
        shape = tuple(child.weight.shape)
        rows = None if gemm_rows is None else gemm_rows[shape]
        prefill = () if gemm_prefill is None else gemm_prefill.get(shape, ())
        return CpuLinear(child.weight, child.bias, pack, fp16_copy, int4.get(name), rows, prefill)

    swap_linears_(module, cpu_linear)


def swap_linears_(
    module: nn.Module,
    make: Callable[[str, nn.Linear], nn.Module],
    where: Callable[[nn.Linear], bool] | None = None,
) -> None:
    """Replace, in place, each `nn.Linear` below `module` (each `where` accepts, where given)
    with `make(its name, it)`. By name, so that each replaced linear (and a weight its copies
    replace) is freed before the next is made: a list of the modules kept every original beside
    every copy until the end (a 1B bf16 model's load peaked at +1.9 GB over its weights)."""
    names = [
        name
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear) and (where is None or where(child))
    ]
    for name in names:
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent), attr, make(name, module.get_submodule(name)))


def linear_shapes(module: nn.Module) -> set[tuple[int, int]]:
    """The weight shapes (out, in) of the `nn.Linear`s below `module`."""
    return {tuple(m.weight.shape) for m in module.modules() if isinstance(m, nn.Linear)}
