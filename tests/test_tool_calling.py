"""Tool calling shared by both adapters: tool and tool-choice checks, prompt rendering with and
without a tool-aware chat template, parsing whole and streamed output, and the constraint that
makes every call valid (real default model, greedy and sampled, on varied tool schemas)."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_backend import SamplingParams
from paged_backend.tool_calling import (
    ToolCallParser,
    check_tools,
    collect_calls,
    parse_tool_calls,
    pop_tool_request,
    render_tool_chat,
    tool_call_constraint,
    tool_choice_name,
)


def tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required or []}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER = tool(
    "get_weather",
    {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    ["city", "unit"],
)
ADD = tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
BOOK = tool(
    "book_flight",
    {
        "passengers": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
            },
        },
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "seat": {"enum": ["aisle", "window"]},
        "note": {"type": "string", "maxLength": 40},
    },
    ["passengers", "date"],
)
SEARCH = tool(
    "search",
    {
        "query": {"type": "string"},
        "filters": {
            "type": "object",
            "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
            "required": ["year"],
        },
        "limit": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    ["query", "filters"],
)
TOOLS = [WEATHER, ADD, BOOK, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, "}"]}}}\n</tool_call>'
OUTPUT = " \n Let me add.\n" + CALL + "\n" + CALL.replace("add", "sub") + "\nDone <tool \n"


# ---- checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ([], "non-empty list"),
        ("add", "non-empty list"),
        ([{"name": "add"}], "each tool must be"),
        ([{"type": "function", "function": {"name": ""}}], "each tool must be"),
    ],
)
def test_bad_tools_are_rejected(tools, match):
    with pytest.raises(ValueError, match=match):
        check_tools(tools)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("any", "required"),
        ("required", "required"),
        (True, "required"),
        ("none", "none"),
        ("add", "add"),
        ({"type": "function", "function": {"name": "add"}}, "add"),
    ],
)
def test_tool_choice_spellings(choice, expected):
    assert tool_choice_name(choice, [ADD, WEATHER]) == expected


def test_unknown_tool_choice_names_the_bound_tools():
    with pytest.raises(ValueError, match=r"tool_choice must be .*\(add, get_weather\), got 'mul'"):
        tool_choice_name("mul", [ADD, WEATHER])


def test_tool_requests_take_their_kwargs_out():
    kwargs = {"tools": [ADD], "tool_choice": "add", "temperature": 0}
    assert pop_tool_request(kwargs) == [ADD]
    assert set(kwargs) == {"temperature", "structured_outputs"}
    assert kwargs["structured_outputs"].structural_tag["format"]["at_least_one"]
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        pop_tool_request({"tool_choice": "any"})
    with pytest.raises(ValueError, match="cannot be used in one request"):
        pop_tool_request({"tools": [ADD], "structured_outputs": object()})
    assert pop_tool_request({"tools": [ADD], "tool_choice": "none"}) == [ADD]


# ---- prompts -----------------------------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'}],
    },
    {"role": "tool", "content": "5", "tool_call_id": "c1"},
]


def test_templates_without_tool_support_get_the_documented_format():
    seen = {}

    def apply(messages, **kwargs):
        seen.update(messages=messages, kwargs=kwargs)
        return "prompt"

    assert render_tool_chat(apply, "{{ messages }}", HISTORY, [ADD]) == "prompt"
    system, _, assistant, result = seen["messages"]
    assert system["content"].startswith("Be brief.\n\n") and json.dumps(ADD) in system["content"]
    assert "<tool_call>" in system["content"] and not seen["kwargs"]
    assert parse_tool_calls(assistant["content"]).tool_calls[0].arguments == {"a": 2, "b": 3}
    assert result == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    render_tool_chat(apply, None, HISTORY[1:2], [ADD])  # no system message: one is added
    assert [m["role"] for m in seen["messages"]] == ["system", "user"]


def test_tool_aware_templates_get_tools_and_calls_as_they_expect():
    seen = {}

    def apply(messages, **kwargs):
        seen.update(messages=messages, kwargs=kwargs)
        return "prompt"

    render_tool_chat(apply, "... <tool_call> ...", HISTORY, [ADD])
    assert seen["kwargs"] == {"tools": [ADD]}
    call = seen["messages"][2]["tool_calls"][0]
    assert call == {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
    }
    assert seen["messages"][3]["role"] == "tool"


# ---- parsing -----------------------------------------------------------------------------------
def test_whole_output_parses_into_content_and_calls():
    parsed = parse_tool_calls(OUTPUT)
    assert parsed.content == "Let me add.\n\n\nDone <tool"
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("add", {"a": 1, "b": {"c": [2, "}"]}}),
        ("sub", {"a": 1, "b": {"c": [2, "}"]}}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_calls_in_other_key_orders_and_cut_off_calls():
    parsed = parse_tool_calls('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", {"x": 1})]
    cut = parse_tool_calls('ok <tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert cut.content == "ok" and not cut.tool_calls
    ((_, name, raw, error),) = cut.invalid_tool_calls
    assert (name, raw) == ("add", '{"a": 1') and "does not parse" in error
    garbage = parse_tool_calls("<tool_call>not json</tool_call>")
    assert garbage.invalid_tool_calls[0][1] is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(OUTPUT)), max_size=12))
def test_streamed_output_parses_the_same_however_it_is_split(cuts):
    bounds = [0, *sorted(cuts), len(OUTPUT)]
    parser = ToolCallParser()
    content, deltas = "", []
    for start, end in itertools.pairwise(bounds):
        text, new = parser.feed(OUTPUT[start:end])
        assert len({d.index for d in new}) == len(new)  # one delta a call a feed
        content, deltas = content + text, deltas + new
    tail, more = parser.feed("", last=True)
    streamed = collect_calls(content + tail, deltas + more)
    whole = parse_tool_calls(OUTPUT)
    assert content + tail == streamed.content == whole.content  # stripped as it streams
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    # Every call's first delta names it, and content never shows a call's text.
    assert all(d.name for d in deltas if d.id) and "tool_call" not in content


# ---- the constraint, on the real model ---------------------------------------------------------
REQUESTS = [
    ("What is the weather in Paris, in celsius?", "required"),
    ("Add 12 and 30.", "required"),
    ("Book a flight for Anna, 34, and Ben, 5, on 2025-07-14, window seat.", "book_flight"),
    ("Find papers about graph neural networks from 2021, at most 5.", "search"),
    ("Search for the weather of Rome.", "required"),
    ("I need two seats to Oslo on 2024-12-01.", "book_flight"),
]


@pytest.fixture(scope="module")
def tool_prompts(llm_fp32):
    tokenizer = llm_fp32.engine.tokenizer

    def apply(messages, **kwargs):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )

    return [
        render_tool_chat(apply, tokenizer.chat_template, [{"role": "user", "content": q}], TOOLS)
        for q, _ in REQUESTS
    ]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_required_and_named_calls_always_parse_and_validate(llm_fp32, tool_prompts, sampling):
    params = [
        SamplingParams(
            max_tokens=160,
            structured_outputs=tool_call_constraint(TOOLS, choice, False),
            **sampling,
        )
        for _, choice in REQUESTS
    ]
    outputs = llm_fp32.generate(tool_prompts, params, use_tqdm=False)
    for (_, choice), out in zip(REQUESTS, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        parsed = parse_tool_calls(completion.text)
        assert parsed.content == "" and not parsed.invalid_tool_calls, completion.text
        (call,) = parsed.tool_calls
        assert choice == "required" or call.name == choice
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


@pytest.mark.slow
def test_parallel_calls_are_calls_only_each_valid(llm_fp32, tool_prompts):
    """The model may write several calls, one per line; it may also repeat them until
    `max_tokens`, so only the last one can be cut off."""
    params = SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=tool_call_constraint(TOOLS, "add", True)
    )
    for out in llm_fp32.generate(tool_prompts[:2], params, use_tqdm=False):
        completion = out.outputs[0]
        parsed = parse_tool_calls(completion.text)
        assert parsed.content == "" and parsed.tool_calls, completion.text
        assert len(parsed.invalid_tool_calls) == (completion.finish_reason == "length")
        for call in parsed.tool_calls:
            assert call.name == "add"
            jsonschema.validate(call.arguments, SCHEMAS["add"])


@pytest.mark.parametrize(
    ("choice", "text", "accepted"),
    [
        ("auto", "Paris is sunny.", True),
        ("auto", "Sure. " + CALL.replace('{"c": [2, "}"]}', "2"), True),
        ("auto", '<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}', False),
        ("auto", '<tool_call>\n{"name": "mul", "arguments": {', False),
        ("auto", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', False),
        ("required", "Paris", False),
        ("add", '<tool_call>\n{"name": "get_weather", "arguments": {', False),
        ("add", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', True),
    ],
)
def test_the_constraint_admits_valid_calls_only(llm_fp32, choice, text, accepted):
    """What the grammar allows once text is written: in "auto" free text, but a started call
    must be a valid call of a bound tool; with a required or named choice, calls only."""
    params = tool_call_constraint([ADD, WEATHER], choice, False)
    matcher = llm_fp32.engine.grammars.matcher(params, [])
    assert matcher.accept_string(text) is accepted
