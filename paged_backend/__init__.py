"""paged-backend: an embeddable vLLM-class inference engine (paged KV cache, prefix caching,
continuous batching) for LangChain, LlamaIndex and plain Python."""

from paged_backend.async_engine import AsyncEngine
from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine
from paged_backend.errors import (
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    RequestFailedError,
)
from paged_backend.llm import LLM
from paged_backend.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.sampling_params import SamplingParams
from paged_backend.shared_engines import get_engine, release_engine
from paged_backend.structured_output import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "EngineOverloadedError",
    "EngineShutdownError",
    "LLMEngine",
    "Logprob",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "get_engine",
    "release_engine",
]
__version__ = "0.1.0"
