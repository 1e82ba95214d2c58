"""Weight-only int8 for small decode steps on CPU (`EngineConfig(quantization="int8")`).

A decode step of one or a few sequences is a matrix-vector product per layer: it streams every
weight from memory once and does little arithmetic with it, so its time is the weights' bytes
over memory bandwidth. Per-output-channel symmetric int8 weights halve those bytes against bf16,
and torch's `_weight_int8pack_mm` CPU kernel reads them directly. Steps with more tokens than
`INT8_MAX_TOKENS` (prefill, larger batches) are compute-bound, where that kernel is slower than a
bf16 GEMM, so they keep the original weights: the int8 copy costs half the weights' memory again.

Outputs differ from the unquantized model (greedy text can change after some tokens), so it is
opt-in; the default engine gives the reference model's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = (None, "int8")
INT8_MAX_TOKENS = 4  # measured on 2 AVX-512 cores: int8 wins up to 4 rows, loses from 8


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], scales [N] in the weight's dtype): weight ~= int8 * scale[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, with the int8 copy `q * scales` when `x` has few rows."""
    if x.shape[0] > INT8_MAX_TOKENS:
        return F.linear(x, weight, bias)
    out = torch.ops.aten._weight_int8pack_mm(x, q, scales)
    return out if bias is None else out + bias


class Int8Linear(nn.Module):
    """An `nn.Linear` that keeps its weight and an int8 copy for small steps."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        q, scales = quantize_int8(linear.weight.data)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.q, self.scales, self.bias)


def quantize_linears_(module: nn.Module) -> None:
    """Replace, in place, every `nn.Linear` below `module` with an `Int8Linear`."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            quantize_linears_(child)
