"""Model implementations (our own torch modules; weights from safetensors)."""

from paged_backend.models.gemma import GemmaForCausalLM
from paged_backend.models.gemma_config import GEMMA_ARCHITECTURES
from paged_backend.models.llama import LlamaForCausalLM


def native_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Our module for a native architecture (`models.config.SUPPORTED_ARCHITECTURES`)."""
    return GemmaForCausalLM if architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM


__all__ = ["GemmaForCausalLM", "LlamaForCausalLM", "native_model_class"]
