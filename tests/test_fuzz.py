"""Hostile input, generated: random SamplingParams values of every type, odd prompts and
malformed chat messages through `LLM.generate`, `AsyncEngine`, `ChatPaged.invoke` and LlamaIndex
`PagedLLM.chat` (1,200 examples in all). Each either works or raises ValueError/TypeError naming
what was wrong, before anything is queued; the engine then still serves a normal request with
the same output as before."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_backend import LLM, AsyncEngine, SamplingParams

FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
FIELDS.remove("structured_outputs")  # its own fuzzing lives with the grammar tests
CANARY = "The canary sings"
CANARY_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

weird_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3, 3),
    st.text(max_size=8),
    st.lists(st.one_of(st.text(max_size=4), st.integers(-5, 60000)), max_size=3),
    st.dictionaries(st.integers(-5, 60000), st.floats(allow_nan=True), max_size=2),
)
# Plausible values too, so that many examples get past validation and run.
plausible = st.one_of(
    st.integers(0, 8),
    st.floats(0, 1),
    st.lists(st.text(min_size=1, max_size=3), max_size=2),
    st.text(min_size=1, max_size=6),
)
sampling_kwargs = st.dictionaries(
    st.sampled_from(FIELDS), st.one_of(weird_values, plausible), max_size=4
)
prompts = st.one_of(
    st.text(max_size=40),
    st.text(
        alphabet=st.characters(codec="utf-8", categories=["Cc", "Cs", "Co", "Zs"]), max_size=12
    ),
    st.sampled_from(["\ud800", "a\udfffb", "x" * 100_000, "", " "]),
    st.binary(max_size=4),  # never read as token ids
    st.lists(st.integers(-3, 49160), max_size=6),
    st.lists(st.one_of(st.integers(0, 100), st.floats(), st.text(max_size=2)), max_size=3),
    st.none(),
    st.integers(),
)


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )


def _named(exc: Exception, names: list[str]) -> bool:
    """The message names one of the parameters the example set (or the prompt)."""
    return any(name in str(exc) for name in [*names, "prompt"])


def _bounded(kwargs: dict) -> dict:
    """Keep valid examples quick: at most 8 new tokens each."""
    max_tokens = kwargs.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 8:
        kwargs["max_tokens"] = 8
    return kwargs


@pytest.fixture(scope="module")
def llm(tiny_model, one_thread):
    return LLM(
        model=str(tiny_model), dtype="float32", max_model_len=64, max_num_seqs=4, num_kv_blocks=96
    )


@pytest.fixture(scope="module")
def canary(llm) -> list[int]:
    return llm.generate(CANARY, CANARY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def _assert_idle_and_serving(llm, canary) -> None:
    stats = llm.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert llm.generate(CANARY, CANARY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids == canary


@fuzz(600)
@given(kwargs=sampling_kwargs, prompt=prompts)
def test_llm_generate_takes_anything(llm, canary, kwargs, prompt):
    try:
        params = SamplingParams(**_bounded(dict(kwargs)))
    except (ValueError, TypeError) as exc:
        assert _named(exc, list(kwargs)), exc
        return
    try:
        outs = llm.generate(prompt, params, use_tqdm=False)
    except (ValueError, TypeError) as exc:
        assert _named(exc, list(kwargs)), exc
    else:
        assert all(len(c.token_ids) <= (params.max_tokens or 64) for o in outs for c in o.outputs)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not stats["num_waiting"]


def test_engine_serves_the_same_after_the_fuzzing(llm, canary):
    _assert_idle_and_serving(llm, canary)


@fuzz(200)
@given(kwargs=sampling_kwargs, prompt=prompts)
def test_async_engine_takes_anything(tiny_model, kwargs, prompt):
    engine = _async_engine(tiny_model)
    try:
        params = SamplingParams(**_bounded(dict(kwargs)))
        outs = list(engine.generate_stream(prompt, params))
    except (ValueError, TypeError) as exc:
        assert _named(exc, list(kwargs)), exc
    else:
        assert outs[-1].finished
    assert engine.stats()["num_waiting"] == 0


_ENGINES: dict = {}


def _async_engine(tiny_model) -> AsyncEngine:
    if "engine" not in _ENGINES:
        _ENGINES["engine"] = AsyncEngine.from_model(
            str(tiny_model), dtype="float32", max_model_len=64, max_num_seqs=4, num_kv_blocks=96
        )
    return _ENGINES["engine"]


def test_async_engine_serves_after_the_fuzzing(tiny_model, canary):
    engine = _async_engine(tiny_model)
    out = list(engine.generate_stream(CANARY, CANARY_PARAMS))[-1]
    assert out.outputs[0].token_ids == canary
    assert math.isclose(engine.stats()["kv_blocks_free"], engine.stats()["kv_blocks_total"])
    engine.shutdown()


roles = st.sampled_from(["user", "human", "assistant", "ai", "system", "tool", "bogus", ""])
messages = st.one_of(
    st.text(max_size=20),
    st.lists(
        st.tuples(roles, st.one_of(st.text(max_size=12), st.integers(), st.none())), max_size=3
    ),
    st.lists(
        st.dictionaries(
            st.sampled_from(["role", "content", "name", "x"]), weird_values, max_size=3
        ),
        max_size=2,
    ),
    st.none(),
    st.integers(),
)
tools = st.lists(
    st.one_of(
        st.dictionaries(st.sampled_from(["type", "function", "name", "parameters"]), weird_values),
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {
                        "name": st.text(max_size=6),
                        "parameters": st.one_of(
                            weird_values,
                            st.just({"type": "object", "properties": {"x": {"type": "integer"}}}),
                        ),
                    }
                ),
            }
        ),
        st.integers(),
    ),
    max_size=2,
)
ADAPTER_ERRORS = (ValueError, TypeError)


def _adapter_error_named(exc: Exception, kwargs: dict) -> bool:
    """Our fields, or the framework's own input checks ("Invalid input type ...")."""
    return _named(exc, [*kwargs, "message", "tool", "role", "content", "input"])


@pytest.fixture(scope="module")
def chat(tiny_model, one_thread):
    from langchain_paged import ChatPaged

    return ChatPaged(
        model=str(tiny_model), dtype="float32", max_model_len=64, num_kv_blocks=96, max_tokens=4
    )


@fuzz(200)
@given(kwargs=sampling_kwargs, messages=messages, tool_specs=st.one_of(st.none(), tools))
def test_chat_paged_invoke_takes_anything(chat, kwargs, messages, tool_specs):
    try:
        model = chat if tool_specs is None else chat.bind_tools(tool_specs)
        model.invoke(messages, **_bounded(dict(kwargs)))
    except ADAPTER_ERRORS as exc:
        assert _adapter_error_named(exc, list(kwargs)), exc
    stats = chat.engine.stats()
    assert stats["num_waiting"] == 0


@fuzz(200)
@given(kwargs=sampling_kwargs, messages=messages)
def test_llama_index_chat_takes_anything(tiny_model, kwargs, messages):
    from llama_index.core.llms import ChatMessage

    from llama_index.llms.paged import PagedLLM

    llm = PagedLLM(
        model=str(tiny_model),
        engine_args={"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 96},
        max_tokens=4,
    )
    try:
        if isinstance(messages, list):
            messages = [
                ChatMessage(role=m[0], content=m[1]) if isinstance(m, tuple) else ChatMessage(**m)
                for m in messages
            ]
        llm.chat(messages, **_bounded(dict(kwargs)))
    except ADAPTER_ERRORS as exc:
        assert _adapter_error_named(exc, list(kwargs)), exc
    assert llm.engine.stats()["num_waiting"] == 0
