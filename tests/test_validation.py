"""Bad input is rejected at the API boundary, before any work, and the engine keeps serving."""

from __future__ import annotations

import pytest
from conftest import transformers_log

from paged_backend import LLM, AsyncEngine, SamplingParams
from paged_backend import sampling_params as sp
from paged_backend.config import EngineConfig
from paged_backend.engine import PRIORITY_MAX, PRIORITY_MIN

GOOD = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), dtype="float32", max_model_len=128, num_kv_blocks=64)


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ("", ValueError, "prompt"),
        ([], ValueError, "prompt"),
        (3.5, TypeError, "prompt"),
        ({"text": "hi"}, ValueError, "a prompt dict takes the keys prompt, prompt_token_ids"),
        ({}, ValueError, "a prompt dict needs 'prompt' .text. or 'prompt_token_ids'"),
        ({"prompt": 5}, TypeError, "a prompt dict's 'prompt' must be a str, got int"),
        ({"prompt_token_ids": "hi"}, TypeError, "'prompt_token_ids' must be a list of int"),
        ({"prompt_token_ids": [1, 10**9]}, ValueError, r"prompt token ids must be in \[0, 49152\)"),
        ({"prompt": "hi", "multi_modal_data": {"image": 0}}, ValueError, "text-only models"),
        ({"prompt": "hi", "cache_salt": ""}, ValueError, "cache_salt must be None or a string"),
        (b"hi", TypeError, "prompt must be a str, a list of int token ids or a prompt dict, got b"),
        (bytearray(b"hi"), TypeError, "prompt must be a str"),
        ([1, "a", 3], TypeError, "prompt"),
        ([1, 2, 10**9], ValueError, r"prompt token ids must be in \[0, 49152\)"),
        ("word " * 200, ValueError, "max_model_len"),
    ],
)
def test_bad_prompt_rejected_before_work(llm, prompt, error, match):
    before = llm.stats()
    with pytest.raises(error, match=match):
        llm.generate(["A fine prompt", prompt], GOOD, use_tqdm=False)
    after = llm.stats()
    assert after["num_generated_tokens"] == before["num_generated_tokens"]  # nothing ran
    assert after["num_waiting"] == after["num_running"] == 0  # nothing queued
    assert llm.generate(["Still serving"], GOOD, use_tqdm=False)[0].outputs[0].token_ids


def test_vllm_prompt_dicts_are_taken_at_every_entry(llm):
    """vLLM's TextPrompt and TokensPrompt dicts give what their text and token ids give, in
    `LLM.generate`, `add_request` and the async engine; a TokensPrompt's "prompt" is reported,
    not tokenized, and a dict's cache_salt keeps its prefix cache apart."""
    prompt = "The archive of Lindenfeld holds the council records. " * 3
    ids = llm.engine.tokenize(prompt)
    plain = llm.generate(prompt, GOOD, use_tqdm=False)[0]
    outs = llm.generate(
        [{"prompt": prompt}, {"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": "x"}],
        GOOD,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [plain.outputs[0].token_ids] * 3
    assert [o.prompt for o in outs] == [prompt, None, "x"]
    assert all(o.prompt_token_ids == ids and o.num_cached_tokens > 0 for o in outs)
    salted = [llm.generate({"prompt": prompt, "cache_salt": "a"}, GOOD, use_tqdm=False)[0]]
    salted += llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, cache_salt="a"))
    assert [o.num_cached_tokens > 0 for o in salted] == [False, True]  # hits its own salt's
    with pytest.raises(ValueError, match=r"cache_salt 'a' differs from sampling_params"):
        llm.generate({"prompt": prompt, "cache_salt": "a"}, SamplingParams(cache_salt="b"))
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": ids, "prompt": "y"}, GOOD)
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.request_id == request_id and o.finished]
    assert done[0].prompt == "y" and done[0].outputs[0].token_ids == plain.outputs[0].token_ids
    async_engine = AsyncEngine(engine)  # borrows the idle engine; shut down below
    try:
        last = list(async_engine.generate_stream({"prompt": prompt, "cache_salt": "b"}, GOOD))[-1]
    finally:
        async_engine.shutdown()
    assert last.prompt == prompt and last.num_cached_tokens == 0
    assert last.outputs[0].token_ids == plain.outputs[0].token_ids


def test_chat_content_parts_are_their_text(llm):
    """OpenAI-style content parts (vLLM's chat format) render as their text parts joined by
    newlines; a part that is not text is refused, naming its message, before any work."""
    engine = llm.engine
    parts = [{"type": "text", "text": "Name a fruit."}, "One word."]
    as_parts = engine.apply_chat_template([{"role": "user", "content": parts}])
    as_text = engine.apply_chat_template([{"role": "user", "content": "Name a fruit.\nOne word."}])
    assert as_parts == as_text
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [image]}]
    with pytest.raises(ValueError, match=r"messages\[1\] has a content part of type 'image_url'"):
        llm.chat(chat, GOOD, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_a_prompt_past_the_tokenizers_limit_gets_only_our_error(tiny_model, caplog):
    """transformers warns of "indexing errors" when a prompt is longer than the tokenizer's
    model_max_length (8192 here); the engine's limit is max_model_len, and it says so itself."""
    fresh = LLM(model=str(tiny_model), dtype="float32", max_model_len=128, num_kv_blocks=64)
    with transformers_log(caplog):
        long = "word " * 9000
        assert len(fresh.engine.tokenize(long)) > fresh.engine.tokenizer.model_max_length
        with pytest.raises(ValueError, match=r"must be shorter than max_model_len \(128\)"):
            fresh.generate([long], GOOD, use_tqdm=False)
    assert not [r for r in caplog.records if "indexing errors" in r.getMessage()], caplog.text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_that_can_never_fit(llm, tiny_model):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hello"], SamplingParams(max_tokens=500), use_tqdm=False)
    small = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate(["hello"], SamplingParams(max_tokens=100), use_tqdm=False)
    assert small.generate(["hello"], GOOD, use_tqdm=False)[0].outputs[0].finish_reason


def test_unknown_model_path_and_bad_engine_args(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))
    for kwargs, field in [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2.5}, "block_size"),
        ({"block_size": 24, "attention_backend": "triton"}, "block_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"pack_weights": "yes"}, "pack_weights"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)


def test_duplicate_request_id_and_mismatched_lists(llm):
    engine = llm.engine
    engine.add_request("a prompt", GOOD, request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a prompt", GOOD, request_id="dup")
    engine.abort_request("dup")
    engine.step()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GOOD], use_tqdm=False)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_failing_step_fails_only_its_requests(llm, monkeypatch):
    engine = llm.engine
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(scheduled, tables, drafts):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("simulated out of memory")
        return real_execute(scheduled, tables, drafts)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        llm.generate(["first victim"], GOOD, use_tqdm=False)
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    out = llm.generate(["after the failure"], GOOD, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.error is None


@pytest.mark.parametrize(
    ("ids", "error"), [([1, -1, 2], ValueError), ([49152], ValueError), ([1, 2.0], TypeError)]
)
def test_token_ids_are_checked_at_every_entry(llm, ids, error):
    """`add_request(prompt_token_ids=...)` skips tokenizing, not validation: an out-of-range id
    would otherwise fail inside the embedding (a device-side assert on CUDA)."""
    engine = llm.engine
    with pytest.raises(error, match="prompt token ids"):
        engine.add_request(None, GOOD, prompt_token_ids=ids)
    assert not engine.has_unfinished_requests()


def test_n_is_bounded_by_the_batch(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"n must be <= max_num_seqs \(128\)"):
        engine.add_request("hi", SamplingParams(n=1_000_000, max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_bytes_are_not_token_ids(llm):
    """`b"hi"` is a Sequence of ints: it must not pass as the token ids [104, 105]."""
    engine = llm.engine
    with pytest.raises(TypeError, match="prompt"):
        engine.add_request(b"hi", GOOD)
    with pytest.raises(TypeError, match="prompt token ids"):
        engine.add_request(None, GOOD, prompt_token_ids=b"hi")
    assert not engine.has_unfinished_requests()


def _over(limit: int, item) -> list:
    return [item] * (limit + 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"stop": _over(sp.MAX_STOP_STRINGS, "x")},
            rf"stop must have at most {sp.MAX_STOP_STRINGS}",
        ),
        (
            {"stop": "x" * (sp.MAX_STOP_STRING_CHARS + 1)},
            rf"stop must be strings of 1 to {sp.MAX_STOP_STRING_CHARS}",
        ),
        ({"stop": ["ok", ""]}, "stop must be strings of 1 to"),
        (
            {"stop_token_ids": _over(sp.MAX_STOP_TOKEN_IDS, 7)},
            rf"stop_token_ids must have at most {sp.MAX_STOP_TOKEN_IDS}",
        ),
        (
            {"logit_bias": dict.fromkeys(range(sp.MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)},
            rf"logit_bias must have at most {sp.MAX_LOGIT_BIAS_ENTRIES}",
        ),
        ({"logit_bias": {5: 100.5}}, r"logit_bias must be values in \[-100, 100\]"),
        ({"logit_bias": {5: -101}}, r"logit_bias must be values in \[-100, 100\]"),
        (
            {"cache_salt": "s" * (sp.MAX_CACHE_SALT_CHARS + 1)},
            rf"cache_salt must be None or a string of 1 to {sp.MAX_CACHE_SALT_CHARS}",
        ),
    ],
    ids=[
        "stop-count",
        "stop-length",
        "stop-empty",
        "stop-ids",
        "bias-size",
        "bias-high",
        "bias-low",
        "salt",
    ],
)
def test_unbounded_params_are_bounded(kwargs, match):
    """One request with 10^4 stop strings would stall every tenant (stops are matched on the
    engine thread); the error names the field and its limit, in a short message."""
    with pytest.raises(ValueError, match=match) as info:
        SamplingParams(**kwargs)
    assert len(str(info.value)) < 300


def test_params_at_the_limits_are_taken(llm):
    limits = SamplingParams(
        temperature=0,
        max_tokens=4,
        stop=[
            f"{i:03d}" + "z" * (sp.MAX_STOP_STRING_CHARS - 3) for i in range(sp.MAX_STOP_STRINGS)
        ],
        stop_token_ids=list(range(40000, 40000 + sp.MAX_STOP_TOKEN_IDS)),
        logit_bias={
            t: -sp.LOGIT_BIAS_RANGE for t in range(30000, 30000 + sp.MAX_LOGIT_BIAS_ENTRIES)
        },
        cache_salt="s" * sp.MAX_CACHE_SALT_CHARS,
    )
    out = llm.generate(["hello there"], limits, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].token_ids
    assert not set(out.outputs[0].token_ids) & set(limits.logit_bias)  # the bias applied


@pytest.mark.parametrize(
    ("priority", "error", "match"),
    [
        (True, TypeError, "priority must be an int, got bool"),
        (1.0, TypeError, "priority must be an int, got float"),
        (PRIORITY_MAX + 1, ValueError, r"priority must be in \[-2\*\*63, 2\*\*63 - 1\]"),
        (PRIORITY_MIN - 1, ValueError, r"priority must be in \[-2\*\*63"),
    ],
)
def test_priority_is_checked_at_every_entry(llm, tiny_model, priority, error, match):
    engine = llm.engine
    with pytest.raises(error, match=match):
        engine.add_request("hi", GOOD, priority=priority)
    with pytest.raises(error, match=match):
        llm.generate(["a", "b"], GOOD, priority=[0, priority], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    async_engine = AsyncEngine(engine)  # borrows the idle engine; shut down below
    try:
        with pytest.raises(error, match=match):
            async_engine.generate_stream("hi", GOOD, priority=priority)
    finally:
        async_engine.shutdown()
    assert not engine.has_unfinished_requests()


def test_priority_extremes_are_taken(llm):
    engine = llm.engine
    for priority in (PRIORITY_MIN, PRIORITY_MAX):
        engine.add_request("hi", GOOD, request_id=f"p{priority}", priority=priority)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free == engine.kv.num_blocks
