"""`get_backend`: the attention backend by name (the torch backend for CPU and reference, with
the C kernels where they run; the Triton one for CUDA). The only module that knows them all."""

from __future__ import annotations

from paged_backend.attention.backend import AttentionBackend


def get_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    c_decode: bool = False,
    c_prefix: bool = False,
    windows: tuple[int | None, ...] = (None,),
) -> AttentionBackend:
    if name == "torch":
        from paged_backend.attention.torch_backend import TorchAttention

        return TorchAttention(num_heads, num_kv_heads, c_decode, c_prefix, windows)
    if name == "triton":
        from paged_backend.attention.triton.backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
