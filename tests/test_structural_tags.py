"""Structural tags in xgrammar's format (and vLLM's older one) on llguidance, and the bounds that
JSON schemas get: what each form allows and refuses, on the real tokenizer."""

from __future__ import annotations

import json

import pytest

from paged_backend import StructuredOutputsParams
from paged_backend.json_bounds import MAX_FRACTION_DIGITS, bounded_schema
from paged_backend.structured_output import GrammarCache

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TAG = {
    "type": "tag",
    "begin": "<f>",
    "content": {"type": "json_schema", "json_schema": SCHEMA},
    "end": "</f>",
}


@pytest.fixture(scope="module")
def cache(default_model_path):
    from transformers import AutoTokenizer

    return GrammarCache(AutoTokenizer.from_pretrained(default_model_path), 49152, [2])


def _accepts(cache: GrammarCache, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` is a complete output of `spec`."""
    matcher = cache.matcher(spec, [])
    return matcher.accept_string(text) and matcher.is_completed()


def _tag(fmt: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


TRIGGERED = {"type": "triggered_tags", "triggers": ["<f>"], "tags": [TAG]}


@pytest.mark.parametrize(
    ("fmt", "text", "ok"),
    [
        (TRIGGERED, 'Hi <f>{"n": 1}</f> and more text', True),
        (TRIGGERED, "no call at all", True),
        (TRIGGERED, "a call <f>not json</f>", False),  # a trigger always starts a valid call
        (TRIGGERED, 'one <f>{"n": 1}</f> two <f>{"n": 2}</f>', True),
        (TRIGGERED | {"stop_after_first": True}, 'one <f>{"n": 1}</f>', True),
        (TRIGGERED | {"stop_after_first": True}, 'one <f>{"n": 1}</f> more', False),
        (TRIGGERED | {"at_least_one": True}, "no call at all", False),
        (
            {"type": "tags_with_separator", "tags": [TAG], "separator": "\n", "at_least_one": True},
            '<f>{"n": 1}</f>\n<f>{"n": 2}</f>',
            True,
        ),
        (
            {"type": "tags_with_separator", "tags": [TAG], "separator": "\n", "at_least_one": True},
            "",
            False,
        ),
        (
            {"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"},
            "<t>anything at all</t>",
            True,
        ),
        (
            {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "A:"},
                    {"type": "regex", "pattern": r"\d{2}"},
                ],
            },
            "A:42",
            True,
        ),
        (
            {
                "type": "or",
                "elements": [
                    {"type": "const_string", "value": "x"},
                    {"type": "const_string", "value": "y"},
                ],
            },
            "z",
            False,
        ),
    ],
)
def test_structural_tag_formats(cache, fmt, text, ok):
    assert _accepts(cache, _tag(fmt), text) == ok


def test_vllms_older_form_is_a_triggered_tag(cache):
    spec = StructuredOutputsParams(
        structural_tag={
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
            "triggers": ["<f>"],
        }
    )
    assert _accepts(cache, spec, 'text <f>{"n": 3}</f>')
    assert not _accepts(cache, spec, 'text <f>{"m": 3}</f>')


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ({"type": "nope"}, "unknown format type 'nope'"),
        ({"type": "triggered_tags", "triggers": ["<g>"], "tags": [TAG]}, "starts with no trigger"),
        (
            {"type": "tag", "begin": "<f>", "content": {"type": "const_string"}, "end": ""},
            "value must be a string",
        ),
        ({"type": "sequence", "elements": [{"type": "any_text"}, TAG]}, "any_text"),
    ],
)
def test_bad_structural_tags_say_what_is_wrong(cache, fmt, message):
    with pytest.raises(
        ValueError, match=rf"invalid structured_outputs\.structural_tag: .*{message}"
    ):
        cache.compile(_tag(fmt))


def test_open_values_are_bounded_and_listed_objects_closed(cache):
    open_object = StructuredOutputsParams(json={"type": "object"})
    assert _accepts(cache, open_object, '{"a": [1.5, {"b": null}], "c": "x"}')
    assert not _accepts(cache, open_object, '{"a": 1' + "1" * 15 + "}")  # 16 digits
    assert not _accepts(cache, open_object, '{"a": 0.' + "1" * (MAX_FRACTION_DIGITS + 1) + "}")
    listed = StructuredOutputsParams(json=SCHEMA)
    assert _accepts(cache, listed, '{"n": 1}')
    assert not _accepts(cache, listed, '{"n": 1, "extra": 2}')
    extra_allowed = StructuredOutputsParams(json=SCHEMA | {"additionalProperties": True})
    assert _accepts(cache, extra_allowed, '{"n": 1, "extra": 2}')


def test_a_schemas_own_bounds_stand(cache):
    big = StructuredOutputsParams(json={"type": "integer", "minimum": 10**17})
    assert _accepts(cache, big, str(10**17 + 7))
    tight = StructuredOutputsParams(json={"type": "number", "minimum": 0, "maximum": 1})
    assert _accepts(cache, tight, "0.25") and not _accepts(cache, tight, "2")
    pinned = StructuredOutputsParams(json={"type": "number", "minimum": 32.12, "maximum": 32.12})
    assert _accepts(cache, pinned, "32.12")  # no room for the fraction bound's multipleOf
    halves = StructuredOutputsParams(json={"type": "number", "multipleOf": 0.5})
    assert _accepts(cache, halves, "2.5") and not _accepts(cache, halves, "2.25")


def test_bounding_leaves_the_callers_schema_alone():
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    before = json.dumps(schema)
    bounded_schema(schema)
    assert json.dumps(schema) == before
