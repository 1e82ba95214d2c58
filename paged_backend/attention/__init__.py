"""Every attention path over the paged KV cache, in one room:

- `backend`: the interface every backend implements, the step's `AttentionMetadata` and the
  block table check;
- `selector`: `get_backend`, the backend by name;
- `planner`: a step's plan, made once for all layers (cascade over a shared prefix, gathers and
  masks, or the C decode kernel's plan);
- `torch_backend`: the torch reference for CPU, which runs the C kernels of `paged_backend.cpu`
  where they apply (decode steps, shared prefixes, bf16 prefill chunks);
- `fused_decode`: a step of decodes through every layer in one C call;
- `triton/`: the Triton kernels and backend for CUDA.

Models see the interface only: `AttentionBackend.forward(q, k, v, kv_cache, meta, window,
softcap)` per layer, and `FusedDecode` for the whole-model C decode step. A new attention path
is a module here that implements `AttentionBackend`, named in `selector.get_backend`.
"""

from paged_backend.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    check_block_tables,
)
from paged_backend.attention.fused_decode import FusedDecode
from paged_backend.attention.selector import get_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "FusedDecode",
    "KVCache",
    "check_block_tables",
    "get_backend",
]
