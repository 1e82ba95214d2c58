"""`ChatPaged.with_structured_output` on the default model: the engine's constrained decoding
makes every answer parse (pydantic class, TypedDict, JSON-schema dict; json_schema,
function_calling and json_mode), through invoke, batch and ainvoke, with or without the raw
message, even when the model loops until max_tokens."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from conftest import FP32_ENGINE_ARGS
from langchain_core.messages import AIMessage
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from langchain_paged import ChatPaged

pytestmark = pytest.mark.slow
PROMPTS = [
    "Describe a person called Ada who is 36 and likes maths.",
    "Make up a pirate character.",
    "Tell me about your favourite football player.",
    "Who is Alan Turing?",
]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    tags: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", autouse=True)
def engine(shared_fp32_engine):
    return shared_fp32_engine


def chat(**kwargs) -> ChatPaged:
    return ChatPaged(**{**FP32_ENGINE_ARGS, "temperature": 0, "max_tokens": 96, **kwargs})


def test_pydantic_schema_always_parses():
    structured = chat().with_structured_output(Person)
    for prompt in PROMPTS:
        assert isinstance(structured.invoke(prompt), Person)
    batched = structured.batch(PROMPTS)
    assert len(batched) == len(PROMPTS) and all(isinstance(p, Person) for p in batched)
    person = asyncio.run(structured.ainvoke(PROMPTS[0]))
    assert isinstance(person, Person) and 0 <= person.age <= 120 and len(person.tags) <= 3


def test_dict_schema_returns_a_valid_dict():
    out = chat().with_structured_output(PERSON_SCHEMA).invoke("Tell me about Paris.")
    assert isinstance(out, dict) and set(out) == {"city", "population", "capital"}
    assert isinstance(out["city"], str) and len(out["city"]) <= 24
    assert isinstance(out["population"], int) and out["population"] >= 0
    assert isinstance(out["capital"], bool)


def test_json_mode_returns_a_dict():
    out = (
        chat()
        .with_structured_output(None, method="json_mode")
        .invoke("Return a JSON object describing a cat.")
    )
    assert isinstance(out, dict)


def test_include_raw():
    structured = chat().with_structured_output(Person, include_raw=True)
    out = structured.invoke(PROMPTS[1])
    assert set(out) == {"raw", "parsed", "parsing_error"}
    assert isinstance(out["raw"], AIMessage) and out["raw"].content
    assert isinstance(out["parsed"], Person) and out["parsing_error"] is None
    assert Person.model_validate_json(out["raw"].content) == out["parsed"]


class Joke(TypedDict):
    """A joke."""

    setup: str
    punchline: str


@pytest.mark.parametrize(
    ("method", "budgets"),
    [("json_schema", (24, 40, 64)), ("json_mode", (24, 40)), ("function_calling", (48, 64))],
)
def test_every_method_parses_even_when_the_model_loops(method, budgets):
    """Greedy SmolLM2 repeats itself inside the joke's setup; near max_tokens the engine
    steers the JSON to a close, so both keys are there even on short budgets (a tool call
    spends about 20 tokens on its tags and name)."""
    for max_tokens in budgets:
        structured = chat(max_tokens=max_tokens).with_structured_output(Joke, method=method)
        joke = structured.invoke("Tell me a long joke about cats.")
        assert set(joke) == {"setup", "punchline"}, (max_tokens, joke)
        assert all(isinstance(v, str) for v in joke.values())


def test_function_calling_returns_the_tools_arguments():
    structured = chat().with_structured_output(Person, method="function_calling")
    people = structured.batch(PROMPTS[:2])
    assert all(isinstance(p, Person) for p in people)
    out = (
        chat()
        .with_structured_output(
            {"title": "City", **PERSON_SCHEMA}, method="function_calling", include_raw=True
        )
        .invoke("Tell me about Paris.")
    )
    assert out["parsing_error"] is None and set(out["parsed"]) == set(PERSON_SCHEMA["properties"])
    (call,) = out["raw"].tool_calls
    assert call["name"] == "City" and call["args"] == out["parsed"]


def test_json_mode_with_a_schema_follows_it():
    person = chat().with_structured_output(Person, method="json_mode").invoke(PROMPTS[0])
    assert isinstance(person, Person)


def test_unsupported_methods_and_arguments():
    model = chat()
    with pytest.raises(ValueError, match=r"json_schema.*function_calling.*json_mode"):
        model.with_structured_output(Person, method="xml")
    with pytest.raises(ValueError, match="json_schema"):
        model.with_structured_output(None)
    with pytest.raises(ValueError, match="function_calling' needs a schema"):
        model.with_structured_output(None, method="function_calling")
    with pytest.raises(ValueError, match="unsupported"):
        model.with_structured_output(Person, tools=[])
