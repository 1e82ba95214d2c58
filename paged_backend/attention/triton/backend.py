"""The `triton` attention backend: reshape_and_cache, then one unified attention launch."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from paged_backend.attention.backend import AttentionMetadata, KVCache
from paged_backend.attention.triton.attention import unified_attention
from paged_backend.attention.triton.cache import reshape_and_cache


@dataclass
class _TritonPrepared:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the block tables' device
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int


class TritonAttention:
    """Same results as `TorchAttention` for any batch layout, in two launches per layer.

    The kernel does not rely on decodes coming first: every sequence is causal attention of
    its new tokens over `seq_len` cached tokens.
    """

    name = "triton"

    def allocate_kv_cache(
        self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device
    ) -> list[KVCache]:
        """Per layer K and V as `[num_blocks, block_size, num_kv_heads, head_dim]` views."""
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        cache = torch.zeros(shape, dtype=dtype, device=device)
        return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.block_tables.device
        starts = meta.query_start_loc
        meta.prepared = _TritonPrepared(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(b - a for a, b in pairwise(starts)),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        prep: _TritonPrepared = meta.prepared
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        return unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            prep.query_start_loc,
            prep.seq_lens,
            meta.block_tables,
            q.shape[-1] ** -0.5,
            max_query_len=prep.max_query_len,
            window=window,
            softcap=softcap,
        )
