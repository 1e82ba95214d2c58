"""`PagedLLM` in LlamaIndex: the eight chat/complete methods on the shared engine, usage and
prefix-cache counts, stops, sampling validation, and the pipelines users build on it (query
engines, tree_summarize on a worker-thread event loop, chat engines, token counting), and
function calling (tool calls, structured prediction through a forced call, a FunctionAgent).
Real default model, fp32 and greedy so that every path gives the same text."""

from __future__ import annotations

import asyncio
import math
import time
import zlib

import llama_index.core
import pytest
from llama_index.core import Document, PromptTemplate, Settings, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ToolCallBlock
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from llama_index.llms.paged import PagedLLM

ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": 256}
QUESTION = "What is the capital of France?"
COUNTING = "Count: 1, 2, 3,"  # greedy continuation: " 4, 5, 6, 7, ..."
FACTS = {
    "Lindenfeld": "The town of Lindenfeld lies on the river Alm. Its archive was founded in "
    "1873 and holds the council records, the parish registers and the guild books. ",
    "Brass band": "The Lindenfeld brass band has thirty members. It plays on the market square "
    "every Sunday in summer and rehearses in the old mill on Thursdays. ",
    "Bakery": "The bakery on Mill Street bakes rye bread with caraway seeds. It opens at six in "
    "the morning and closes at noon on Saturdays. ",
    "Bridge": "The stone bridge over the Alm was built in 1642. It has five arches and was "
    "restored after the flood of 1899. ",
}


def make_llm(**fields) -> PagedLLM:
    """A PagedLLM on the module's engine (same model and engine args: shared, not reloaded)."""
    return PagedLLM(**{"temperature": 0, "max_tokens": 16, "engine_args": ENGINE_ARGS, **fields})


@pytest.fixture(scope="module")
def llm() -> PagedLLM:
    return make_llm()


class HashEmbedding(BaseEmbedding):
    """Bag of words hashed into 64 dimensions: deterministic retrieval without a model."""

    def _vector(self, text: str) -> list[float]:
        vec = [0.0] * 64
        for word in text.lower().split():
            vec[zlib.crc32(word.strip(".,?!").encode()) % 64] += 1.0
        norm = math.sqrt(sum(x * x for x in vec)) or 1.0
        return [x / norm for x in vec]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    docs = [Document(text=text * 6, metadata={"title": t}) for t, text in FACTS.items()]
    return VectorStoreIndex.from_documents(docs, embed_model=HashEmbedding())


def usage(response) -> dict:
    return response.raw["usage"]


def text_of(response) -> str:
    """The (cumulative) text of a CompletionResponse or ChatResponse."""
    return response.text if hasattr(response, "text") else response.message.content


def wait_until_idle(llm: PagedLLM, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.engine.stats()
        if not stats["num_in_flight"] and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"requests still hold the engine: {llm.engine.stats()}")


# ---- construction and metadata ---------------------------------------------------------------
def test_metadata_comes_from_the_model_config_without_starting_an_engine(llm):
    fresh = PagedLLM(engine_args={"max_model_len": 1024, "num_kv_blocks": 64})
    meta = fresh.metadata
    assert (meta.context_window, meta.num_output) == (1024, 256)
    assert meta.is_chat_model and meta.model_name == "SmolLM2-135M-Instruct"
    assert not fresh._handle.started
    assert llm.metadata.context_window == llm.engine.max_model_len == 8192
    assert llm.metadata.num_output == 16 and llm.metadata.model_name == llm.engine.model_name


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"additional_kwargs": {"min_p": 2}}, "min_p"),
        ({"additional_kwargs": {"n": 2}}, "n"),
    ],
)
def test_bad_sampling_values_fail_at_construction_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=rf"\b{name} must be"):
        PagedLLM(**fields)


async def test_bad_per_call_values_fail_before_any_work(llm):
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        llm.complete(QUESTION, repetition_penalty=0)
    with pytest.raises(ValueError, match="top_k must be"):
        await llm.astream_chat([ChatMessage(role="user", content=QUESTION)], top_k=-5)
    with pytest.raises(TypeError, match=r"unknown sampling argument.*temprature"):
        await llm.acomplete(QUESTION, temprature=0.5)


# ---- the eight methods -----------------------------------------------------------------------
async def test_all_eight_methods_give_the_same_answer_and_usage(llm):
    messages = [ChatMessage(role=MessageRole.USER, content=QUESTION)]
    finals = {
        "complete": llm.complete(QUESTION),
        "chat": llm.chat(messages),
        "acomplete": await llm.acomplete(QUESTION),
        "achat": await llm.achat(messages),
    }
    streams = {
        "stream_complete": list(llm.stream_complete(QUESTION)),
        "stream_chat": list(llm.stream_chat(messages)),
        "astream_complete": [r async for r in await llm.astream_complete(QUESTION)],
        "astream_chat": [r async for r in await llm.astream_chat(messages)],
    }
    texts = {name: text_of(r) for name, r in finals.items()}
    for name, chunks in streams.items():
        assert len(chunks) > 1, name
        texts[name] = "".join(c.delta for c in chunks)
        assert texts[name] == text_of(chunks[-1])
        finals[name] = chunks[-1]
    assert len(set(texts.values())) == 1, texts
    assert "Paris" in texts["complete"]
    counts = {(usage(r)["prompt_tokens"], usage(r)["completion_tokens"]) for r in finals.values()}
    assert len(counts) == 1, counts
    for response in finals.values():
        u = usage(response)
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert response.raw["finish_reason"] in ("stop", "length")
    # every call after the first reuses the prompt's cached full blocks
    assert usage(finals["astream_chat"])["cached_tokens"] >= 16


def test_formatted_prompts_go_raw_and_per_call_kwargs_apply(llm):
    response = llm.complete(COUNTING, formatted=True, max_tokens=4, ignore_eos=True, logprobs=2)
    assert response.text.startswith(" 4,")
    assert usage(response)["completion_tokens"] == 4
    assert usage(response)["prompt_tokens"] == len(llm.engine.tokenize(COUNTING))
    assert response.raw["finish_reason"] == "length"
    assert len(response.logprobs) == 4
    for candidates in response.logprobs:
        assert len(candidates) >= 2
        assert candidates[0].logprob >= candidates[1].logprob
    chunks = list(llm.stream_complete(COUNTING, formatted=True, max_tokens=4, logprobs=0))
    assert sum(len(c.logprobs) for c in chunks) == 4
    assert "prompt_logprobs" not in response.raw
    scored = llm.complete(COUNTING, formatted=True, max_tokens=1, prompt_logprobs=1)
    prompt = scored.raw["prompt_logprobs"]
    assert len(prompt) == len(llm.engine.tokenize(COUNTING)) and prompt[0] is None
    assert all(c[0].logprob >= c[-1].logprob for c in prompt[1:])


def test_stop_sequences_from_constructor_and_call_are_merged(llm):
    stopping = make_llm(stop=[" 6"])
    assert stopping.complete(COUNTING, formatted=True).text == " 4, 5,"
    assert stopping.complete(COUNTING, formatted=True, stop=None).text == " 4, 5,"
    response = stopping.complete(COUNTING, formatted=True, stop=[" 5"])
    assert response.text == " 4,"
    assert (response.raw["finish_reason"], response.raw["stop_reason"]) == ("stop", " 5")
    chunks = list(llm.stream_complete(COUNTING, formatted=True, stop=" 5"))
    assert "".join(c.delta for c in chunks) == " 4,"


def test_system_prompt_is_added_once_and_prompt_functions_take_precedence(llm):
    user = ChatMessage(role=MessageRole.USER, content=QUESTION)
    system = "You are a terse geography tutor."
    templated = llm.engine.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    )
    expected = len(llm.engine.tokenize(templated, add_special_tokens=False))
    tutor = make_llm(system_prompt=system)
    assert usage(tutor.chat([user]))["prompt_tokens"] == expected
    # predict() and the structured programs extend the messages themselves
    assert usage(tutor.chat(tutor._extend_messages([user])))["prompt_tokens"] == expected
    assert usage(tutor.complete(QUESTION))["prompt_tokens"] == expected

    seen = []

    def messages_to_prompt(messages) -> str:
        seen.append([m.role for m in messages])
        return "\n".join(m.content for m in messages) + "\nAnswer:"

    custom = make_llm(
        messages_to_prompt=messages_to_prompt, completion_to_prompt=lambda p: f"Q: {p}\nA:"
    )
    chat = custom.chat([user])
    assert seen == [[MessageRole.USER]]
    assert usage(chat)["prompt_tokens"] == len(llm.engine.tokenize(f"{QUESTION}\nAnswer:"))
    completion = custom.complete(QUESTION)
    assert usage(completion)["prompt_tokens"] == len(llm.engine.tokenize(f"Q: {QUESTION}\nA:"))


async def test_consumers_that_stop_early_abort_their_requests(llm):
    generated = llm.engine.stats()["num_generated_tokens"]
    stream = llm.stream_complete(QUESTION, max_tokens=200, ignore_eos=True)
    next(stream)
    stream.close()
    agen = await llm.astream_chat([ChatMessage(role="user", content=QUESTION)], max_tokens=200)
    await agen.__anext__()
    await agen.aclose()
    assert wait_until_idle(llm)["num_generated_tokens"] - generated < 100  # not 2 x 200


async def test_concurrent_acomplete_calls_share_one_batch():
    # distinct engine args: a fresh engine, so max_batch_size counts only these requests
    batched = PagedLLM(
        temperature=0,
        max_tokens=8,
        additional_kwargs={"ignore_eos": True},
        engine_args={**ENGINE_ARGS, "num_kv_blocks": 128},
    )
    topics = ("rivers", "bridges", "bakeries", "brass bands")
    responses = await asyncio.gather(*(batched.acomplete(f"Tell me about {t}.") for t in topics))
    assert [usage(r)["completion_tokens"] for r in responses] == [8] * len(topics)
    assert batched.engine.stats()["max_batch_size"] > 1


# ---- LlamaIndex pipelines --------------------------------------------------------------------
def test_query_engine_with_settings_llm_and_streaming(llm, index, monkeypatch):
    monkeypatch.setattr(Settings, "_llm", None)  # restored after the test
    Settings.llm = llm
    response = index.as_query_engine().query("When was the stone bridge built?")
    assert "1642" in str(response)
    assert response.source_nodes[0].node.metadata["title"] == "Bridge"
    streaming = index.as_query_engine(streaming=True).query("When was the stone bridge built?")
    assert "".join(streaming.response_gen) == str(response)


@pytest.fixture(scope="module")
def small_llm() -> PagedLLM:
    """A 512-token context window: LlamaIndex must split retrieved text over several calls."""
    return make_llm(
        engine_args={**ENGINE_ARGS, "block_size": 16, "num_kv_blocks": 96, "max_model_len": 512}
    )


def test_prompts_near_the_window_end_there_rather_than_fail(small_llm):
    prompt = "one two three four " * 126
    response = small_llm.complete(prompt, formatted=True, ignore_eos=True)
    assert usage(response)["prompt_tokens"] + usage(response)["completion_tokens"] == 512
    assert 0 < usage(response)["completion_tokens"] < small_llm.max_tokens
    with pytest.raises(ValueError, match="max_model_len"):
        small_llm.complete(prompt * 2, formatted=True)


async def test_tree_summarize_runs_its_coroutines_on_a_worker_thread_loop(
    small_llm, index, monkeypatch
):
    """A sync query inside a running loop makes LlamaIndex run the per-chunk `apredict` calls
    on a fresh event loop in a worker thread; they must still batch together."""
    # count with the model's own tokenizer, as PagedLLM.tokenize's docstring recommends
    monkeypatch.setattr(llama_index.core, "global_tokenizer", small_llm.tokenize)
    engine = index.as_query_engine(
        llm=small_llm, response_mode="tree_summarize", use_async=True, similarity_top_k=4
    )
    response = engine.query("What can you find in Lindenfeld?")
    assert str(response).strip()
    assert small_llm.engine.stats()["max_batch_size"] > 1


def test_chat_engine_condenses_and_answers_from_context(llm, index):
    chat_engine = index.as_chat_engine(llm=llm)
    first = chat_engine.chat("When was the stone bridge built?")
    assert "1642" in str(first)
    follow_up = chat_engine.chat("And when was it restored?")
    assert str(follow_up).strip()
    assert len(chat_engine.chat_history) == 4


def test_token_counting_handler_sees_prompt_and_completion_counts(llm):
    counter = TokenCountingHandler()
    counted = make_llm(callback_manager=CallbackManager([counter]))
    responses = [
        counted.complete(QUESTION),
        list(counted.stream_chat([ChatMessage(role="user", content="Name a colour.")]))[-1],
    ]
    assert len(counter.llm_token_counts) == 2
    for event, response in zip(counter.llm_token_counts, responses, strict=True):
        assert event.prompt_token_count == usage(response)["prompt_tokens"]
        assert event.completion_token_count == usage(response)["completion_tokens"]
    assert counter.total_llm_token_count == sum(usage(r)["total_tokens"] for r in responses)


class Pet(BaseModel):
    name: str = Field(max_length=20)
    legs: int = Field(ge=0, le=8)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


TOOLS = [FunctionTool.from_defaults(add), FunctionTool.from_defaults(get_weather)]


def tool_llm(**fields) -> PagedLLM:
    return make_llm(max_tokens=64, **fields)


def test_is_a_function_calling_llm(llm):
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model


@pytest.mark.slow
def test_structured_predict_fills_the_model_through_a_forced_tool_call():
    structured = tool_llm()
    prompt = PromptTemplate("Extract the pet from this sentence: {text}")
    pet = structured.structured_predict(Pet, prompt, text="Rex is a dog with four legs.")
    assert pet == Pet(name="Rex", legs=4)
    sllm = structured.as_structured_llm(Pet)
    reply = sllm.chat([ChatMessage(role="user", content="Tom is a cat with four legs.")])
    assert isinstance(reply.raw, Pet) and Pet.model_validate_json(reply.message.content)
    parsed = asyncio.run(
        structured.astructured_predict(Pet, prompt, text="Polly is a parrot with two legs.")
    )
    assert isinstance(parsed, Pet) and 0 <= parsed.legs <= 8


async def test_streamed_structured_predict_ends_with_the_whole_object():
    """LlamaIndex's streaming programs leave the tool choice to the model; PagedLLM names the
    tool, so a small model still fills the object."""
    structured = tool_llm()
    prompt = PromptTemplate("Extract the pet from this sentence: {text}")
    *_, last = structured.stream_structured_predict(Pet, prompt, text="Rex is a dog, 4 legs.")
    assert (last.name, last.legs) == ("Rex", 4)
    stream = await structured.astream_structured_predict(
        Pet, prompt, text="Tom is a cat with four legs."
    )
    parts = [p async for p in stream]
    assert isinstance(parts[-1].name, str) and parts[-1].legs == 4


def test_chat_with_tools_returns_calls_as_tool_selections():
    model = tool_llm()
    reply = model.chat_with_tools(TOOLS, user_msg="What is 3 plus 4?", tool_required=True)
    (call,) = model.get_tool_calls_from_response(reply)
    assert (call.tool_name, call.tool_kwargs) == ("add", {"a": 3, "b": 4}) and call.tool_id
    assert isinstance(reply.message.blocks[-1], ToolCallBlock)
    answer = model.predict_and_call(TOOLS, user_msg="Weather in Paris?", tool_required=True)
    assert answer.response == get_weather("Paris") and answer.sources[0].tool_name == "get_weather"


async def test_streamed_tool_calls_complete_in_the_last_response():
    model = tool_llm()
    stream = await model.astream_chat_with_tools(
        TOOLS, user_msg="What is the weather in Rome?", tool_choice="get_weather"
    )
    responses = [r async for r in stream]
    (call,) = model.get_tool_calls_from_response(responses[-1])
    assert call.tool_name == "get_weather" and isinstance(call.tool_kwargs["city"], str)
    assert not model.get_tool_calls_from_response(responses[0], error_on_no_tool_call=False)
    assert "".join(r.delta for r in responses) == ""  # all of it was the call
    sync = list(model.stream_chat_with_tools(TOOLS, user_msg="Add 2 and 5.", tool_required=True))
    assert model.get_tool_calls_from_response(sync[-1])[0].tool_kwargs == {"a": 2, "b": 5}


def test_no_tool_call_is_an_error_only_when_asked():
    model = tool_llm()
    reply = model.chat_with_tools(TOOLS, user_msg="Say hello.", tool_choice="none")
    assert reply.message.content
    assert model.get_tool_calls_from_response(reply, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected a tool call"):
        model.get_tool_calls_from_response(reply)
    with pytest.raises(ValueError, match="tool_choice must be"):
        model.chat_with_tools(TOOLS, user_msg="Hi", tool_choice="multiply")


@pytest.mark.slow
async def test_function_agent_with_two_tools_completes_a_task():
    """The agent calls the weather tool (a 135M model needs `initial_tool_choice` to call one
    at all), gets its result back as a tool message and answers with it."""
    agent = FunctionAgent(
        tools=TOOLS,
        llm=tool_llm(),
        initial_tool_choice="required",
        system_prompt="Answer with the tools' results.",
    )
    handler = agent.run("What is the weather in Paris?")
    calls = [e async for e in handler.stream_events() if isinstance(e, ToolCallResult)]
    result = await handler
    (call,) = calls
    assert (call.tool_name, call.tool_kwargs) == ("get_weather", {"city": "Paris"})
    assert "sunny and 21 degrees" in str(result).lower()


def test_a_stream_outlives_its_dropped_adapter(tiny_model):
    """`PagedLLM(...).stream_complete(...)` keeps no other reference to the adapter: its stream
    holds the engine until it ends (else the engine shuts down under it), sync and async."""
    args = {"dtype": "float32", "num_kv_blocks": 32}
    fields = {"model": str(tiny_model), "engine_args": args, "temperature": 0}
    chunks = list(PagedLLM(**fields, max_tokens=6).stream_complete("a b c"))
    assert len(chunks) >= 2 and chunks[-1].text

    async def consume() -> list:
        stream = await PagedLLM(**fields, max_tokens=6).astream_complete("a b c")
        return [chunk async for chunk in stream]

    assert asyncio.run(consume())[-1].text == chunks[-1].text
