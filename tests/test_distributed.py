"""Scale-out on Ray: the prefix-aware router alone, then `RayEngine` on a local Ray cluster
(one start per module, tiny random model, fp32): greedy parity with the local engine, routing
that reaches the replicas' prefix caches, cancellation, a killed replica, overload moved to
another replica, replica-labelled gauges, shutdown, and both adapters on `backend="ray"`."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")

from conftest import QUOTED, make_tiny_model  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402

from langchain_paged import ChatPaged  # noqa: E402
from llama_index.llms.paged import PagedLLM  # noqa: E402
from paged_backend import (  # noqa: E402
    LLM,
    EngineOverloadedError,
    EngineShutdownError,
    RequestFailedError,
    SamplingParams,
    get_engine,
    metrics,
    release_engine,
)
from paged_backend.default_model import default_model_file  # noqa: E402
from paged_backend.distributed import NoReplicaError, Router  # noqa: E402
from paged_backend.distributed.engine import RayEngine, _merge  # noqa: E402
from paged_backend.distributed.replica import prompt_logprobs_once  # noqa: E402

ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": 256}
RAY_ARGS = {"backend": "ray", "num_replicas": 2, **ENGINE_ARGS}
# Replicas that run one request and queue one more: a third is refused. Their model takes
# 32K-token requests, so that a filler runs for minutes (~5 ms a token here) until the test
# closes it: a 1,000-token one had finished in ~5 s, before a slow test had filled the queues.
SMALL_QUEUE_ARGS = {**RAY_ARGS, "max_num_seqs": 1, "max_waiting_requests": 1, "num_kv_blocks": 8300}
LONG_CONTEXT = 32768
LONG = SamplingParams(temperature=0, max_tokens=LONG_CONTEXT - 64, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "One, two, three, four,",
    "The three primary colours are",
    "Rain is falling on the roof and",
]
CONTEXT = (
    "The town of Lindenfeld lies on the river Alm. Its archive was founded in 1873 and holds "
    "the council records, the parish registers and the guild books. "
)


# ---- the router, without Ray -----------------------------------------------------------------
def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_requests_sharing_a_prefix_go_to_one_replica_and_others_go_elsewhere():
    router = Router(2, block_size=4)
    context_a, context_b = ids(40), ids(40, start=5000)
    first = router.route([*context_a, 7, 8, 9], SamplingParams())
    same = {router.route([*context_a, i, i + 1], SamplingParams()) for i in range(5)}
    assert same == {first}
    other = {router.route([*context_b, i], SamplingParams()) for i in range(3)}
    assert other == {1 - first}  # a new prefix goes to the least loaded replica
    assert router.decisions == {"least_loaded": 2, "affinity": 7}


def test_a_short_shared_prefix_does_not_pin_a_long_prompt():
    router = Router(2, block_size=4)
    first = router.route(ids(4) + ids(60, start=9000), SamplingParams())
    second = router.route(ids(4) + ids(60, start=20000), SamplingParams())  # 1 block of 16
    assert second != first and router.decisions == {"least_loaded": 2}


def test_the_guard_spreads_a_flood_of_one_prefix():
    router = Router(2, block_size=4, imbalance_abs=8, imbalance_rel=1.5)
    placed = [router.route([*ids(40), i], SamplingParams()) for i in range(40)]
    assert router.decisions["guard"] > 0
    assert abs(placed.count(0) - placed.count(1)) <= 10  # within the guard's margin
    # Both replicas now hold the prefix: once the flood drains, affinity picks either.
    for replica in placed:
        router.done(replica)
    assert router.load == [0, 0]


def test_cache_salts_are_indexed_separately():
    router = Router(2, block_size=4)
    prompt = ids(40)
    tenant_a = router.route(prompt, SamplingParams(cache_salt="tenant-a"))
    tenant_b = router.route(prompt, SamplingParams(cache_salt="tenant-b"))
    assert tenant_b != tenant_a and router.decisions == {"least_loaded": 2}
    assert router.route(prompt, SamplingParams(cache_salt="tenant-a")) == tenant_a
    assert router.route(prompt, SamplingParams()) == tenant_b  # unsalted: new, least loaded
    assert router.decisions == {"least_loaded": 3, "affinity": 1}


def test_least_loaded_and_round_robin_ignore_prefixes():
    least = Router(2, block_size=4, policy="least_loaded")
    assert [least.route(ids(40), SamplingParams()) for _ in range(4)] == [0, 1, 0, 1]
    least.done(1)
    assert least.route(ids(40), SamplingParams()) == 1
    rr = Router(3, block_size=4, policy="round_robin")
    assert [rr.route(ids(40), SamplingParams()) for _ in range(4)] == [0, 1, 2, 0]


def test_a_replica_marked_down_is_skipped_and_forgotten():
    router = Router(2, block_size=4)
    home = router.route(ids(40), SamplingParams())
    router.done(home)
    router.mark_down(home)
    assert router.route(ids(40), SamplingParams()) == 1 - home
    with pytest.raises(NoReplicaError):
        router.route(ids(40), SamplingParams(), exclude={1 - home})
    router.mark_up(home)  # back, but its cache is empty: the prefix stays where it went
    assert router.route(ids(40), SamplingParams()) == 1 - home


def test_bad_routing_arguments_fail_early():
    with pytest.raises(ValueError, match="routing must be one of"):
        Router(2, 4, "random")
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0, 4)
    with pytest.raises(ValueError, match="need backend='ray'"):
        get_engine(None, num_replicas=2)
    with pytest.raises(ValueError, match="dtype must be"):
        RayEngine(None, dtype="float13")  # as locally, and before Ray or any actor starts


def test_a_dead_replicas_gauges_are_removed_but_alive():
    prometheus_client = pytest.importorskip("prometheus_client")
    labels = {"model": "gauge-test", "engine": "e", "replica": "3"}

    def sample(stat: str) -> float | None:
        return prometheus_client.REGISTRY.get_sample_value(f"paged_backend_{stat}", labels)

    metrics.export({"alive": True, "num_running": 2}, "gauge-test", "e", replica="3")
    assert (sample("alive"), sample("num_running")) == (1, 2)
    metrics.export({"alive": False}, "gauge-test", "e", replica="3")  # no stale num_running
    assert (sample("alive"), sample("num_running")) == (0, None)


def test_merged_rates_are_those_of_one_engine_that_ran_every_replicas_requests(
    quoting_model, one_thread
):
    """Rates are recomputed from the replicas' summed counts, not summed: two engines' stats
    merged give the rates of one engine that ran both workloads (drafts accepted at different
    rates: a raw quote, and a chat prompt whose first drafts miss; prefix-cache hits too)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    params = SamplingParams(temperature=0, max_tokens=30)
    engines = [
        LLM(model=str(quoting_model), dtype="float32", num_kv_blocks=128, speculative_config=spec)
        for _ in range(3)
    ]
    chat = engines[0].engine.apply_chat_template([{"role": "user", "content": QUOTED}])
    workloads = [[QUOTED, QUOTED], [chat]]
    for engine, prompts in zip(engines[:2], workloads, strict=True):
        engine.generate(prompts, params, use_tqdm=False)
    for prompts in workloads:
        engines[2].generate(prompts, params, use_tqdm=False)
    replicas = [engine.stats() for engine in engines[:2]]
    merged, alone = _merge(replicas), engines[2].stats()
    assert replicas[0]["prefix_cache_hits"] > 0
    assert replicas[0]["spec_mean_acceptance_length"] > replicas[1]["spec_mean_acceptance_length"]
    assert replicas[0]["spec_acceptance_rate"] > replicas[1]["spec_acceptance_rate"]
    for key in (
        "prefix_cache_hit_rate",
        "spec_num_draft_tokens",
        "spec_acceptance_rate",
        "spec_mean_acceptance_length",
    ):
        assert merged[key] == pytest.approx(alone[key]), key


# ---- RayEngine on a local Ray cluster ----------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model):
    engine = get_engine(str(tiny_model), **RAY_ARGS)
    yield engine
    release_engine(engine)
    engine.shutdown()  # adapters not yet collected may still hold references


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, default_model_path):
    """The tiny model with room for `LONG` fillers."""
    path = tmp_path_factory.mktemp("tiny-long")
    return make_tiny_model(path, default_model_path, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def small_queues(ray_cluster, long_model):
    engine = get_engine(str(long_model), **SMALL_QUEUE_ARGS)
    yield engine
    release_engine(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def local_engine(tiny_model):
    engine = get_engine(str(tiny_model), **ENGINE_ARGS)
    yield engine
    release_engine(engine)


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def idle(engine: RayEngine) -> dict | None:
    stats = engine.stats()
    free = stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return stats if free and not stats["num_running"] and not stats["num_in_flight"] else None


def waiting(engine: RayEngine) -> list[int]:
    return [r["num_waiting"] for r in engine.stats()["replicas"]]


def run_one_on_each(engine: RayEngine) -> list:
    """A long request running on each replica (their first blocks differ: no affinity)."""
    streams = [engine.generate_stream(f"{word} counts:", LONG) for word in ("North", "South")]
    for stream in streams:
        next(stream)
    return streams


def texts(outputs) -> list[str]:
    return [out.outputs[0].text for out in outputs]


async def last_async(engine, prompt, params=GREEDY, **kwargs):
    last = None
    async for out in engine.generate(prompt, params, **kwargs):
        last = out
    return last


async def test_greedy_outputs_equal_the_local_engine(engine, local_engine):
    expected = texts([list(local_engine.generate_stream(p, GREEDY))[-1] for p in PROMPTS])
    concurrent = await asyncio.gather(*(last_async(engine, p) for p in PROMPTS))
    threaded = [list(engine.generate_stream(p, GREEDY))[-1] for p in PROMPTS]
    assert texts(concurrent) == expected
    assert texts(threaded) == expected
    assert all(out.finished and out.prompt in PROMPTS for out in concurrent)
    stats = wait_for(lambda: idle(engine), what="idle replicas")
    assert len(stats["replicas"]) == 2 and all(r["alive"] for r in stats["replicas"])
    per_replica = [r["num_generated_tokens"] for r in stats["replicas"]]
    assert stats["num_generated_tokens"] == sum(per_replica)


async def test_prompt_logprobs_cross_once_and_reach_every_output(engine, local_engine):
    """A replica sends a request's prompt logprobs in its first output only (each output is
    serialized); the caller sees them in every output, as a local engine gives them."""
    params = dataclasses.replace(GREEDY, prompt_logprobs=2)
    local = list(local_engine.generate_stream(PROMPTS[0], params))[-1].prompt_logprobs
    outputs = [out async for out in engine.generate(PROMPTS[0], params)]
    assert len(outputs) > 1
    for out in outputs:
        assert len(out.prompt_logprobs) == len(local) and out.prompt_logprobs[0] is None
        for theirs, ours in zip(out.prompt_logprobs[1:], local[1:], strict=True):
            assert theirs.keys() == ours.keys()
            for token, lp in theirs.items():
                assert lp.logprob == pytest.approx(ours[token].logprob, abs=1e-5)

    async def engine_side():  # what a replica's engine gives it: them in every output
        for out in outputs:
            yield out

    sent = [out async for out in prompt_logprobs_once(engine_side())]
    assert [o.prompt_logprobs is not None for o in sent] == [True] + [False] * (len(sent) - 1)


def test_the_router_hashes_blocks_as_the_engine_caches_them(local_engine):
    """Same block size, same salt, same chain: every hash the router indexes for a prompt is
    one the engine registered in its prefix cache for that prompt."""
    kv = local_engine.engine.kv
    router = Router(2, block_size=kv.block_size)
    for salt in (None, "tenant-a"):
        params = SamplingParams(temperature=0, max_tokens=2, cache_salt=salt)
        prompt = local_engine.tokenize(CONTEXT + "Who keeps the records?")
        list(local_engine.generate_stream(prompt, params))
        hashes = router.block_hashes(prompt, params)
        assert len(hashes) == len(prompt) // kv.block_size
        assert all(h in kv.pool.cached for h in hashes)
    assert router.block_hashes(prompt, SamplingParams()) != hashes  # the salt separates


def test_a_shared_prefix_reaches_the_replica_that_caches_it(engine):
    """The router's block hashes must equal the replicas' (size, salt): then the requests after
    the first land where the context is cached. Two tenants are cached apart."""
    for salt in ("tenant-a", "tenant-b"):
        params = SamplingParams(temperature=0, max_tokens=4, cache_salt=salt)
        outs = [
            list(engine.generate_stream(CONTEXT + f"Question {i}: who?", params))[-1]
            for i in range(4)
        ]
        context_tokens = len(engine.tokenize(CONTEXT))
        assert outs[0].num_cached_tokens == 0  # the other tenant's blocks are not shared
        assert all(out.num_cached_tokens >= context_tokens - 4 for out in outs[1:])


async def test_a_bad_request_raises_the_replicas_error(engine):
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        await last_async(engine, [10**6])
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        await last_async(engine, [-1] * 8)  # not hashable for routing: the replica says why
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        list(engine.generate_stream([10**6], GREEDY))
    # What the local engine refuses while tokenizing, this one refuses before routing.
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        engine.generate_stream("", GREEDY)
    with pytest.raises(TypeError, match="prompt must be a str, a list of int token ids or a"):
        engine.generate_stream(3.5, GREEDY)
    wait_for(lambda: idle(engine), what="idle replicas")


async def test_generate_tokenizes_off_the_event_loop(engine, monkeypatch):
    """A long prompt takes milliseconds to tokenize: not on the caller's event loop."""
    real, on_loop = engine.tokenize, []

    def spy(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "tokenize", spy)
    assert (await last_async(engine, PROMPTS[0])).finished
    assert on_loop == [False]


@pytest.mark.parametrize("how", ["close", "cancel_task"])
async def test_cancelling_a_stream_aborts_it_on_its_replica(engine, how):
    before = wait_for(lambda: idle(engine), what="idle replicas")["num_generated_tokens"]
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    if how == "close":
        stream = engine.generate_stream("Count with me:", params)
        next(stream), next(stream)
        stream.close()
    else:
        seen = []

        async def consume():
            async for out in engine.generate("Count with me:", params):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    stats = await asyncio.to_thread(wait_for, lambda: idle(engine), 30.0, "freed blocks")
    # Without the abort the request would run to its 900 tokens before its blocks came free.
    assert stats["num_generated_tokens"] - before < 300


def test_chat_paged_on_ray_invoke_stream_batch(engine, local_engine, tiny_model):
    model = ChatPaged(model=str(tiny_model), temperature=0, max_tokens=8, **RAY_ARGS)
    local = ChatPaged(model=str(tiny_model), temperature=0, max_tokens=8, **ENGINE_ARGS)
    assert model.engine is engine and local.engine is local_engine
    reply = model.invoke("Hello, who are you?")
    assert isinstance(reply, AIMessage)
    assert reply.content == local.invoke("Hello, who are you?").content
    assert reply.usage_metadata["output_tokens"] > 0
    chunks = list(model.stream("Hello, who are you?"))
    assert "".join(c.content for c in chunks) == reply.content
    questions = ["Name a colour.", "Name a river.", "Name a town."]
    assert [m.content for m in model.batch(questions)] == [
        m.content for m in local.batch(questions)
    ]
    assert asyncio.run(model.ainvoke("Hello, who are you?")).content == reply.content


def test_paged_llm_llama_index_on_ray_complete_chat(engine, local_engine, tiny_model):
    model = PagedLLM(model=str(tiny_model), temperature=0, max_tokens=8, engine_args=RAY_ARGS)
    by_kwargs = PagedLLM(
        model=str(tiny_model), backend="ray", num_replicas=2, engine_args=ENGINE_ARGS
    )
    local = PagedLLM(model=str(tiny_model), temperature=0, max_tokens=8, engine_args=ENGINE_ARGS)
    assert model.engine is engine and by_kwargs.engine is engine
    text = model.complete("The capital of France is").text
    assert text == local.complete("The capital of France is").text
    assert "".join(r.delta for r in model.stream_complete("The capital of France is")) == text
    assert asyncio.run(model.acomplete("The capital of France is")).text == text
    message = [ChatMessage(role="user", content="Hello!")]
    assert model.chat(message).message.content == local.chat(message).message.content


def test_a_replica_serves_a_gguf_files_blocks(ray_cluster):
    """A replica of a GGUF file serves the file's blocks, with the local engine's greedy tokens
    on the same file (kernel choices pinned: a replica times its own on its thread count)."""
    args = {**ENGINE_ARGS, "num_kv_blocks": 128, "cpu_gemm_max_rows": 64}
    file = str(default_model_file())
    replicas = get_engine(file, backend="ray", num_replicas=1, **args)
    local = get_engine(file, **args)
    try:
        want = texts([list(local.generate_stream(p, GREEDY))[-1] for p in PROMPTS[:3]])
        assert texts([list(replicas.generate_stream(p, GREEDY))[-1] for p in PROMPTS[:3]]) == want
        assert wait_for(lambda: idle(replicas), what="an idle replica")["num_generated_tokens"] > 0
    finally:
        release_engine(local)
        release_engine(replicas)
        replicas.shutdown()


def test_a_killed_replica_fails_only_its_requests_and_comes_back(engine):
    wait_for(lambda: idle(engine), what="idle replicas")
    params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    streams = [engine.generate_stream(f"Story {i} begins with", params) for i in range(4)]
    for stream in streams:
        next(stream)  # each has streamed: it fails rather than moves
    in_flight = [r["num_in_flight"] for r in engine.stats()["replicas"]]
    assert in_flight == [2, 2]
    ray.kill(engine.replicas[0])
    finished, failed = 0, 0
    for stream in streams:
        try:
            finished += list(stream)[-1].finished
        except RequestFailedError as exc:
            assert "replica 0 failed" in str(exc)
            failed += 1
    assert (finished, failed) == (2, 2)
    # Meanwhile requests go to the live replica; then the dead one is replaced.
    assert all(list(engine.generate_stream(p, GREEDY))[-1].finished for p in PROMPTS[:3])
    wait_for(lambda: all(r["alive"] for r in engine.stats()["replicas"]), 60, "a new replica")
    outs = [list(engine.generate_stream(p, GREEDY))[-1] for p in PROMPTS]
    assert all(out.finished for out in outs)


def test_gauges_carry_a_replica_label(engine):
    prometheus_client = pytest.importorskip("prometheus_client")
    list(engine.generate_stream(PROMPTS[0], GREEDY))
    stats = wait_for(lambda: idle(engine), what="idle replicas")  # stats() exports them

    def sample(stat: str, replica: str) -> float | None:
        labels = {"model": engine.model_name, "engine": engine.engine_id, "replica": replica}
        return prometheus_client.REGISTRY.get_sample_value(f"paged_backend_{stat}", labels)

    assert sample("num_generated_tokens", "") == stats["num_generated_tokens"]  # the totals
    assert sample("prefix_cache_hit_rate", "") == stats["prefix_cache_hit_rate"]
    for replica in stats["replicas"]:
        index = str(replica["replica"])
        assert sample("num_generated_tokens", index) == replica["num_generated_tokens"]
        assert sample("alive", index) == 1
        assert sample("replica", index) is None  # the index is the label, not a stat


async def test_a_refused_request_moves_to_another_replica(small_queues):
    engine = small_queues
    running = run_one_on_each(engine)
    queued = engine.generate_stream(CONTEXT + "Question 0: who?", SHORT)
    wait_for(lambda: sorted(waiting(engine)) == [0, 1], what="a request queued on one replica")
    before = Counter(engine.stats()["routing"])
    # Affinity sends the same context to the full replica; it refuses, the other one queues it.
    moved = asyncio.create_task(last_async(engine, CONTEXT + "Question 1: who?", SHORT))
    await asyncio.to_thread(wait_for, lambda: waiting(engine) == [1, 1], 30.0, "the move")
    assert Counter(engine.stats()["routing"]) - before == {"affinity": 1, "least_loaded": 1}
    # Every replica is full now: the caller gets the local engine's error, in both APIs.
    with pytest.raises(EngineOverloadedError, match="every live replica refused"):
        next(engine.generate_stream("Hello", GREEDY))
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests=1"):
        await last_async(engine, "Hello")
    for stream in [*running, queued]:
        stream.close()
    assert (await moved).finished
    await asyncio.to_thread(wait_for, lambda: idle(engine), 30.0, "idle replicas")
    assert engine._router.load == [0, 0]  # refusals gave their places back


def test_chat_paged_retries_a_ray_overload(small_queues, long_model, monkeypatch):
    """The adapters' `max_retries` applies: a Ray overload is `EngineOverloadedError` itself."""
    fillers = run_one_on_each(small_queues)
    fillers += [small_queues.generate_stream(f"{w} waits:", SHORT) for w in ("East", "West")]
    wait_for(lambda: waiting(small_queues) == [1, 1], what="full queues")
    model = str(long_model)
    impatient = ChatPaged(model=model, max_tokens=4, max_retries=0, **SMALL_QUEUE_ARGS)
    assert impatient.engine is small_queues
    with pytest.raises(EngineOverloadedError) as refused:
        impatient.invoke("Hello")
    assert type(refused.value) is EngineOverloadedError  # not Ray's wrapper of it
    submitted = []
    submit = small_queues.generate_stream
    monkeypatch.setattr(
        small_queues, "generate_stream", lambda *a, **k: submitted.append(a) or submit(*a, **k)
    )
    patient = ChatPaged(model=model, max_tokens=4, max_retries=6, **SMALL_QUEUE_ARGS)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(patient.invoke, "Hello")
        wait_for(lambda: len(submitted) >= 2, what="a resubmission")
        for stream in fillers:
            stream.close()
        assert reply.result(timeout=30).usage_metadata["output_tokens"] > 0
    wait_for(lambda: idle(small_queues), what="idle replicas")


def test_shutdown_leaves_no_actors_and_ends_requests(ray_cluster, tiny_model):
    engine = RayEngine(str(tiny_model), num_replicas=1, **ENGINE_ARGS)
    actors = engine.replicas
    stream = engine.generate_stream("Hello", SamplingParams(max_tokens=600, ignore_eos=True))
    next(stream)
    engine.shutdown()
    with pytest.raises(EngineShutdownError):
        list(stream)
    with pytest.raises(EngineShutdownError):
        list(engine.generate_stream("Hello", GREEDY))
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.info.remote(), timeout=10)
    gc.collect()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith(engine._name)]


def test_replicas_draft_and_keep_the_local_engines_tokens(ray_cluster, quoting_model):
    """`speculative_config` reaches the replicas: a seeded sampled request and a greedy one
    give the local engine's tokens without drafting, and the totals count accepted drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    engine = RayEngine(str(quoting_model), num_replicas=1, speculative_config=spec, **ENGINE_ARGS)
    plain = LLM(model=str(quoting_model), **ENGINE_ARGS)
    params = [
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0.8, seed=4, max_tokens=30),
    ]
    try:
        got = [list(engine.generate_stream(QUOTED, p))[-1] for p in params]
        want = plain.generate([QUOTED] * 2, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        stats = engine.stats()
        assert stats["spec_num_accepted_tokens"] > 0
        assert stats["spec_mean_acceptance_length"] > 1
    finally:
        engine.shutdown()
