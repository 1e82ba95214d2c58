"""Attention over the paged KV cache: the interface every backend implements, the step's
metadata, and the check of the block tables a step reads.

Each backend owns its KV cache layout (`allocate_kv_cache`). A step's flattened batch puts
decode sequences (query length 1) first; `AttentionMetadata` describes it once for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer. Sequences with one query token come first."""

    num_decodes: int
    query_start_loc: list[int]  # len num_seqs + 1, offsets into the flattened tokens
    seq_lens: list[int]  # tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with FREED_BLOCK (block_pool)
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (< 0: skip)
    block_size: int
    block_tables_cpu: np.ndarray | None = None  # the same table on the host, for planning
    # The most rows a sequence may have for the C decode kernel to run the step (the model
    # runner's choice: a decode and the drafts it verifies, or any chunk that short).
    c_decode_rows: int = 1
    prepared: object = None  # backend-specific, built once per step by `AttentionBackend.prepare`


KVCache = tuple[torch.Tensor, torch.Tensor]


def check_block_tables(
    tables: np.ndarray,
    first_keys: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_blocks: int,
) -> None:
    """Refuse a step in which a kernel would read through an entry that names no block
    (`FREED_BLOCK`: freed or padding) or lies outside the cache: in row i, every entry from the
    block of key `first_keys[i]` (the first any layer reads) to the block of the last of its
    `seq_lens[i]` tokens must be a block id in [0, num_blocks). The C kernels index the cache
    with these ids unchecked, so this runs once per step, vectorised, before any of them."""
    lo = first_keys // block_size
    hi = -(-seq_lens // block_size)
    if (hi > tables.shape[1]).any():
        row = int(np.argmax(hi > tables.shape[1]))
        raise ValueError(
            f"sequence {row} has {int(seq_lens[row])} tokens but its block table only "
            f"{tables.shape[1]} entries of {block_size}"
        )
    cols = np.arange(tables.shape[1])
    read = (cols >= lo[:, None]) & (cols < hi[:, None])
    bad = read & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"block table entry {col} of sequence {row} is {int(tables[row, col])}, which this "
            f"step reads: it must be a block id in [0, {num_blocks})"
        )


class AttentionBackend(Protocol):
    name: str

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[KVCache]:
        """Zeroed (K, V) cache tensors per layer, in this backend's layout."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step tensors (gather indices, masks) once for all layers."""

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
        """Write the new k/v into the cache, then attend: q [T, H, D] -> [T, H, D]. With a
        `window` (one of the backend's `windows`), the token at position p sees the keys at
        positions p - window + 1 .. p only, as transformers' sliding-window layers do; the
        entries of the block tables before that may be stale (freed blocks) and are not read.
        With a `softcap` (Gemma 2), each scaled score s becomes tanh(s / softcap) * softcap
        before the softmax."""
