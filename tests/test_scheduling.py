"""Prefix caching, chunked prefill, preemption and priority on real and tiny models."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams

SYSTEM = (
    "You are a careful assistant for a library. Answer using only the context below. "
    "Context: The Grand Library holds 120,000 books across four floors. The ground floor has "
    "newspapers and magazines, the first floor has fiction, the second floor has science and "
    "history, and the third floor has rare manuscripts that can only be read in the reading "
    "room. Opening hours are nine to five on weekdays and ten to two on Saturdays. "
) * 3
QUESTIONS = [
    "Where are the novels?",
    "When does it open on Saturday?",
    "How many books?",
    "Can I borrow a manuscript?",
    "Which floor has history?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)


def test_prefix_cache_hits_every_full_shared_block(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    prompts = [SYSTEM + q for q in QUESTIONS]
    shared = 0  # tokens common to every prompt
    ids = [tok(p).input_ids for p in prompts]
    while all(i[shared] == ids[0][shared] for i in ids):
        shared += 1
    bs = llm_fp32.engine.config.block_size
    full_shared = shared // bs * bs
    first = llm_fp32.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm_fp32.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens <= full_shared  # may hit earlier tests' blocks
    for out in rest:
        assert out.num_cached_tokens >= full_shared
        assert out.num_cached_tokens % bs == 0
        assert out.num_cached_tokens < len(out.prompt_token_ids)
    no_cache = LLM(dtype="float32", enable_prefix_caching=False, num_kv_blocks=512)
    plain = no_cache.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in plain]
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert no_cache.stats()["prefix_cache_hits"] == 0


def test_requests_arriving_together_share_prefix(tiny_llm, tiny_model):
    """Submitted in one batch, the later requests reuse blocks the first computes in-step."""
    tok = tiny_llm.get_tokenizer()
    prompts = [SYSTEM + q for q in QUESTIONS]
    before = tiny_llm.stats()["prefix_cache_hits"]
    fresh = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)
    outs = fresh.generate(prompts, GREEDY, use_tqdm=False)
    shared = len(tok(SYSTEM).input_ids) - 1
    bs = fresh.engine.config.block_size
    assert all(o.num_cached_tokens >= shared // bs * bs - bs for o in outs[1:])
    assert fresh.stats()["kv_blocks_free"] == fresh.stats()["kv_blocks_total"]
    assert tiny_llm.stats()["prefix_cache_hits"] == before


def test_chunked_prefill_matches_whole_prefill(tiny_model):
    prompts = [SYSTEM + q for q in QUESTIONS]
    whole = LLM(model=str(tiny_model), dtype="float32", enable_prefix_caching=False)
    chunked = LLM(
        model=str(tiny_model),
        dtype="float32",
        enable_prefix_caching=False,
        max_num_batched_tokens=48,
    )
    a = whole.generate(prompts, GREEDY, use_tqdm=False)
    b = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_gives_unconstrained_output(tiny_model, policy):
    prompts = [SYSTEM[: 80 + 40 * i] + q for i, q in enumerate(QUESTIONS)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=512)
    tight = LLM(
        model=str(tiny_model),
        dtype="float32",
        block_size=16,
        num_kv_blocks=14,
        scheduling_policy=policy,
    )
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(b.ref_cnt == 0 for b in tight.engine.kv.pool.blocks)


def test_priority_orders_the_queue_and_preempts(tiny_model):
    llm = LLM(
        model=str(tiny_model),
        dtype="float32",
        block_size=16,
        num_kv_blocks=12,
        scheduling_policy="priority",
        max_num_seqs=8,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    low = engine.add_request(SYSTEM[:200], params, priority=5)
    for _ in range(3):
        engine.step()
    assert engine.scheduler.running and engine.scheduler.running[0].request_id == low
    urgent = engine.add_request(SYSTEM[200:400], params, priority=-1)
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == [urgent, low]
    assert engine.scheduler.num_preemptions >= 1
    assert engine.kv.pool.num_free == engine.kv.num_blocks
