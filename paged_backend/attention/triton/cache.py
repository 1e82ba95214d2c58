"""Writing a step's new K/V into the paged cache (vLLM's `reshape_and_cache`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # tokens per program


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE

    k = tl.load(
        k_ptr + (offs_t * stride_k_t + head * stride_k_h)[:, None] + offs_d[None, :] * stride_k_d,
        mask=mask,
    )
    v = tl.load(
        v_ptr + (offs_t * stride_v_t + head * stride_v_h)[:, None] + offs_d[None, :] * stride_v_d,
        mask=mask,
    )
    kc_offs = (block * stride_kc_b + in_block * stride_kc_s + head * stride_kc_h)[:, None] + offs_d[
        None, :
    ] * stride_kc_d
    vc_offs = (block * stride_vc_b + in_block * stride_vc_s + head * stride_vc_h)[:, None] + offs_d[
        None, :
    ] * stride_vc_d
    tl.store(k_cache_ptr + kc_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + vc_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, kv_heads, head_dim] at `slot_mapping` [T] in the caches.

    A slot is `block * block_size + offset` into caches of shape [num_blocks, block_size,
    kv_heads, head_dim]; slots < 0 mark padding tokens and are skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = k_cache.shape[1]
    grid = (triton.cdiv(num_tokens, BLOCK_T), num_kv_heads)
    _reshape_and_cache_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_T=BLOCK_T,
    )
