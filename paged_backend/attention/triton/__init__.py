"""Triton kernels for CUDA: paged attention, cache writes and fused layer ops.

Imported only when the `triton` backend is chosen; on CPU they run under
`TRITON_INTERPRET=1` for testing only.
"""

from paged_backend.attention.triton.attention import unified_attention
from paged_backend.attention.triton.cache import reshape_and_cache
from paged_backend.attention.triton.fused import rms_norm, rotary_embedding, silu_and_mul

__all__ = ["reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul", "unified_attention"]
