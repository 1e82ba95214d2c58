"""The budget guard: a constrained output is complete within any `max_tokens` that is at least
its shortest complete output, and a smaller `max_tokens` is refused before any work."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_structural_tags import _tag

from paged_backend import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.builds(
        lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra},
        st.integers(0, 5),
        st.integers(0, 8),
    ),
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-300, 300),
        st.integers(0, 5000),
    ),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.builds(
        lambda low, span: {"type": "number", "minimum": low, "maximum": low + span},
        st.floats(-100, 100).map(lambda x: round(x, 2)),
        st.floats(0, 1000).map(lambda x: round(x, 1)),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text("abxyzé -", min_size=1, max_size=9), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _array(items: dict, low: int, extra: int | None) -> dict:
    schema = {"type": "array", "items": items, "minItems": low}
    if extra is not None:
        schema["maxItems"] = low + extra
    return schema


def _object(draw_required, properties: dict) -> dict:
    required = draw_required(st.lists(st.sampled_from(sorted(properties)), unique=True))
    return {"type": "object", "properties": properties, "required": required}


@st.composite
def objects(draw, values):
    properties = draw(
        st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), values, max_size=4)
    )
    return _object(draw, properties) if properties else {"type": "object"}


SCHEMAS = st.recursive(
    LEAVES,
    lambda values: st.one_of(
        st.builds(_array, values, st.integers(0, 3), st.none() | st.integers(0, 3)),
        objects(values),
        st.lists(values, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def llm(tiny_model, one_thread):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256, max_num_seqs=16)


def _shortest(llm: LLM, spec: StructuredOutputsParams) -> int:
    shortest = llm.engine.grammars.shortest_output(spec)
    assert shortest is not None
    return shortest[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schema=SCHEMAS,
    compact=st.booleans(),
    extras=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    seed=st.integers(0, 2**31),
)
def test_every_budget_from_the_shortest_output_up_parses_and_validates(
    llm, schema, compact, extras, seed
):
    """Random schemas (nested objects with optional fields, arrays of every item type, enums,
    bounded numbers and strings, alternatives, top-level arrays and scalars), the random
    logits of a random-weight model (greedy and sampled), and
    budgets from the schema's shortest complete output up: every output parses and
    validates, within its budget."""
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    need = _shortest(llm, spec)
    params = [
        SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=need + extra,
            structured_outputs=spec,
        )
        for extra in extras
        for temperature in (0.0, 1.5)
    ]
    outputs = llm.generate(["Some JSON:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outputs, params, strict=True):
        completion = out.outputs[0]
        assert len(completion.token_ids) <= p.max_tokens
        jsonschema.validate(json.loads(completion.text), schema)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 5},
        {
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
            "required": ["a"],
        },
    ],
)
def test_a_budget_below_the_shortest_output_is_refused(llm, schema):
    spec = StructuredOutputsParams(json=schema)
    need = _shortest(llm, spec)
    with pytest.raises(ValueError, match=rf"max_tokens must be at least {need} .*got {need - 1}"):
        llm.generate("Some JSON:", SamplingParams(max_tokens=need - 1, structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Some JSON:", SamplingParams(max_tokens=need, structured_outputs=spec))
    jsonschema.validate(json.loads(out[0].outputs[0].text), schema)


@pytest.mark.parametrize(
    ("prefix", "ends"),
    [
        ("[1.1111111", "[1.1111111,0,0]"),  # inside a number: end it, then what is left
        ("[\n \n    -1", "[\n \n    -1,0,0]"),
        ('[0,0,"', None),  # not a number: the grammar refuses it
    ],
)
def test_the_shortest_completion_ends_a_number_then_closes(llm, prefix, ends):
    """The issue's two runaway outputs: from inside their number the completion ends it and
    adds the items `minItems` still asks for."""
    from paged_backend.completion import CompletionFinder

    spec = StructuredOutputsParams(
        json={"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 5}
    )
    grammars = llm.engine.grammars
    matcher = grammars.matcher(spec, [])
    if ends is None:
        assert not matcher.accept_string(prefix)
        return
    assert matcher.accept_string(prefix)
    finder: CompletionFinder = grammars._finder
    assert prefix + finder.find(matcher, thorough=True).decode() == ends


def test_content_gets_every_token_the_completion_does_not_need(llm):
    """The guard takes over only when the completion needs every token left: a string
    that would go on for ever keeps all the others."""
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    need = _shortest(llm, spec)  # {"story":""}
    story = llm.get_tokenizer().convert_tokens_to_ids("a")
    params = SamplingParams(
        temperature=0, max_tokens=need + 20, logit_bias={story: 100}, structured_outputs=spec
    )
    completion = llm.generate("A story:", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == need + 20
    # The scaffolding and the closing quote and brace take as many tokens as the shortest
    # output: the 20 tokens beyond it are all content.
    assert json.loads(completion.text)["story"] == "a" * 20


CALL = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TAGGED_CALL = {
    "type": "tag",
    "begin": "<f>",
    "content": {"type": "json_schema", "json_schema": CALL},
}


@pytest.mark.parametrize(
    "spec",
    [
        _tag({"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"}),
        _tag(
            {
                "type": "triggered_tags",
                "triggers": ["<f>"],
                "tags": [TAGGED_CALL | {"end": "</f>"}],
                "at_least_one": True,
            }
        ),
        StructuredOutputsParams(grammar='root ::= "Note: " [^!]* "!!"'),
    ],
    ids=["tag-of-any-text", "at-least-one-call", "grammar"],
)
def test_free_text_that_only_a_literal_ends_is_complete_within_the_budget(llm, spec):
    """Free text whose way out is a literal string (a tag's end, a trigger, a grammar's quoted
    string), which no single byte shows: the shortest output is found (the search gave up on
    these, after ~17 s for the tags), and outputs at budgets from it up end complete."""
    need = _shortest(llm, spec)
    params = [
        SamplingParams(
            temperature=temperature, seed=7, max_tokens=need + extra, structured_outputs=spec
        )
        for extra in (0, 2, 9)
        for temperature in (0.0, 1.5)
    ]
    outputs = llm.generate(["Text:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outputs, params, strict=True):
        completion = out.outputs[0]
        assert len(completion.token_ids) <= p.max_tokens
        matcher = llm.engine.grammars.matcher(spec, [])
        assert matcher.accept_string(completion.text) and matcher.is_completed(), completion.text
    assert not llm.engine.has_unfinished_requests()
