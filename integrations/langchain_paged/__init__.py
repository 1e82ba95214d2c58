"""LangChain integration (filled in by the integration work)."""
