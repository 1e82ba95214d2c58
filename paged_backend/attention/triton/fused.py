"""Fused elementwise kernels of a Llama layer, each beside the torch code it replaces.

Fusing saves a round trip through memory and several launches per op: at small batch the
per-op overhead, not the arithmetic, is what a decode step costs. Math runs in fp32 and is
rounded to the input dtype where the torch reference rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, h, mask=mask)
        h = h.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    # Round to the activation dtype before the weight, like the reference.
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, hidden] (contiguous rows); with `residual`, of x + residual.

    With a residual, returns (normed, x + residual) so that the residual add of a layer and
    the norm of the next one are one launch.
    """
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else None
    _rms_norm_kernel[(num_rows,)](
        x,
        residual,
        weight,
        out,
        new_residual,
        hidden,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        new_residual.stride(0) if new_residual is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
    )
    return out if new_residual is None else (out, new_residual)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    hf = h.float()
    normed = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, h)


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    stride_x_t,
    stride_x_h,
    stride_x_d,
    stride_c_t,
    stride_s_t,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]

    cos_row = cos_ptr + token * stride_c_t
    sin_row = sin_ptr + token * stride_s_t
    cos1 = tl.load(cos_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    x_offs = token * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :] * stride_x_d
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + HALF * stride_x_d, mask=mask, other=0.0).to(tl.float32)

    o_offs = token * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_offs, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
    tl.store(out_ptr + o_offs + HALF * stride_o_d, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


def rotary_embedding(q_or_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads, head_dim] (a new tensor).

    cos, sin: the tables at each token's position, [T, rotary_dim] (or [T, 1, rotary_dim]); a
    partial rotary (rotary_dim < head_dim) rotates each head's first rotary_dim dims only.
    """
    num_tokens, num_heads, head_dim = q_or_k.shape
    rotary_dim = cos.shape[-1]
    cos = cos.reshape(num_tokens, rotary_dim)
    sin = sin.reshape(num_tokens, rotary_dim)
    if rotary_dim < head_dim:  # the kernel writes the rotated dims over a copy
        out = q_or_k.clone(memory_format=torch.contiguous_format)
    else:
        out = torch.empty_like(q_or_k, memory_format=torch.contiguous_format)
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        q_or_k,
        cos,
        sin,
        out,
        num_heads,
        *q_or_k.stride(),
        cos.stride(0),
        sin.stride(0),
        *out.stride(),
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out


def rotary_embedding_ref(
    q_or_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    num_tokens, rotary_dim = q_or_k.shape[0], cos.shape[-1]
    cos = cos.reshape(num_tokens, 1, rotary_dim)
    sin = sin.reshape(num_tokens, 1, rotary_dim)
    x, rest = q_or_k[..., :rotary_dim], q_or_k[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.cat((x * cos + rotated * sin, rest), dim=-1)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate/up projection x = [T, 2 * I] -> [T, I]."""
    num_tokens, two_inter = x.shape
    inter = two_inter // 2
    out = x.new_empty(num_tokens, inter)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x,
        out,
        inter,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
