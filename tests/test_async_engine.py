"""The async engine: many loops and threads share one continuous batch; aborts, errors,
backpressure and shutdown stay local to the requests they concern."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from conftest import assert_all_blocks_free

from paged_backend import (
    LLM,
    AsyncEngine,
    EngineOverloadedError,
    EngineShutdownError,
    RequestFailedError,
    SamplingParams,
    get_engine,
    release_engine,
)

PROMPTS = [
    f"Item {i}: the {w} of the {v}"
    for i, (w, v) in enumerate(
        [
            (w, v)
            for w in ("colour", "shape", "weight", "price")
            for v in (
                "apple",
                "river",
                "engine",
                "book",
                "mountain",
                "violin",
                "garden",
                "letter",
                "window",
                "cloud",
                "bridge",
                "clock",
                "lamp",
                "harbour",
                "forest",
                "street",
            )
        ]
    )
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="module")
def serial_texts(tiny_model):
    """Each prompt run alone: the reference every concurrent run must reproduce."""
    llm = LLM(model=str(tiny_model), **ENGINE_ARGS)
    return {p: llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}


@pytest.fixture
def engine(tiny_model):
    eng = AsyncEngine.from_model(str(tiny_model), **ENGINE_ARGS)
    yield eng
    eng.shutdown()


async def _consume(eng, prompt, results):
    last = None
    text = ""
    async for out in eng.generate(prompt, GREEDY):
        text += out.outputs[0].delta_text
        last = out
    assert last.finished and text == last.outputs[0].text
    results[prompt] = last.outputs[0].token_ids


def test_64_requests_from_two_loops_and_four_threads(engine, serial_texts):
    results: dict[str, list[int]] = {}
    loop_prompts = [PROMPTS[0:16], PROMPTS[16:32]]
    thread_prompts = [PROMPTS[32 + 8 * i : 40 + 8 * i] for i in range(4)]
    errors = []

    def run_loop(prompts):
        async def main():
            await asyncio.gather(*(_consume(engine, p, results) for p in prompts))

        try:
            asyncio.run(main())
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    def run_thread(prompts):
        try:
            for p in prompts:  # each thread streams its requests concurrently with the others
                outs = list(engine.generate_stream(p, GREEDY))
                results[p] = outs[-1].outputs[0].token_ids
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run_loop, args=(p,)) for p in loop_prompts]
    threads += [threading.Thread(target=run_thread, args=(p,)) for p in thread_prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert results == serial_texts
    assert engine.stats()["max_batch_size"] > 8
    assert_all_blocks_free(engine)


LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
# An abort takes effect within a step or two: a few tokens may already be on their way.
ABORT_SLACK = 4


async def test_random_aborts_leave_others_untouched(engine, serial_texts):
    """Victims ask for 400 tokens: had an abort done nothing, they would deliver them all."""
    rng = random.Random(1234)
    prompts = PROMPTS[:24]
    victims = set(rng.sample(prompts, 8))
    results = {}

    async def run(prompt):
        stop_after = rng.randint(0, 6) if prompt in victims else None
        params = LONG if prompt in victims else GREEDY
        seen = 0
        async for out in engine.generate(prompt, params, request_id=f"id-{prompt}"):
            seen += 1
            if stop_after is not None and seen > stop_after:
                if stop_after % 2:
                    await engine.abort(f"id-{prompt}")  # explicit abort, keep reading
                else:
                    break  # leaving the loop aborts too
            if out.finished:
                results[prompt] = out.outputs[0]

    await asyncio.gather(*(run(p) for p in prompts))
    for p in prompts:
        if p not in victims:
            assert results[p].token_ids == serial_texts[p]
        elif p in results:  # explicitly aborted ones end with an abort output, and soon
            assert results[p].finish_reason == "abort"
            assert len(results[p].token_ids) <= 7 + ABORT_SLACK
    assert_all_blocks_free(engine)
    generated = engine.stats()["num_generated_tokens"]
    assert generated <= 16 * GREEDY.max_tokens + 8 * (7 + ABORT_SLACK)


def _assert_stopped_early(engine, limit: int = 50) -> None:
    assert_all_blocks_free(engine)
    assert engine.stats()["num_generated_tokens"] < limit, "the request ran on after its abort"


async def test_cancelling_the_task_frees_blocks(engine):
    started = asyncio.Event()

    async def run():
        async for _ in engine.generate(PROMPTS[0], LONG):
            started.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _assert_stopped_early(engine)


def test_closing_a_sync_iterator_aborts(engine):
    it = engine.generate_stream(PROMPTS[1], LONG)
    next(it)
    it.close()
    _assert_stopped_early(engine)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_an_unread_sync_iterator_aborts_too(engine, how):
    """The request is submitted when the iterator is made: closing or dropping it before
    reading anything must abort it, not leave it running unread."""
    stream = engine.generate_stream(PROMPTS[1], LONG)
    if how == "close":
        stream.close()
    del stream
    _assert_stopped_early(engine)


def test_timeout_aborts_and_raises_in_the_caller(engine):
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.1 s"):
        for _ in engine.generate_stream(PROMPTS[1], LONG, timeout=0.1):
            time.sleep(0.02)  # a slow consumer: the deadline covers the whole request
    _assert_stopped_early(engine, LONG.max_tokens)


async def test_timeout_in_async_generate(engine):
    with pytest.raises(TimeoutError):
        async for _ in engine.generate(PROMPTS[2], LONG, timeout=0.1):
            await asyncio.sleep(0.02)
    _assert_stopped_early(engine, LONG.max_tokens)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "10", True])
def test_bad_timeout_names_the_field(engine, timeout):
    with pytest.raises(ValueError, match="timeout"):
        engine.generate_stream(PROMPTS[3], GREEDY, timeout=timeout)
    assert engine.stats()["num_waiting"] == 0


def test_consumer_that_stops_reading_does_not_stall_others(engine, serial_texts):
    stalled = engine.generate_stream(PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stalled)  # then never read again
    outs = list(engine.generate_stream(PROMPTS[3], GREEDY))
    assert outs[-1].outputs[0].token_ids == serial_texts[PROMPTS[3]]
    stalled.close()
    assert_all_blocks_free(engine)


def test_short_request_interleaves_with_long_prefills(tiny_model):
    """Four long prompts queued first, then a short one: it gets its first token within a few
    engine steps of being queued, before any long prompt's first token; without the cap it
    waits for all 4 x 600 prompt tokens (~37 steps of 64). Steps are counted in the engine
    thread, so a slow consumer cannot blur them."""
    eng = AsyncEngine.from_model(
        str(tiny_model),
        dtype="float32",
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
    )
    engine, real_step = eng.engine, eng.engine.step
    queued_at, first_token_at = {}, {}

    def counting_step():
        for request_id in engine.parents:
            queued_at.setdefault(request_id, engine.num_steps)
        outputs = real_step()
        for out in outputs:
            if out.outputs[0].token_ids:
                first_token_at.setdefault(out.request_id, engine.num_steps)
        return outputs

    engine.step = counting_step
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        longs = [
            eng.generate_stream(f"{i} " + "word " * 600, params, f"long{i}")  # no shared prefix
            for i in range(4)
        ]
        assert next(eng.generate_stream("Hi", params, "short")).outputs[0].token_ids
        assert first_token_at["short"] - queued_at["short"] <= 4
        assert queued_at["long3"] <= queued_at["short"]  # the long ones were queued first
        for it in longs:
            assert len(list(it)[-1].outputs[0].token_ids) == 2  # and still finish
        assert first_token_at["short"] < min(first_token_at[f"long{i}"] for i in range(4))
    finally:
        eng.shutdown()


def test_failed_step_fails_only_its_requests(engine, serial_texts, monkeypatch):
    runner = engine.engine.runner
    real = runner.execute
    state = {"fail": True}

    def flaky(*args):
        if state["fail"]:
            state["fail"] = False
            raise MemoryError("simulated out of memory")
        return real(*args)

    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(RequestFailedError, match="simulated out of memory"):
        list(engine.generate_stream(PROMPTS[4], GREEDY))
    outs = list(engine.generate_stream(PROMPTS[5], GREEDY))
    assert outs[-1].outputs[0].token_ids == serial_texts[PROMPTS[5]]
    assert_all_blocks_free(engine)


def test_bad_input_raises_in_the_caller(engine):
    with pytest.raises(ValueError, match="prompt"):
        engine.generate_stream("", GREEDY)
    with pytest.raises(TypeError, match="prompt"):
        engine.generate_stream(12, GREEDY)
    assert list(engine.generate_stream(PROMPTS[6], GREEDY))[-1].finished


def test_overload_error(tiny_model):
    eng = AsyncEngine.from_model(
        str(tiny_model), dtype="float32", max_waiting_requests=2, max_num_seqs=1
    )
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        streams = [eng.generate_stream(PROMPTS[0], params)]
        next(streams[0])  # running; the next two fill the waiting queue
        streams += [eng.generate_stream(PROMPTS[i], params) for i in (1, 2)]
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            eng.generate_stream(PROMPTS[3], params)
        for s in streams:
            s.close()
    finally:
        eng.shutdown()


def test_requests_the_engine_thread_took_count_as_waiting_until_its_step_ends(tiny_model):
    """A submission while the engine thread steps with a request it just took from the inbox
    (in neither the inbox nor the last step's queue) sees a full queue."""
    eng = AsyncEngine.from_model(
        str(tiny_model), dtype="float32", max_waiting_requests=1, max_num_seqs=1
    )
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    in_step, release = threading.Event(), threading.Event()
    step = eng.engine.step

    def step_holding_the_queue():
        if eng.engine.scheduler.waiting:
            in_step.set()
            release.wait(10)
        return step()

    try:
        running = eng.generate_stream(PROMPTS[0], params)
        next(running)
        eng.engine.step = step_holding_the_queue
        waiting = eng.generate_stream(PROMPTS[1], params)
        assert in_step.wait(10)
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            eng.generate_stream(PROMPTS[2], params)
        release.set()
        running.close()
        waiting.close()
    finally:
        release.set()
        eng.shutdown()


def test_shutdown_ends_in_flight_requests_promptly(tiny_model):
    eng = AsyncEngine.from_model(str(tiny_model), dtype="float32")
    it = eng.generate_stream(PROMPTS[7], SamplingParams(max_tokens=900, ignore_eos=True))
    next(it)
    start = time.monotonic()
    eng.shutdown()
    assert time.monotonic() - start < 5
    with pytest.raises(EngineShutdownError):
        for _ in it:
            pass
    with pytest.raises(EngineShutdownError, match="shut down"):
        eng.generate_stream(PROMPTS[8], GREEDY)


def test_asyncio_run_in_worker_thread_and_shared_engines(tiny_model, serial_texts):
    a = get_engine(str(tiny_model), **ENGINE_ARGS)
    b = get_engine(str(tiny_model), **ENGINE_ARGS)
    assert a is b
    out = {}

    def worker():
        async def main():
            await _consume(a, PROMPTS[9], out)

        asyncio.run(main())

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert out[PROMPTS[9]] == serial_texts[PROMPTS[9]]
    release_engine(a)
    assert not a.is_closed
    release_engine(b)
    assert a.is_closed
    c = get_engine(str(tiny_model), **ENGINE_ARGS)
    assert c is not a
    release_engine(c)


def test_stats_and_prometheus_gauges(engine):
    prometheus_client = pytest.importorskip("prometheus_client")
    list(engine.generate_stream(PROMPTS[10], GREEDY))
    stats = engine.stats()
    for key in (
        "kv_blocks_total",
        "kv_blocks_free",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "max_batch_size",
        "num_running",
        "num_waiting",
        "prefix_cache_hit_rate",
        "generation_tokens_per_s",
    ):
        assert key in stats
    assert stats["generation_tokens_per_s"] > 0
    value = prometheus_client.REGISTRY.get_sample_value(
        "paged_backend_kv_blocks_total",
        {"model": engine.model_name, "engine": stats["engine_id"], "replica": ""},
    )
    assert value == stats["kv_blocks_total"]


def _finished_unread(engine, params):
    """A request run to its end while nobody reads it: (its stream, a normal run's outputs)."""
    reference = list(engine.generate_stream(PROMPTS[11], params))
    stream = engine.generate_stream(PROMPTS[11], params)
    deadline = time.monotonic() + 60
    while stream.request_id in engine._streams:  # delivered its last output, all unread
        assert time.monotonic() < deadline, "the request did not finish"
        time.sleep(0.01)
    return stream, reference


def test_unread_outputs_are_merged_into_one(engine):
    """A stalled reader holds one merged output, not a snapshot per step, and reading it gives
    the newest state with every step's deltas (per completion of n), logprobs included."""
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=120, ignore_eos=True, logprobs=1
    )
    stream, reference = _finished_unread(engine, params)
    assert len(reference) > 100  # one output per step when read as they come
    assert len(stream._handle._items) == 1
    (merged,) = list(stream)
    final = reference[-1]
    assert merged.finished and merged.outputs[0].finish_reason == "length"
    for got, want in zip(merged.outputs, final.outputs, strict=True):
        assert got.index == want.index and got.token_ids == want.token_ids
        assert got.delta_token_ids == got.token_ids and len(got.token_ids) == 120
        assert got.text == want.text and got.delta_text == want.text
        assert len(got.logprobs) == 120  # the values differ in the last bits: a cache hit
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-4)
    assert merged.outputs[0].token_ids != merged.outputs[1].token_ids


def test_slow_reader_rebuilds_the_output_from_deltas(engine):
    """A reader that falls several steps behind before each read gets fewer, merged outputs
    whose deltas still add up to the full text and token ids."""
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    reference = list(engine.generate_stream(PROMPTS[12], params))[-1].outputs[0]
    text, ids, reads = "", [], 0
    for out in engine.generate_stream(PROMPTS[12], params):
        reads += 1
        text += out.outputs[0].delta_text
        ids += out.outputs[0].delta_token_ids
        steps = engine.stats()["num_steps"]
        while engine.stats()["num_steps"] < steps + 5 and engine.stats()["num_running"]:
            time.sleep(0.005)  # let the engine run ahead: a count of steps, not a wall time
    assert ids == reference.token_ids and text == reference.text
    assert reads < len(reference.token_ids) // 3
