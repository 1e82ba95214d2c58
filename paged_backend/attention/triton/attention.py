"""Unified paged attention: one Triton launch for a whole varlen batch.

Prefill chunks, cached prefixes and single-token decodes are the same problem here: each
sequence has `query_len` new tokens at the end of `seq_len` tokens of context, and query
token i sees keys `0 .. seq_len - query_len + i` (with a window W > 0, only the last W of
them; with a soft-cap C > 0, each scaled score s becomes C * tanh(s / C) before the softmax).
The grid is (query tiles, KV heads), as in vLLM's `triton_unified_attention`: a tile
holds BLOCK_Q query positions times the query heads of one KV head (BLOCK_M rows), so each
K/V tile read from the cache serves the whole GQA group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence a query tile belongs to.

    Sequence i owns the tiles from `query_start_loc[i] // BLOCK_Q + i` on: that leaves it at
    least `cdiv(query_len, BLOCK_Q)` tiles without any per-sequence prefix sum on the host.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    num_seqs,
    window,  # > 0: sliding window, a query sees its last `window` keys; 0: all
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_bt_s,
    stride_bt_b,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of a query tile: BLOCK_Q positions x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration, independent of BLOCK_SIZE
    DOT_PRECISION: tl.constexpr,
    SOFTCAP_LOG2: tl.constexpr,  # > 0: the scores' soft-cap * log2(e), in exp2 units as they are
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile_idx - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    query_pos = local_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    # Rows past BLOCK_Q * GROUP would hold the next tile's first position: that tile's program
    # writes it, and this one does not load all of its keys.
    row_mask = (offs_m < BLOCK_Q * GROUP) & (query_pos < query_len)
    d_mask = offs_d < HEAD_DIM

    q_offs = ((q_start + query_pos) * stride_q_t + head * stride_q_h)[:, None] + offs_d[
        None, :
    ] * stride_q_d
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # Causal: the last query row of this tile sees keys up to its own position.
    last_query = tl.minimum(query_len, (local_tile + 1) * BLOCK_Q)
    num_keys = context_len + last_query
    visible_to = context_len + query_pos  # last key position each row may see
    # With a window, the tile's first query sees nothing before `first_key`: the loop starts at
    # the tile holding it and masks the loads before it, so block table entries before the
    # window (freed blocks) are never read.
    first_key = tl.where(
        window > 0, tl.maximum(context_len + local_tile * BLOCK_Q - window + 1, 0), 0
    )
    offs_n = tl.arange(0, TILE_N)
    block_table_row = block_tables_ptr + seq * stride_bt_s
    for start_n in range((first_key // TILE_N) * TILE_N, num_keys, TILE_N):
        key_pos = start_n + offs_n
        key_mask = (key_pos < num_keys) & (key_pos >= first_key)
        block = tl.load(
            block_table_row + (key_pos // BLOCK_SIZE) * stride_bt_b, mask=key_mask, other=0
        ).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE

        k_offs = (block * stride_k_b + in_block * stride_k_s + kv_head * stride_k_h)[
            None, :
        ] + offs_d[:, None] * stride_k_d
        k = tl.load(k_cache_ptr + k_offs, mask=d_mask[:, None] & key_mask[None, :], other=0.0).to(
            tl.float32
        )
        v_offs = (block * stride_v_b + in_block * stride_v_s + kv_head * stride_v_h)[
            :, None
        ] + offs_d[None, :] * stride_v_d
        v = tl.load(v_cache_ptr + v_offs, mask=key_mask[:, None] & d_mask[None, :], other=0.0).to(
            tl.float32
        )

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP_LOG2 > 0:  # C * tanh(s / C), as tanh(x) = 1 - 2 / (e^2x + 1)
            s = SOFTCAP_LOG2 * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP_LOG2) + 1.0))
        visible = (
            row_mask[:, None]
            & (key_pos[None, :] <= visible_to[:, None])
            & ((window == 0) | (key_pos[None, :] > visible_to[:, None] - window))
        )
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. Padding rows see no key: a shift of 0 keeps their p at 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding rows have l == 0; they are not stored, the guard only avoids computing 0/0.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = ((q_start + query_pos) * stride_o_t + head * stride_o_h)[:, None] + offs_d[
        None, :
    ] * stride_o_d
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    tile_n: int = 32,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's paged K/V; writes `out`.

    q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (the new tokens' K/V must already be in the cache);
    query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs] int32 (context + new tokens);
    block_tables: [num_seqs, max_blocks] int32. `max_query_len`, when known, lets decode-only
    batches use small query tiles; `tile_n` is the number of keys per inner iteration. With a
    `window`, a query sees its last `window` keys only (sliding-window layers); with a `softcap`
    (Gemma 2), each scaled score s becomes tanh(s / softcap) * softcap.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    # At least 16 rows (tl.dot's minimum on GPU), at most 64 unless one GQA group is bigger.
    rows = group * (max_query_len if max_query_len is not None else num_tokens)
    block_m = min(max(16, triton.next_power_of_2(rows)), max(64, triton.next_power_of_2(group)))
    block_q = block_m // group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Every sequence gets at least its cdiv(query_len, block_q) tiles (see _find_seq).
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2E,
        num_seqs,
        window or 0,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        # fp16/bf16 values are exact in tf32; fp32 inputs need full-precision dots.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP_LOG2=(softcap or 0.0) * LOG2E,
        # The fp32 Q tile and accumulator spill registers at 64 x 128 with 4 warps (ptxas).
        num_warps=8 if block_m * head_dim_pad >= 64 * 128 else 4,
    )
    return out
