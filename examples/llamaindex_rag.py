"""Offline RAG with LlamaIndex on paged-backend: a few built-in documents, local MiniLM
embeddings, the embedded default model, answers streamed to stdout.

Follow-up questions retrieve the same passages, so their prompts share the system prompt and the
retrieved context: the engine's prefix cache serves those tokens instead of recomputing them,
and the script prints how many prompt tokens each question got from it.

    python examples/llamaindex_rag.py
"""

from __future__ import annotations

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding
from local_embeddings import embed

from llama_index.llms.paged import PagedLLM

DOCUMENTS = {
    "bridge": "The stone bridge over the river Alm in Lindenfeld was built in 1642. It has five "
    "arches of local sandstone. The flood of 1899 destroyed two of them, and the town restored "
    "the bridge in 1901 with stone from the same quarry. Since 1975 it has been closed to cars.",
    "archive": "The Lindenfeld town archive was founded in 1873. It keeps the council records, "
    "the parish registers and the guild books, and its map room covers the Alm valley from the "
    "sixteenth century onwards. The reading room is open on weekdays from nine to four.",
    "band": "The Lindenfeld brass band was founded in 1921 and has thirty members. It plays on "
    "the market square every Sunday in summer and rehearses in the old mill on Thursday "
    "evenings. Its oldest instrument is a tuba from 1890.",
    "bakery": "The bakery on Mill Street has belonged to the Hartmann family for four "
    "generations. It is known for rye bread with caraway seeds, opens at six in the morning "
    "and closes at noon on Saturdays.",
}
QUESTIONS = [
    "When was the stone bridge built?",
    "What happened to the stone bridge in 1899?",
    "Can cars drive over the stone bridge?",
]


class MiniLMEmbedding(BaseEmbedding):
    """LlamaIndex embedding model around the offline all-MiniLM-L6-v2 of local_embeddings."""

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return embed(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return embed([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


def main() -> None:
    llm = PagedLLM()
    Settings.llm = llm
    Settings.embed_model = MiniLMEmbedding()
    # Count tokens (chunking, prompt packing) with the model's tokenizer rather than tiktoken.
    Settings.tokenizer = llm.tokenize
    docs = [Document(text=text, metadata={"topic": name}) for name, text in DOCUMENTS.items()]
    print(f"[setup] indexing {len(docs)} documents with all-MiniLM-L6-v2 ...", flush=True)
    index = VectorStoreIndex.from_documents(docs, show_progress=True)
    query_engine = index.as_query_engine(streaming=True)
    print("[setup] starting the engine on the default model ...", flush=True)
    llm.engine  # noqa: B018 - started now rather than inside the first answer's stream

    for question in QUESTIONS:
        before = llm.engine.stats()
        print(f"\nQ: {question}\nA: ", end="", flush=True)
        response = query_engine.query(question)
        for delta in response.response_gen:
            print(delta, end="", flush=True)
        after = llm.engine.stats()
        prompt = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        cached = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        sources = ", ".join(n.node.metadata["topic"] for n in response.source_nodes)
        print(f"\n   [sources: {sources}; prefix cache: {cached} of {prompt} prompt tokens]")

    stats = llm.engine.stats()
    print(
        f"\nprefix-cache hit rate {stats['prefix_cache_hit_rate']:.0%} "
        f"({stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens)"
    )


if __name__ == "__main__":
    main()
