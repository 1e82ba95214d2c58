"""paged-backend: an embeddable vLLM-class inference engine (paged KV cache, prefix caching,
continuous batching) for LangChain, LlamaIndex and plain Python."""

from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine
from paged_backend.llm import LLM
from paged_backend.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
