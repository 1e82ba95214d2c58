"""Model implementations (our own torch modules; weights from safetensors)."""

from paged_backend.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
