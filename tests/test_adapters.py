"""What both framework adapters take from `paged_backend.adapters`: their sampling fields are
derived from `SamplingParams`, not listed by hand, and every one of them reaches the request.
No engine starts here."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel

from langchain_paged import ChatPaged
from langchain_paged import PagedLLM as LangChainLLM
from llama_index.llms.paged import PagedLLM as LlamaIndexLLM
from paged_backend import SamplingParams
from paged_backend.adapters import build_sampling_params, sampling_fields
from paged_backend.structured_output import StructuredOutputsParams

# A valid value other than the default for each SamplingParams field: a field added to
# SamplingParams fails these tests (KeyError) until it is given one here.
NON_DEFAULT = {
    "n": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.1,
    "seed": 7,
    "max_tokens": 33,
    "min_tokens": 2,
    "stop": ["END"],
    "stop_token_ids": [5],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "logprobs": 3,
    "prompt_logprobs": 2,
    "skip_special_tokens": False,
    "logit_bias": {5: 1.0},
    "structured_outputs": StructuredOutputsParams(regex="[a-z]+"),
    "cache_salt": "tenant-a",
    "allowed_token_ids": [5, 6],
    "bad_words": ["never"],
    "truncate_prompt_tokens": 100,
}
CALL_ONLY = {"structured_outputs"}  # a schema belongs to a call, not to a model
ALL_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def assert_carried(params: SamplingParams, values: dict) -> None:
    for name, value in values.items():
        assert getattr(params, name) == value, name


def test_fields_are_derived_from_what_a_class_declares():
    class Partial(BaseModel):
        seed: int | None = None
        temperature: float | None = None
        unrelated: int = 0

    assert sampling_fields(Partial) == ("temperature", "seed")  # SamplingParams' order
    params = build_sampling_params(Partial(seed=3, unrelated=1), {"top_k": 4}, "x")
    assert (params.seed, params.top_k, params.temperature, params.stop) == (3, 4, 1.0, ["x"])


@pytest.mark.parametrize("cls", [ChatPaged, LangChainLLM])
def test_langchain_declares_every_sampling_field_and_each_reaches_the_request(cls):
    assert set(sampling_fields(cls)) == set(ALL_FIELDS) - CALL_ONLY
    values = {name: NON_DEFAULT[name] for name in sampling_fields(cls)}
    assert_carried(cls(**values)._sampling_params(None, {}), values)
    call_only = {name: NON_DEFAULT[name] for name in CALL_ONLY}
    assert_carried(cls()._sampling_params(None, dict(call_only)), call_only)


def test_llama_index_fields_and_additional_kwargs_reach_the_request():
    declared = sampling_fields(LlamaIndexLLM)
    assert set(declared) < set(ALL_FIELDS)
    values = {name: NON_DEFAULT[name] for name in declared}
    assert_carried(LlamaIndexLLM(**values)._sampling_params({}), values)
    # Every other field goes through `additional_kwargs` (n must stay 1: one text per reply).
    extra = {name: NON_DEFAULT[name] for name in ALL_FIELDS if name not in {*declared, "n"}}
    assert_carried(LlamaIndexLLM(additional_kwargs=extra)._sampling_params({}), extra)


SPEC = {"method": "ngram", "num_speculative_tokens": 3}
ADAPTERS = {
    "ChatPaged": ChatPaged,
    "langchain PagedLLM": LangChainLLM,
    "llama_index PagedLLM": LlamaIndexLLM,
}


@pytest.mark.parametrize("cls", ADAPTERS.values(), ids=ADAPTERS)
def test_speculative_config_is_an_engine_argument_of_every_adapter(cls):
    """As a keyword of its own or in `engine_args`; a malformed one fails when the adapter is
    built, as an unknown engine argument does, not at its first call."""
    assert cls(speculative_config=SPEC).engine_args == {"speculative_config": SPEC}
    assert cls(engine_args={"speculative_config": SPEC}).engine_args == {"speculative_config": SPEC}
    with pytest.raises(ValueError, match=r"speculative_config\['method'\] must be 'ngram'"):
        cls(engine_args={"speculative_config": {**SPEC, "method": "eagle"}})
    with pytest.raises(ValueError, match="must be None or a dict, got str"):
        cls(engine_args={"speculative_config": "ngram:3"})
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['speculative'\]"):
        cls(engine_args={"speculative": SPEC})
