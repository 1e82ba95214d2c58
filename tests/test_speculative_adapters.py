"""Speculative decoding where users see it: `speculative_config` in an adapter's engine
arguments reaches the engine, a greedy stream with accepted drafts arrives in chunks of several
tokens whose text is exactly that of the same adapter without drafts, and the drafting stats are
exported as Prometheus gauges. On the tiny model that quotes its prompt (conftest
`quoting_model`), so that drafts are accepted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from conftest import QUOTED
from llama_index.core.llms import ChatMessage

from langchain_paged import ChatPaged
from langchain_paged import PagedLLM as LangChainLLM
from llama_index.llms.paged import PagedLLM as LlamaIndexLLM
from paged_backend import SamplingParams, get_engine, release_engine

ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": 64}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
MAX_TOKENS = 40  # the quote and a half: drafts come from the prompt, then from the reply


async def _agather(stream) -> list[str]:
    return [response.delta async for response in await stream]


# Each adapter's stream of a greedy reply to QUOTED, as its text chunks; `engine_args` holds
# speculative_config or not. LangChain's adapters take engine arguments as keywords too.
STREAMS: dict[str, Callable[[str, dict], list[str]]] = {
    "ChatPaged.stream": lambda model, args: [
        chunk.content
        for chunk in ChatPaged(
            model=model, temperature=0, max_tokens=MAX_TOKENS, engine_args=args
        ).stream(QUOTED)
    ],
    "langchain PagedLLM.stream": lambda model, args: list(
        LangChainLLM(model=model, temperature=0, max_tokens=MAX_TOKENS, **args).stream(QUOTED)
    ),
    "llama_index PagedLLM.stream_complete": lambda model, args: [
        response.delta
        for response in LlamaIndexLLM(
            model=model, temperature=0, max_tokens=MAX_TOKENS, engine_args=args
        ).stream_complete(QUOTED)
    ],
    "llama_index PagedLLM.stream_chat": lambda model, args: [
        response.delta
        for response in LlamaIndexLLM(
            model=model, temperature=0, max_tokens=MAX_TOKENS, engine_args=args
        ).stream_chat([ChatMessage(role="user", content=QUOTED)])
    ],
    "llama_index PagedLLM.astream_complete": lambda model, args: asyncio.run(
        _agather(
            LlamaIndexLLM(
                model=model, temperature=0, max_tokens=MAX_TOKENS, engine_args=args
            ).astream_complete(QUOTED)
        )
    ),
}


@pytest.fixture(scope="module")
def engines(quoting_model, one_thread):
    """The plain and the drafting engine, held for the module: the adapters built in each test
    share them (same model and engine arguments) instead of starting their own."""
    plain = get_engine(str(quoting_model), **ENGINE_ARGS)
    drafting = get_engine(str(quoting_model), **ENGINE_ARGS, speculative_config=SPEC)
    yield plain, drafting
    release_engine(plain)
    release_engine(drafting)


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS)
def test_streams_with_drafts_give_the_plain_text_in_fewer_chunks(quoting_model, engines, stream):
    plain, drafting = engines
    accepted = drafting.stats()["spec_num_accepted_tokens"]
    expected = stream(str(quoting_model), ENGINE_ARGS)
    got = stream(str(quoting_model), {**ENGINE_ARGS, "speculative_config": SPEC})
    assert "".join(expected).startswith(QUOTED)  # the model quoted: drafts can be right
    assert "".join(got) == "".join(expected)
    assert drafting.stats()["spec_num_accepted_tokens"] > accepted
    assert plain.stats()["spec_num_draft_tokens"] == 0
    # Plain streams send about a token a chunk; accepted drafts come with their step's own
    # token, several tokens a chunk.
    assert len([c for c in expected if c]) > MAX_TOKENS // 2
    assert len([c for c in got if c]) < MAX_TOKENS // 2


def test_the_drafting_stats_are_prometheus_gauges(engines):
    prometheus_client = pytest.importorskip("prometheus_client")
    _, drafting = engines
    list(drafting.generate_stream(QUOTED, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)))
    stats = drafting.stats()  # exports them
    assert stats["spec_num_accepted_tokens"] > 0
    labels = {"model": drafting.model_name, "engine": stats["engine_id"], "replica": ""}
    for key in (
        "spec_num_draft_tokens",
        "spec_num_accepted_tokens",
        "spec_acceptance_rate",
        "spec_mean_acceptance_length",
    ):
        value = prometheus_client.REGISTRY.get_sample_value(f"paged_backend_{key}", labels)
        assert value == stats[key], key
