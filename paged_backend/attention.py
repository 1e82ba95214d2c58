"""Attention over the paged KV cache: the backend interface and the torch (CPU/reference) backend.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`
(K and V; views into one `[layers, 2, num_blocks, ...]` allocation). A step's flattened batch
puts decode sequences (query length 1) first so they can be attended to in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer. Sequences with one query token come first."""

    num_decodes: int
    query_start_loc: list[int]  # len num_seqs + 1, offsets into the flattened tokens
    seq_lens: list[int]  # tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (< 0: skip)
    block_size: int
    prepared: object = None  # backend-specific, built once per step by `AttentionBackend.prepare`


KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step tensors (gather indices, masks) once for all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new k/v into the cache, then attend: q [T, H, D] -> [T, H, D]."""


@dataclass
class _DecodeGroup:
    gather: torch.Tensor  # flattened block ids of every decode sequence, padded
    mask: torch.Tensor  # [B, 1, 1, padded_len] True where the key is in context
    padded_len: int


@dataclass
class _PrefillSeq:
    start: int
    end: int
    context: int  # tokens before this chunk (cached prefix or earlier chunks)
    gather: torch.Tensor | None  # block ids covering the whole sequence, None if context == 0
    mask: torch.Tensor | None  # [q_len, seq_len]


@dataclass
class _TorchPrepared:
    decode: _DecodeGroup | None
    prefills: list[_PrefillSeq]


class TorchAttention:
    """Reference backend: gathers paged K/V with `index_select` and runs SDPA.

    Decodes are batched with the query heads of one KV head packed as the query dimension,
    so each gathered K/V row serves its whole GQA group without repeat_interleave.
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        device = meta.block_tables.device
        decode = None
        nd = meta.num_decodes
        if nd:
            lens = torch.tensor(meta.seq_lens[:nd], device=device)
            num_blocks = (max(meta.seq_lens[:nd]) + bs - 1) // bs
            padded = num_blocks * bs
            gather = meta.block_tables[:nd, :num_blocks].reshape(-1)
            mask = torch.arange(padded, device=device)[None, :] < lens[:, None]
            decode = _DecodeGroup(gather, mask.view(nd, 1, 1, padded), padded)
        prefills = []
        for i in range(nd, len(meta.seq_lens)):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            context = seq_len - (end - start)
            gather = mask = None
            if context:
                gather = meta.block_tables[i, : (seq_len + bs - 1) // bs]
                q_pos = torch.arange(context, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            prefills.append(_PrefillSeq(start, end, context, gather, mask))
        meta.prepared = _TorchPrepared(decode, prefills)

    def forward(self, q, k, v, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        kv_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        prep: _TorchPrepared = meta.prepared
        num_heads = q.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q)
        if prep.decode is not None:
            d = prep.decode
            nd = d.mask.shape[0]
            keys = k_cache.index_select(0, d.gather).view(nd, d.padded_len, kv_heads, head_dim)
            vals = v_cache.index_select(0, d.gather).view(nd, d.padded_len, kv_heads, head_dim)
            qd = q[:nd].view(nd, kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                qd, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=d.mask
            )
            out[:nd] = o.reshape(nd, num_heads, head_dim)
        for p in prep.prefills:
            qp = q[p.start : p.end].transpose(0, 1)
            if p.gather is None:
                keys, vals = k[p.start : p.end], v[p.start : p.end]
            else:
                seq_len = p.mask.shape[1]
                keys = k_cache.index_select(0, p.gather).view(-1, kv_heads, head_dim)[:seq_len]
                vals = v_cache.index_select(0, p.gather).view(-1, kv_heads, head_dim)[:seq_len]
            o = F.scaled_dot_product_attention(
                qp,
                keys.transpose(0, 1),
                vals.transpose(0, 1),
                attn_mask=p.mask,
                is_causal=p.gather is None,
                enable_gqa=group > 1,
            )
            out[p.start : p.end] = o.transpose(0, 1)
        return out


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from paged_backend.kernels.backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
