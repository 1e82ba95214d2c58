"""LlamaIndex integration: `PagedLLM`, a native LlamaIndex LLM on the in-process engine."""

from llama_index.llms.paged.base import PagedLLM

__all__ = ["PagedLLM"]
