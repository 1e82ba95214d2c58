"""Prefix caching, chunked prefill, preemption and priority on real and tiny models."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams
from paged_backend.config import EngineConfig
from paged_backend.kv_cache_manager import KVCacheManager
from paged_backend.request import Request, RequestStatus
from paged_backend.scheduler import Scheduler, SchedulerOutput

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


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with a fake model: the scheduled tokens run, and each request whose tokens are
    all computed samples token 5, finishing at its max_tokens."""
    out = scheduler.schedule()
    scheduler.update(out)
    for req in list(out.num_scheduled):
        if req.num_computed_tokens == req.num_tokens:
            req.append_output(5)
            if len(req.output_token_ids) >= req.max_tokens:
                scheduler.finish(req, "length")
    return out


def test_prefix_stats_count_a_request_that_waits_for_blocks_once():
    """B shares A's first two blocks but waits for a free block until A finishes; it is looked
    up every step meanwhile, and counted once, when admitted."""
    kv = KVCacheManager(num_blocks=3, block_size=16, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs")
    a = Request("a", list(range(44)), SamplingParams(max_tokens=4))  # 48 tokens: all 3 blocks
    b = Request("b", list(range(32)) + [99] * 8, SamplingParams(max_tokens=1))
    scheduler.add(a)
    scheduler.add(b)
    waited = 0
    while b.status is RequestStatus.WAITING:
        run_step(scheduler)
        waited += 1
    assert waited >= 3  # looked up (and refused blocks) in several steps
    assert b.num_cached_tokens == 32
    assert (kv.prefix_queries, kv.prefix_hits) == (a.num_prompt_tokens + b.num_prompt_tokens, 32)


def test_prefix_stats_leave_out_re_prefills_after_preemption():
    """A preempted request's re-prefill hits its own blocks: vLLM leaves it out of the hit rate,
    so only each request's first admission counts."""
    kv = KVCacheManager(num_blocks=10, block_size=16, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, policy="fcfs")
    reqs = [Request(f"r{i}", [i] * (20 + 7 * i), SamplingParams(max_tokens=30)) for i in range(8)]
    for r in reqs:
        scheduler.add(r)
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert scheduler.num_preemptions > 0
    assert kv.prefix_queries == sum(r.num_prompt_tokens for r in reqs)
    assert kv.prefix_hits == sum(r.num_cached_tokens for r in reqs)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_short_request_behind_long_prompts_starts_in_the_next_step(policy):
    """Four 600-token prompts need 38 steps of 64 tokens; with the cap (16) at most three long
    prefills share a step and leave 16 tokens, so a short prompt queued behind all four starts
    at once and gets its first token while every long one is still prefilling."""
    kv = KVCacheManager(num_blocks=200, block_size=16, enable_caching=True)
    scheduler = Scheduler(kv, 8, 64, policy, long_prefill_token_threshold=16)
    longs = [Request(f"long{i}", [i] * 600, SamplingParams(max_tokens=2)) for i in range(4)]
    for r in longs:
        scheduler.add(r)
    run_step(scheduler)
    short = Request("short", list(range(100, 110)), SamplingParams(max_tokens=2))
    scheduler.add(short)
    steps, chunks = 0, []
    while not short.output_token_ids:
        out = run_step(scheduler)
        steps += 1
        chunks += [n for r, n in out.num_scheduled.items() if r is not short]
    assert steps == 1
    assert max(chunks) <= 16 and not any(r.output_token_ids for r in longs)
    while scheduler.has_unfinished():  # the long ones passed over still finish
        run_step(scheduler)
    assert all(len(r.output_token_ids) == 2 for r in longs)
    assert kv.pool.num_free == kv.num_blocks


@pytest.mark.parametrize("threshold", [0, 16])
def test_prompts_behind_a_chunked_prefill_of_their_context_wait_for_it(threshold):
    """RAG prompts queued behind a first one with the same long context, whose prefill runs in
    chunks (the budget, or the long-prefill cap): each waits for the context to be cached
    rather than compute a private copy of the part still missing, so the context is computed
    once and every request holds the same blocks (one cascade serves them all)."""
    kv = KVCacheManager(num_blocks=200, block_size=16, enable_caching=True)
    scheduler = Scheduler(kv, 8, 64, "fcfs", long_prefill_token_threshold=threshold)
    context = list(range(1000, 1160))  # 10 blocks
    reqs = [Request(f"r{i}", [*context, i, i + 1], SamplingParams(max_tokens=2)) for i in range(4)]
    for r in reqs:
        scheduler.add(r)
    while scheduler.has_unfinished():
        run_step(scheduler)
        if all(r.status is RequestStatus.RUNNING for r in reqs):
            tables = [kv.block_tables[r.request_id][:10] for r in reqs]
            assert all(t == tables[0] for t in tables)  # the same physical context blocks
    assert [r.num_cached_tokens for r in reqs] == [0, 160, 160, 160]
    assert kv.pool.num_free == kv.num_blocks


@pytest.mark.parametrize("threshold", [-1, 1.5, "16", True])
def test_bad_long_prefill_token_threshold_names_the_field(threshold):
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be None or 0"):
        EngineConfig(long_prefill_token_threshold=threshold)
