"""`ChatPaged.bind_tools` on the default model: forced and named tool choices give valid calls
in `AIMessage.tool_calls` (invoke, stream as tool-call chunks, batch, async), tool results in
the history are rendered, and bad tool arguments fail at bind time."""

from __future__ import annotations

import asyncio
import functools
import itertools
import operator

import pytest
from conftest import FP32_ENGINE_ARGS
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

from langchain_paged import ChatPaged
from langchain_paged.chat_models import _ChunkBuilder, _message_fields
from langchain_paged.messages import render_chat
from paged_backend import StructuredOutputsParams
from paged_backend.adapters import model_tokenizer
from paged_backend.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.slow


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 21 degrees in {city}."


class Reminder(BaseModel):
    """Set a reminder."""

    text: str = Field(max_length=40)
    minutes: int = Field(ge=1, le=600)


@pytest.fixture(scope="module", autouse=True)
def engine(shared_fp32_engine):
    return shared_fp32_engine


def chat(**kwargs) -> ChatPaged:
    return ChatPaged(**{**FP32_ENGINE_ARGS, "temperature": 0, "max_tokens": 96, **kwargs})


def check_call(message: AIMessage, names: set[str]) -> dict:
    (call,) = message.tool_calls
    assert call["name"] in names and call["id"] and not message.invalid_tool_calls
    if call["name"] == "add":
        assert set(call["args"]) == {"a", "b"}
        assert all(isinstance(v, int) for v in call["args"].values())
    elif call["name"] == "get_weather":
        assert isinstance(call["args"]["city"], str)
    return call


def test_required_choice_gives_one_valid_call_everywhere():
    bound = chat().bind_tools([add, get_weather], tool_choice="any")
    names = {"add", "get_weather"}
    check_call(bound.invoke("What is 3 plus 4?"), names)
    for message in bound.batch(["Add 12 and 30.", "What is the weather in Paris?"]):
        check_call(message, names)
    check_call(asyncio.run(bound.ainvoke("Weather in Rome?")), names)


def test_greedy_model_picks_the_fitting_tool_and_arguments():
    bound = chat().bind_tools([add, get_weather], tool_choice="required")
    assert check_call(bound.invoke("What is 3 plus 4?"), {"add"})["args"] == {"a": 3, "b": 4}
    weather = check_call(bound.invoke("What is the weather in Paris?"), {"get_weather"})
    assert weather["args"] == {"city": "Paris"}


@pytest.mark.parametrize(
    "choice", ["Reminder", {"type": "function", "function": {"name": "Reminder"}}]
)
def test_named_choice_calls_that_tool(choice):
    bound = chat().bind_tools([add, Reminder], tool_choice=choice)
    (call,) = bound.invoke("Remind me to call mum in 20 minutes.").tool_calls
    assert call["name"] == "Reminder"
    Reminder.model_validate(call["args"])


def test_streamed_calls_arrive_as_tool_call_chunks():
    bound = chat().bind_tools([add, get_weather], tool_choice="any")
    chunks = list(bound.stream("What is the weather in Paris?"))
    with_calls = [c for c in chunks if c.tool_call_chunks]
    assert len(with_calls) > 1  # the name first, then the arguments as they are generated
    assert with_calls[0].tool_call_chunks[0]["name"] and with_calls[0].tool_call_chunks[0]["id"]
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert isinstance(full, AIMessageChunk) and full.chunk_position == "last"
    invoked = bound.invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [
        (c["name"], c["args"]) for c in invoked.tool_calls
    ]
    assert full.usage_metadata["output_tokens"] == invoked.usage_metadata["output_tokens"]

    async def collect() -> AIMessageChunk:
        total = None
        async for c in bound.astream("What is the weather in Paris?"):
            total = c if total is None else total + c
        return total

    streamed = asyncio.run(collect()).tool_calls
    assert [(c["name"], c["args"]) for c in streamed] == [
        (c["name"], c["args"]) for c in full.tool_calls
    ]


CALLS = (
    ' Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


@pytest.mark.parametrize("cuts", [(), (9,), (30, 31), (75,), (12, 60, 100), (50, 70, 140, 141)])
def test_calls_merge_to_the_invoked_ones_however_the_stream_groups_their_text(cuts):
    """A stream under load hands over several tokens an output: a call's name and arguments
    (or several calls) in one chunk must still join, by LangChain's `+`, into the calls
    `invoke` parses from the same text (it had given ('get_weather', {}) and ('', {...}))."""
    bounds = [0, *cuts, len(CALLS)]
    build = _ChunkBuilder("m", with_tools=True)
    chunks = []
    for start, end in itertools.pairwise(bounds):
        completion = CompletionOutput(0, CALLS[:end], [], None, None, delta_text=CALLS[start:end])
        out = RequestOutput("r", None, [1], [completion], finished=end == len(CALLS))
        if (chunk := build(out)) is not None:
            chunks.append(chunk.message)
    full = functools.reduce(operator.add, chunks)
    invoked = _message_fields(CALLS, with_tools=True)
    assert full.content == invoked["content"] == "Checking."
    assert (
        [(c["name"], c["args"]) for c in full.tool_calls]
        == [(c["name"], c["args"]) for c in invoked["tool_calls"]]
        == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    )


def test_auto_choice_may_answer_in_text_and_calls_are_still_parsed():
    message = chat().bind_tools([add, get_weather]).invoke("Say hello.")
    assert isinstance(message.content, str)
    assert all(c["name"] in {"add", "get_weather"} for c in message.tool_calls)


def test_tool_results_in_the_history_reach_the_model():
    """The call and its result are in the prompt (SmolLM2's template has no tool support, so
    they are written in the documented format); what the model makes of them is its own."""
    history = [
        HumanMessage("What is the weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]),
        ToolMessage("Sunny and 21 degrees in Paris.", tool_call_id="c1"),
    ]
    model = chat(max_tokens=24)
    tokenizer = model_tokenizer(None)
    prompt = render_chat(
        lambda d: tokenizer.apply_chat_template(d, tokenize=False, add_generation_prompt=True),
        tokenizer.chat_template,
        history,
        [convert_to_openai_tool(get_weather)],
    )
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nSunny and 21 degrees in Paris.\n</tool_response>" in prompt
    reply = model.bind_tools([get_weather]).invoke(history)
    assert reply.usage_metadata["input_tokens"] == len(tokenizer(prompt).input_ids)
    assert reply.usage_metadata["input_tokens"] == model.get_num_tokens_from_messages(
        history, tools=[get_weather]
    )


def test_bad_tool_arguments_fail_at_bind_time():
    model = chat()
    with pytest.raises(ValueError, match=r"tool_choice must be .*got 'multiply'"):
        model.bind_tools([add], tool_choice="multiply")
    with pytest.raises(ValueError, match="non-empty list"):
        model.bind_tools([])
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        model.invoke("Hi", tool_choice="any")
    json_object = StructuredOutputsParams(json_object=True)
    with pytest.raises(ValueError, match="cannot be used in one request"):
        model.bind(structured_outputs=json_object, tools=[add]).invoke("Hi")
