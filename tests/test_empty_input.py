"""One rule at every entry: a request must give text to answer. A completion prompt '' is
refused, and so is a chat with a user message whose content is empty (the error names it),
before anything is queued; the template's framing alone is never answered."""

from __future__ import annotations

import asyncio

import pytest

from paged_backend import LLM, AsyncEngine, SamplingParams, get_engine, release_engine

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32}
EMPTY_TURN = r"messages\[1\] is a user message with empty content"
EMPTY_PROMPT = "prompt must be a non-empty string"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}]


@pytest.fixture(scope="module")
def shared(tiny_model, one_thread):
    """The shared engine the adapters below use, held for the module."""
    engine = get_engine(str(tiny_model), **ENGINE_ARGS)
    yield engine
    release_engine(engine)


def _assert_idle(engine) -> None:
    stats = engine.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_generated_tokens"] == 0  # nothing ever ran on this engine


@pytest.mark.parametrize(
    "conversation",
    [
        CHAT,
        [CHAT[0], {"role": "user", "content": None}],
        [CHAT[0], {"role": "user", "content": [{"type": "text", "text": ""}]}],
    ],
    ids=["empty", "none", "empty-parts"],
)
def test_llm_chat_refuses_an_empty_user_message(tiny_model, conversation):
    llm = LLM(model=str(tiny_model), **ENGINE_ARGS)
    good = [{"role": "user", "content": "Hello"}]
    with pytest.raises(ValueError, match=EMPTY_TURN):
        llm.chat([good, conversation], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        llm.chat([[]], use_tqdm=False)
    _assert_idle(llm)
    # an empty assistant turn (e.g. one that only called a tool) is fine
    chat = [*good, {"role": "assistant", "content": ""}, {"role": "user", "content": "Go on"}]
    assert llm.chat(chat, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_async_engine_chat_helper_refuses_an_empty_user_message(shared):
    with pytest.raises(ValueError, match=EMPTY_TURN):
        shared.apply_chat_template(CHAT)
    with pytest.raises(ValueError, match=EMPTY_PROMPT):
        shared.generate_stream("")
    _assert_idle(shared)


def _call_all_four(model, arg) -> list[Exception]:
    """invoke, stream, ainvoke and astream (sync and async, whole and streamed)."""

    async def astream():
        return [c async for c in model.astream(arg)]

    errors = []
    for call in (
        lambda: model.invoke(arg),
        lambda: list(model.stream(arg)),
        lambda: asyncio.run(model.ainvoke(arg)),
        lambda: asyncio.run(astream()),
    ):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(info.value)
    return errors


def test_langchain_chat_and_llm_refuse_empty_input(tiny_model, shared):
    from langchain_core.messages import HumanMessage, SystemMessage

    from langchain_paged import ChatPaged, PagedLLM

    chat = ChatPaged(model=str(tiny_model), max_tokens=2, **ENGINE_ARGS)
    messages = [SystemMessage("Be brief."), HumanMessage("")]
    for exc in _call_all_four(chat, messages):
        assert "messages[1] is a user message with empty content" in str(exc)
    for exc in _call_all_four(chat, ""):  # a string is one user message
        assert "messages[0] is a user message with empty content" in str(exc)
    llm = PagedLLM(model=str(tiny_model), max_tokens=2, **ENGINE_ARGS)
    for exc in _call_all_four(llm, ""):
        assert EMPTY_PROMPT in str(exc)
    with pytest.raises(ValueError, match=EMPTY_PROMPT):
        llm.batch(["a fine prompt", ""])
    assert shared.stats()["num_waiting"] == shared.stats()["num_running"] == 0


def test_llama_index_refuses_empty_input(tiny_model, shared):
    from llama_index.core.llms import ChatMessage

    from llama_index.llms.paged import PagedLLM

    llm = PagedLLM(model=str(tiny_model), engine_args=ENGINE_ARGS, max_tokens=2)
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user")]

    async def drain(stream):
        return [r async for r in await stream]

    for call, match in [
        (lambda: llm.chat(messages), EMPTY_TURN),
        (lambda: list(llm.stream_chat(messages)), EMPTY_TURN),
        (lambda: asyncio.run(llm.achat(messages)), EMPTY_TURN),
        (lambda: asyncio.run(drain(llm.astream_chat(messages))), EMPTY_TURN),
        (lambda: llm.complete(""), EMPTY_PROMPT),
        (lambda: list(llm.stream_complete("")), EMPTY_PROMPT),
        (lambda: asyncio.run(llm.acomplete("")), EMPTY_PROMPT),
        (lambda: asyncio.run(drain(llm.astream_complete(""))), EMPTY_PROMPT),
        (lambda: llm.complete("", formatted=True), EMPTY_PROMPT),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert isinstance(llm.engine, AsyncEngine)
    assert llm.engine.stats()["num_waiting"] == llm.engine.stats()["num_running"] == 0
