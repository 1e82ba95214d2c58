"""Bad input is rejected at the API boundary, before any work, and the engine keeps serving."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams
from paged_backend.config import EngineConfig

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
        ({"text": "hi"}, TypeError, "prompt"),
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

    def flaky(scheduled, tables):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("simulated out of memory")
        return real_execute(scheduled, tables)

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
