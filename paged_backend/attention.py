"""Attention over the paged KV cache: the backend interface, and `get_backend` to pick one (the
torch backend for CPU and reference, `paged_backend.torch_attention`; the Triton one for CUDA,
`paged_backend.kernels.backend`).

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
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (< 0: skip)
    block_size: int
    block_tables_cpu: np.ndarray | None = None  # the same table on the host, for planning
    prepared: object = None  # backend-specific, built once per step by `AttentionBackend.prepare`


KVCache = tuple[torch.Tensor, torch.Tensor]


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


def get_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    c_decode: bool = False,
    c_prefix: bool = False,
    windows: tuple[int | None, ...] = (None,),
) -> AttentionBackend:
    if name == "torch":
        from paged_backend.torch_attention import TorchAttention

        return TorchAttention(num_heads, num_kv_heads, c_decode, c_prefix, windows)
    if name == "triton":
        from paged_backend.kernels.backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
