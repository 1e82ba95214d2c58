"""The LangChain adapters on the default model: sync/async invoke, stream and batch of both
classes, one continuous batch per `batch`, usage and prefix-cache reporting, cancellation,
stop merging, message rendering and early validation."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from conftest import FP32_ENGINE_ARGS, assert_all_blocks_free, transformers_log
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from langchain_paged import ChatPaged, PagedLLM
from langchain_paged.messages import render_chat
from paged_backend.adapters import SAMPLING_FIELDS, model_tokenizer

pytestmark = pytest.mark.slow
COUNTING = "1, 2, 3,"  # greedy continuation: " 4, 5, 6, 7, 8, ..."


@pytest.fixture(scope="module", autouse=True)
def engine(shared_fp32_engine):
    return shared_fp32_engine


def chat(**kwargs) -> ChatPaged:
    return ChatPaged(**{**FP32_ENGINE_ARGS, "temperature": 0, "max_tokens": 12, **kwargs})


def llm(**kwargs) -> PagedLLM:
    return PagedLLM(**{**FP32_ENGINE_ARGS, "temperature": 0, "max_tokens": 12, **kwargs})


def check_reply(message: AIMessage) -> None:
    assert message.content
    usage = message.usage_metadata
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert isinstance(usage["input_token_details"]["cache_read"], int)
    assert message.response_metadata["model_name"] == "SmolLM2-135M-Instruct"
    assert message.response_metadata["finish_reason"] in ("stop", "length")


def check_stream(chunks: list[AIMessageChunk], reply: AIMessage) -> None:
    """Usage on exactly one chunk, the last one, which says so; the text matches `invoke`."""
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].usage_metadata is not None
    assert [c.chunk_position for c in chunks] == [None] * (len(chunks) - 1) + ["last"]
    full = sum(chunks[1:], chunks[0])
    assert full.content == reply.content
    assert full.usage_metadata["output_tokens"] == reply.usage_metadata["output_tokens"]
    assert full.response_metadata["finish_reason"] == reply.response_metadata["finish_reason"]


# ---- construction -------------------------------------------------------------------------
def test_construction_is_lazy_and_collects_engine_args():
    model = ChatPaged(dtype="float32", engine_args={"num_kv_blocks": 64}, temperature=0.5)
    assert model.engine_args == {"num_kv_blocks": 64, "dtype": "float32"}
    assert model.temperature == 0.5
    assert not model._handle.started
    with pytest.raises(TypeError, match="num_kv_blokcs"):
        PagedLLM(num_kv_blokcs=64)


def test_every_sampling_field_is_a_field_and_a_call_kwarg():
    call_only = {"structured_outputs"}  # a schema belongs to a call, not to the model
    for cls in (ChatPaged, PagedLLM):
        assert set(SAMPLING_FIELDS) - set(cls.model_fields) <= call_only
    params = chat(top_k=5)._sampling_params(None, {"min_p": 0.1, "seed": 7})
    assert (params.top_k, params.min_p, params.seed, params.max_tokens) == (5, 0.1, 7, 12)
    assert chat(max_tokens=None)._sampling_params(None, {}).max_tokens is None  # to the end


@pytest.mark.parametrize("cls", [ChatPaged, PagedLLM])
def test_bad_sampling_values_raise_before_any_work(cls):
    with pytest.raises(ValueError, match="temperature"):
        cls(temperature=-1)
    model = cls(num_kv_blocks=40)  # an engine nobody else uses: it must never start
    with pytest.raises(ValueError, match="top_p"):
        model.invoke("hi", top_p=2.0)
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        next(iter(model.stream("hi", n=2)))
    with pytest.raises(TypeError, match="unknown sampling argument"):
        model.invoke("hi", top_q=0.5)
    assert not model._handle.started


def test_tracing_params_and_profile():
    model = chat(stop=["a"])
    ls = model._get_ls_params(stop=["b"])
    assert ls["ls_provider"] == "paged" and ls["ls_model_name"] == "SmolLM2-135M-Instruct"
    assert (ls["ls_model_type"], ls["ls_temperature"], ls["ls_max_tokens"]) == ("chat", 0, 12)
    assert ls["ls_stop"] == ["a", "b"]
    assert model.profile["max_input_tokens"] == 8191
    assert chat(max_model_len=2048).profile["max_output_tokens"] == 2047
    assert model.profile["tool_calling"] and model.profile["tool_choice"]


def test_token_counting_uses_the_model_tokenizer_without_an_engine():
    model = ChatPaged(num_kv_blocks=40)
    tokenizer = model_tokenizer(None)
    assert model.get_token_ids("Hello world") == tokenizer("Hello world").input_ids
    assert model.get_num_tokens("Hello world") == 2
    messages = [SystemMessage("Be brief."), HumanMessage("Hello")]
    counted = model.get_num_tokens_from_messages(messages)
    assert not model._handle.started
    assert chat(max_tokens=1).invoke(messages).usage_metadata["input_tokens"] == counted


# ---- chat model ---------------------------------------------------------------------------
def test_chat_invoke_stream_batch():
    model = chat()
    reply = model.invoke("Hello")
    check_reply(reply)
    check_stream(list(model.stream("Hello")), reply)
    replies = model.batch(["Hello", "What is 2 + 2?"])
    assert len(replies) == 2
    for r in replies:
        check_reply(r)


async def test_chat_ainvoke_astream_abatch():
    model = chat()
    reply = await model.ainvoke("Hello")
    check_reply(reply)
    check_stream([c async for c in model.astream("Hello")], reply)
    replies = await model.abatch(["Hello", "What is 2 + 2?"])
    assert len(replies) == 2
    for r in replies:
        check_reply(r)


def test_chat_n_completions_and_logprobs():
    result = chat(max_tokens=4, temperature=1.0, seed=0).generate([[HumanMessage("Hi")]], n=2)
    assert len(result.generations[0]) == 2
    reply = chat(max_tokens=3, logprobs=2, ignore_eos=True).invoke("Hi")
    logprobs = reply.response_metadata["logprobs"]
    assert len(logprobs) == 3 and all(isinstance(e["logprob"], float) for e in logprobs[0])
    assert "prompt_logprobs" not in reply.response_metadata


def test_prompt_logprobs_come_in_the_metadata():
    """Each prompt token's candidates, best first, the prompt's own token among them; the
    same for the LLM class and for a stream's last chunk."""
    model = chat(max_tokens=2, prompt_logprobs=1)
    reply = model.invoke("Hi")
    prompt = reply.response_metadata["prompt_logprobs"]
    assert len(prompt) == reply.usage_metadata["input_tokens"] and prompt[0] is None
    for candidates in prompt[1:]:
        assert 1 <= len(candidates) <= 2  # the prompt's token, and the best if it is not that
        assert [c["rank"] for c in candidates] == sorted(c["rank"] for c in candidates)
        assert candidates[0]["logprob"] == max(c["logprob"] for c in candidates)
    last = list(model.stream("Hi"))[-1]
    assert last.response_metadata["prompt_logprobs"] == prompt
    text = llm(max_tokens=2, prompt_logprobs=0).generate(["Hi there"]).generations[0][0]
    scored = text.generation_info["prompt_logprobs"]
    assert len(scored) == text.generation_info["usage"]["input_tokens"]
    assert all(len(c) == 1 for c in scored[1:])  # k = 0: the prompt's token alone


def test_messages_of_every_role_render_and_run():
    messages = [
        SystemMessage("You are a calculator."),
        HumanMessage("What is 2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call-1"}]),
        ToolMessage("5", tool_call_id="call-1"),
        HumanMessage([{"type": "text", "text": "So?"}]),
    ]
    tokenizer = model_tokenizer(None)
    prompt = render_chat(
        lambda d: tokenizer.apply_chat_template(d, tokenize=False, add_generation_prompt=True),
        tokenizer.chat_template,
        messages,
    )
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    for turn in (
        "system\nYou are a calculator.",
        "user\nWhat is 2 + 3?",
        f"assistant\n{call}",
        "user\n<tool_response>\n5\n</tool_response>",
        "user\nSo?",
    ):
        assert f"<|im_start|>{turn}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    check_reply(chat(max_tokens=4).invoke(messages))


def test_non_text_content_is_refused():
    image = {"type": "image", "url": "https://example.com/cat.png"}
    with pytest.raises(ValueError, match="'image' content is not supported"):
        chat().invoke([HumanMessage([{"type": "text", "text": "What is this?"}, image])])


# ---- completion model ---------------------------------------------------------------------
def test_llm_invoke_stream_batch():
    model = llm()
    text = model.invoke(COUNTING)
    assert text.startswith(" 4, 5")
    assert "".join(model.stream(COUNTING)) == text
    assert model.batch([COUNTING, "The capital of France is"])[0] == text
    result = model.generate([COUNTING])
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] == "length" and info["usage"]["output_tokens"] == 12
    assert result.llm_output["token_usage"]["input_tokens"] == len(model.get_token_ids(COUNTING))


async def test_llm_ainvoke_astream_abatch():
    model = llm()
    text = await model.ainvoke(COUNTING)
    assert text.startswith(" 4, 5")
    assert "".join([c async for c in model.astream(COUNTING)]) == text
    texts = await model.abatch([COUNTING, "The capital of France is"])
    assert texts[0] == text and texts[1]


# ---- batching, caching, cancellation ------------------------------------------------------
PROMPTS = [f"Write a sentence about the number {i}." for i in range(8)]


@pytest.mark.parametrize("make", [chat, llm], ids=["chat", "llm"])
async def test_batch_and_abatch_of_8_run_as_one_batch(engine, make):
    """Sequentially, 8 requests of 8 tokens take >= 64 steps; batched, about 8."""
    model = make(max_tokens=8, ignore_eos=True)
    for run in (lambda: asyncio.to_thread(model.batch, PROMPTS), lambda: model.abatch(PROMPTS)):
        steps = engine.stats()["num_steps"]
        assert len(await run()) == 8
        assert engine.stats()["num_steps"] - steps < 24


def test_chat_batch_reaches_the_engine_together():
    """On an engine of its own (shut down when `model` goes), all 8 requests step together:
    `batch` runs one thread per input, not LangChain's default pool of CPU count + 4."""
    model = ChatPaged(num_kv_blocks=256, temperature=0, max_tokens=8, ignore_eos=True)
    assert len(model.batch(PROMPTS)) == 8
    assert model.engine.stats()["max_batch_size"] == 8


async def test_a_bad_prompt_in_a_batch_stops_the_others(engine):
    model = llm(max_tokens=400, ignore_eos=True)
    with pytest.raises(ValueError, match="non-empty"):
        await asyncio.to_thread(model.batch, [COUNTING, ""])
    await asyncio.to_thread(assert_all_blocks_free, engine)
    with pytest.raises(ValueError, match="non-empty"):
        await model.abatch([COUNTING, ""])
    await asyncio.to_thread(assert_all_blocks_free, engine)


def test_cache_read_grows_when_a_long_system_prompt_repeats():
    system = f"Session {uuid.uuid4().hex}. " + "Answer in one short sentence. " * 20
    messages = [SystemMessage(system), HumanMessage("Name a colour.")]
    model = chat(max_tokens=2)
    first = model.invoke(messages).usage_metadata
    second = model.invoke(messages).usage_metadata
    assert first["input_token_details"]["cache_read"] < 16
    assert second["input_token_details"]["cache_read"] >= first["input_tokens"] - 16


async def test_cancelling_astream_frees_its_blocks(engine):
    model = chat(max_tokens=400, ignore_eos=True)
    started = asyncio.Event()

    async def consume():
        async for _ in model.astream("Tell me a long story."):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    assert engine.stats()["num_running"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(assert_all_blocks_free, engine)


def test_leaving_a_stream_early_frees_its_blocks(engine):
    for chunk in llm(max_tokens=400, ignore_eos=True).stream("Once upon a time"):
        assert chunk
        break
    assert_all_blocks_free(engine)


# ---- stop sequences -----------------------------------------------------------------------
def test_stop_sequences_merge():
    params = llm(stop=["7"])._sampling_params(["5", "7"], {})
    assert params.stop_strings == ["7", "5"]
    assert llm(stop="7").invoke(COUNTING, stop=["5"]) == " 4, "
    assert llm(stop=["7"]).invoke(COUNTING, stop=None) == " 4, 5, 6, "
    assert llm().invoke(COUNTING, stop=["6"]) == " 4, 5, "


def test_constructor_stop_survives_stop_none_in_chat():
    reply = chat(stop=["!"]).invoke("Hello", stop=None)
    assert "!" not in reply.content
    assert reply.response_metadata["stop_reason"] == "!"


def test_counting_a_long_text_gives_no_indexing_warning(tiny_model, tmp_path, caplog):
    """Counting tokens is no request: past the tokenizer's model_max_length transformers would
    warn of "indexing errors" (once per tokenizer: a fresh model path gets a fresh one)."""
    fresh = tmp_path / "model"
    fresh.mkdir()
    for f in tiny_model.iterdir():
        (fresh / f.name).symlink_to(f)
    long = "word " * 9000
    with transformers_log(caplog):
        assert PagedLLM(model=str(fresh)).get_num_tokens(long) > 8192
        assert ChatPaged(model=str(fresh)).get_num_tokens_from_messages([HumanMessage(long)]) > 8192
    assert not [r for r in caplog.records if "indexing errors" in r.getMessage()], caplog.text
