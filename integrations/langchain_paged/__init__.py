"""LangChain integration of paged-backend: `ChatPaged` (chat model) and `PagedLLM` (completion
model), both on an in-process engine shared per model."""

from langchain_paged.chat_models import ChatPaged
from langchain_paged.llms import PagedLLM

__all__ = ["ChatPaged", "PagedLLM"]
