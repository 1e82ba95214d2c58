"""CPU linears for bf16 models: weights packed for oneDNN, plus an fp16 copy for 1-2 row steps.

- **Packed weights.** `F.linear` on bf16 CPU tensors runs oneDNN but reorders the plain weight
  and sets the kernel up on every call. Reordering each weight once
  (`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise`, the pair torch's
  inductor uses after freezing, runs the same kernel with the same accumulation: outputs are
  bit-identical to `F.linear` (under inference mode, as the engine runs). The default model's
  linears over 32 rows take 29.6 ms instead of 38.4 (2 AVX-512 cores). The packed weight
  replaces the plain one: no extra memory.
- **fp16 copy for steps of 1-2 rows.** Such a step streams every weight from memory once and
  does little arithmetic with it, so its speed is the rate the kernel reads weights: torch's
  fp16 GEMV reads 1.5x faster than the packed bf16 one (9.8 against 14.3 ms for the default
  model's linears). fp16 holds every bf16 value of normal magnitude and accumulates in fp32, so
  the outputs stay as close to the reference as the bf16 path's, though not bit-identical. It
  costs the weights' memory again.

An int8 copy was tried and dropped: half the bytes, but no faster than fp16 at one row, slower
than packed bf16 from two, and it moved greedy text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP16_MAX_ROWS = 2  # the fp16 copy wins up to here (it loses from 4 rows on)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of this dtype on this device can be packed: bf16 on CPU, oneDNN bf16."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class CpuLinear(nn.Module):
    """`F.linear(x, weight, bias)` for a bf16 CPU weight, packed and/or with an fp16 copy."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, fp16_copy: bool
    ) -> None:
        super().__init__()
        self.bias = bias
        self.fp16 = weight.detach().to(torch.float16) if fp16_copy else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if pack else None
        self.weight = None if pack else weight

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The product in `out_dtype` (default `x`'s). Logits ask for fp32 so that the fp16
        copy's result is not rounded to bf16 first: bf16 steps are 0.125 apart at logit 20,
        enough to tie or swap the top tokens."""
        out_dtype = out_dtype or x.dtype
        if self.fp16 is not None and x.shape[0] <= FP16_MAX_ROWS:
            out = F.linear(x.to(torch.float16), self.fp16).to(out_dtype)
            return out if self.bias is None else out + self.bias
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).to(out_dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out.to(out_dtype)


def replace_linears_(module: nn.Module, pack: bool, fp16_copy: bool) -> None:
    """Replace, in place, every `nn.Linear` below `module` with a `CpuLinear`."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child.weight, child.bias, pack, fp16_copy))
        else:
            replace_linears_(child, pack, fp16_copy)
