"""Second copies of the weights for decode steps of few tokens on CPU.

A decode step of one or a few sequences is a matrix-vector product per layer: it streams every
weight from memory once and does little arithmetic with it, so its time is set by how fast the
matmul kernel reads the weights. On this class of CPU, torch's bf16 GEMV reads about 11 GB/s,
while its fp16 GEMV and `_weight_int8pack_mm` (int8 weights) finish the same layers in 0.6x
the time. Steps with more tokens are compute-bound, where bf16 GEMM wins, so they keep the
original weights; each copy costs memory (fp16: the weights again, int8: half of them).

- `"fp16"`: the exact bf16 weights (fp16 holds every bf16 value of normal magnitude) and fp32
  accumulation, so outputs are as close to the reference as the bf16 path's or closer. The
  engine keeps this copy by default for bf16 models on CPU whose weights fit in 1 GiB.
- `"int8"`: per-output-channel symmetric int8 (`EngineConfig(quantization="int8")`): faster
  still on longer steps, but greedy text can drift from the reference, so it is opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# The most tokens a step may have to use each copy (measured on 2 AVX-512 cores: fp16 GEMV wins
# at 1-2 rows and loses at 4; int8 wins up to 4 rows and loses from 8).
MAX_TOKENS = {"fp16": 2, "int8": 4}


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], scales [N] in the weight's dtype): weight ~= int8 * scale[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


@dataclass
class DecodeWeight:
    """A weight's copy for small steps: fp16 (`scales` None) or int8 with per-row scales."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    max_tokens: int

    @classmethod
    def of(cls, weight: torch.Tensor, kind: str) -> DecodeWeight:
        if kind == "int8":
            return cls(*quantize_int8(weight), MAX_TOKENS["int8"])
        return cls(weight.to(torch.float16).contiguous(), None, MAX_TOKENS["fp16"])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T`: int8 in `x`'s dtype, fp16 in fp16 (the caller casts it once)."""
        if self.scales is not None:
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return F.linear(x.to(torch.float16), self.weight)


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    copy: DecodeWeight | None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in `out_dtype` (default `x`'s), through `copy` when `x` has
    few enough rows. Logits ask for fp32 so that the fp16 result is not rounded to bf16 first:
    bf16 steps are 0.125 apart at logit 20, enough to tie or swap the top tokens."""
    out_dtype = out_dtype or x.dtype
    if copy is None or x.shape[0] > copy.max_tokens:
        return F.linear(x, weight, bias).to(out_dtype)
    out = copy.linear(x).to(out_dtype)
    return out if bias is None else out + bias


class DecodeLinear(nn.Module):
    """An `nn.Linear` with a `DecodeWeight` copy for small steps."""

    def __init__(self, linear: nn.Linear, kind: str) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.copy = DecodeWeight.of(linear.weight.data, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, self.weight, self.copy, self.bias)


def add_decode_weights_(module: nn.Module, kind: str) -> None:
    """Replace, in place, every `nn.Linear` below `module` with a `DecodeLinear`."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, DecodeLinear(child, kind))
        else:
            add_decode_weights_(child, kind)
