"""Reliability under load, cancellations, faults and time: the figures of docs/many_users.md
("Running it for many users"). Each scenario checks its own outcome and the script exits non-zero if
one fails.

- overload: many concurrent requests from 8 threads and 2 event loops against a KV cache sized
  for ~20 of them: each completes with the text it gets alone (fp32, greedy) or is refused at
  submit with EngineOverloadedError; none hangs; no block leaks; preemptions counted.
- cancellations: a seeded half of many streams is aborted at random token counts (task cancel,
  sync iterator close, `abort()`, or never read at all); survivors' texts are unchanged, no
  block leaks, and at most a step's worth of tokens arrives after an abort.
- faults: exceptions injected through the engine's fault hook into the forward, the sampler and
  the detokenizer at random steps: only the requests of the failed work fail
  (RequestFailedError), the others' texts are unchanged (and every third's prompt logprobs are
  whole), blocks balance, and a warm prefix of a tenant the faults never touched is still cached.
- soak: mixed traffic for `--minutes`; resident memory growth after warm-up (less the KV cache's
  pages first touched in that time: it commits memory as blocks are first used, up to its size)
  and free blocks at the end.
- hol: head-of-line blocking. Short requests queued right behind long prompts, on an engine
  with long prefills uncapped (`long_prefill_token_threshold=0`) and one with the default cap:
  their time to first token (p50, p99; seconds, and engine steps from being queued, the one
  that brings the token included), and the long prompts' prefill rate, which the cap should
  keep.

Each scenario prints a line to stderr as it starts and as it ends.

    python examples/stress.py                      # all but hol, default model, ~5 minutes
    python examples/stress.py --minutes 10 --json  # a 10-minute soak
    python examples/stress.py --scenarios hol      # head-of-line blocking, ~2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import replace

from paged_backend import (
    LLM,
    AsyncEngine,
    EngineOverloadedError,
    RequestFailedError,
    SamplingParams,
)
from paged_backend.adapters import alast_output
from paged_backend.config import EngineConfig

SUBJECTS = ["rivers", "bread", "clocks", "violins", "harbours", "glaciers", "bees", "lamps"]
PROMPTS = [f"Write one sentence about {s} number {i}:" for s in SUBJECTS for i in range(5)]
TIMEOUT_S = 600.0  # a request still unanswered then counts as hung
# Chance of a fault per step (forward, sample) and per request's token (detokenize).
FAULT_RATES = {"forward": 0.03, "sample": 0.03, "detokenize": 0.005}
# hol: long prompts queued at once, then short ones; random token ids, so none shares a prefix.
HOL_LONGS, HOL_LONG_TOKENS, HOL_SHORTS, HOL_SHORT_TOKENS = 16, 1000, 16, 16


def log(line: str) -> None:
    """Progress on stderr, at once: stdout carries the report (`--json` parses it)."""
    print(f"stress: {line}", file=sys.stderr, flush=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def references(model: str | None, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens run alone: what every loaded run must reproduce."""
    llm = LLM(model=model, dtype="float32", num_kv_blocks=512)
    return {
        p: llm.generate(p, greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    }


def blocks_leaked(engine: AsyncEngine, wait_s: float = 10.0) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        stats = engine.stats()
        leaked = stats["kv_blocks_total"] - stats["kv_blocks_free"]
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.02)


def overload(
    engine: AsyncEngine, refs: dict[str, list[int]], requests: int, max_tokens: int
) -> dict:
    """`requests` submitted at once by 8 threads and 2 event loops."""
    prompts = list(refs)
    outcome: Counter = Counter()
    lock = threading.Lock()
    queue_full = threading.Event()

    def hold_first_forward(stage: str, request_ids: list[str]) -> None:
        # The first step waits until the queue has refused someone: on a machine where the
        # engine outpaces the submitting threads, it would otherwise drain the burst as it comes.
        if stage == "forward":
            engine.engine.fault_hook = None
            queue_full.wait(timeout=10)

    def record(prompt: str, tokens: list[int] | None, error: BaseException | None) -> None:
        kind = (
            "completed_same_text"
            if tokens == refs[prompt]
            else "completed_other_text"
            if tokens is not None
            else "refused_overloaded"
            if isinstance(error, EngineOverloadedError)
            else "hung"
            if isinstance(error, TimeoutError)
            else f"error_{type(error).__name__}"
        )
        with lock:
            outcome[kind] += 1
        if kind == "refused_overloaded":
            queue_full.set()

    def thread_worker(batch: list[str]) -> None:
        streams = []
        for prompt in batch:  # submit everything first: all of it is in flight at once
            try:
                streams.append(
                    (prompt, engine.generate_stream(prompt, greedy(max_tokens), timeout=TIMEOUT_S))
                )
            except EngineOverloadedError as exc:
                record(prompt, None, exc)
        for prompt, stream in streams:
            try:
                record(prompt, list(stream)[-1].outputs[0].token_ids, None)
            except Exception as exc:
                record(prompt, None, exc)

    async def one(prompt: str) -> None:
        try:
            outputs = engine.generate(prompt, greedy(max_tokens), timeout=TIMEOUT_S)
            record(prompt, (await alast_output(outputs)).outputs[0].token_ids, None)
        except Exception as exc:
            record(prompt, None, exc)

    def loop_worker(batch: list[str]) -> None:
        async def run() -> None:
            await asyncio.gather(*(one(p) for p in batch))

        asyncio.run(run())

    work = [prompts[i % len(prompts)] for i in range(requests)]
    batches = [work[i::10] for i in range(10)]
    preempted = engine.stats()["num_preemptions"]
    engine.engine.fault_hook = hold_first_forward
    start = time.monotonic()
    workers = [threading.Thread(target=thread_worker, args=(b,)) for b in batches[:8]]
    workers += [threading.Thread(target=loop_worker, args=(b,)) for b in batches[8:]]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    figures = {
        "requests": requests,
        **dict(outcome),
        "preemptions": engine.stats()["num_preemptions"] - preempted,
        "blocks_leaked": blocks_leaked(engine),
        "seconds": round(time.monotonic() - start, 1),
    }
    figures["ok"] = (
        outcome["completed_same_text"] + outcome["refused_overloaded"] == requests
        and figures["blocks_leaked"] == 0
    )
    return figures


def cancellations(engine: AsyncEngine, refs: dict[str, list[int]], streams: int, seed: int) -> dict:
    """Half the streams (seeded) stop early, in each of the ways a caller can stop one."""
    rng = random.Random(seed)
    long = greedy(10**4 // 20)  # victims would run long if an abort did nothing
    plan = []
    for i in range(streams):
        prompt = rng.choice(list(refs))
        how = rng.choice(("cancel", "close", "abort", "never_read")) if rng.random() < 0.5 else None
        plan.append((f"storm-{seed}-{i}", prompt, how, rng.randint(1, 8)))
    survivors_ok = late_tokens = 0
    max_tokens = len(next(iter(refs.values())))

    async def one(request_id: str, prompt: str, how: str | None, after: int) -> None:
        nonlocal survivors_ok, late_tokens
        params = greedy(max_tokens) if how is None else long
        if how == "close":  # a plain thread's iterator, closed part way

            def read() -> None:
                stream = engine.generate_stream(prompt, params, request_id)
                for n, _ in enumerate(stream, 1):
                    if n >= after:
                        stream.close()
                        break

            await asyncio.to_thread(read)
            return
        if how == "never_read":  # submitted, then dropped before reading anything
            await asyncio.to_thread(lambda: engine.generate_stream(prompt, params).close())
            return
        if how == "cancel":  # the consuming task is cancelled part way
            progressed = asyncio.Event()

            async def consume() -> None:
                async for out in engine.generate(prompt, params, request_id=request_id):
                    if len(out.outputs[0].token_ids) >= after:
                        progressed.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(progressed.wait(), TIMEOUT_S)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        seen, aborted_at, last = 0, None, None
        async for last in engine.generate(prompt, params, request_id=request_id):
            seen += len(last.outputs[0].delta_token_ids)
            if how == "abort" and seen >= after and aborted_at is None:
                aborted_at = seen
                await engine.abort(request_id)  # and keep reading: what still arrives?
        if how is None:
            survivors_ok += last.outputs[0].token_ids == refs[prompt]
        else:
            late_tokens = max(late_tokens, len(last.outputs[0].token_ids) - aborted_at)

    async def run() -> None:
        await asyncio.gather(*(one(*p) for p in plan))

    start = time.monotonic()
    asyncio.run(run())
    survivors = sum(1 for p in plan if p[2] is None)
    figures = {
        "streams": streams,
        "aborted": streams - survivors,
        "survivors_same_text": survivors_ok,
        "survivors": survivors,
        "max_tokens_after_abort": late_tokens,
        "blocks_leaked": blocks_leaked(engine),
        "seconds": round(time.monotonic() - start, 1),
    }
    figures["ok"] = survivors_ok == survivors and figures["blocks_leaked"] == 0
    return figures


def faults(engine: AsyncEngine, refs: dict[str, list[int]], requests: int, seed: int) -> dict:
    """Faults at `FAULT_RATES` while `requests` requests run (their tracebacks silenced);
    every third asks for its prompt's logprobs too, which the survivors must have whole."""
    rng = random.Random(seed)
    warm = "You are the assistant of a tenant the faults never touch. " * 6
    warm_params = SamplingParams(temperature=0, max_tokens=2, cache_salt="untouched")
    list(engine.generate_stream(warm, warm_params))
    fired: Counter = Counter()

    def hook(stage: str, request_ids: list[str]) -> None:
        if rng.random() < FAULT_RATES[stage]:
            fired[stage] += 1
            raise RuntimeError(f"injected {stage} fault")

    prompts = [rng.choice(list(refs)) for _ in range(requests)]
    logging.getLogger("paged_backend.engine").disabled = True
    engine.engine.fault_hook = hook
    results: list = [None] * requests

    def consume(i: int, stream) -> None:
        try:
            last = list(stream)[-1]
            results[i] = last.outputs[0].token_ids
            if last.prompt_logprobs is not None:
                scored_whole[i] = len(last.prompt_logprobs) == len(last.prompt_token_ids) and all(
                    last.prompt_logprobs[1:]
                )
        except RequestFailedError as exc:
            results[i] = exc

    scored = [i % 3 == 0 for i in range(requests)]
    scored_whole = [False] * requests
    try:
        streams = [
            engine.generate_stream(
                p, replace(greedy(len(refs[p])), prompt_logprobs=1 if s else None)
            )
            for p, s in zip(prompts, scored, strict=True)
        ]
        threads = [threading.Thread(target=consume, args=x) for x in enumerate(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.engine.fault_hook = None
        logging.getLogger("paged_backend.engine").disabled = False
    failed = sum(isinstance(r, RequestFailedError) for r in results)
    same = sum(r == refs[p] for r, p in zip(results, prompts, strict=True))
    survivors = [not isinstance(r, Exception) for r in results]
    scored_survivors = sum(s and ok for s, ok in zip(scored, survivors, strict=True))
    warm_hit = list(engine.generate_stream(warm, warm_params))[-1].num_cached_tokens
    figures = {
        "requests": requests,
        "faults": dict(fired),
        "failed_requests": failed,
        "others_same_text": same,
        "scored_survivors_with_prompt_logprobs": f"{sum(scored_whole)} of {scored_survivors}",
        "blocks_leaked": blocks_leaked(engine),
        "untouched_prefix_cached_tokens": warm_hit,
    }
    figures["ok"] = (
        failed + same == requests
        and sum(scored_whole) == scored_survivors
        and figures["blocks_leaked"] == 0
        and warm_hit > 0
        and sum(fired.values()) > 0
    )
    return figures


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def kv_resident(engine: AsyncEngine) -> int:
    return engine.stats()["kv_cache_resident_bytes"]


def soak(engine: AsyncEngine, refs: dict[str, list[int]], minutes: float, seed: int) -> dict:
    """Mixed traffic (plain, salted, aborted, timed out) from 4 threads; RSS and the KV cache's
    resident bytes sampled after a warm-up fifth of the time and at the end. A leak is growth of
    the rest: the KV cache grows by design until every block has been used once (a faster engine
    walks more of its free blocks in the same time)."""
    rng = random.Random(seed)
    stop_at = time.monotonic() + minutes * 60
    warm_until = time.monotonic() + minutes * 12
    counts: Counter = Counter()
    lock = threading.Lock()
    baseline: list[int] = []

    def worker(worker_seed: int) -> None:
        local = random.Random(worker_seed)
        while time.monotonic() < stop_at:
            prompt = local.choice(list(refs))
            kind = local.choice(("plain", "salted", "aborted", "timeout"))
            params = greedy(len(refs[prompt]))
            if kind == "salted":
                params = SamplingParams(temperature=0, max_tokens=8, cache_salt=f"t{worker_seed}")
            try:
                stream = engine.generate_stream(
                    prompt, params, timeout=0.05 if kind == "timeout" else TIMEOUT_S
                )
                token_ids = None
                for n, out in enumerate(stream):
                    token_ids = out.outputs[0].token_ids
                    if kind == "aborted" and n == 2:
                        stream.close()
                        break
                if kind == "plain" and token_ids != refs[prompt]:
                    kind = "wrong_text"
            except TimeoutError:
                pass
            except EngineOverloadedError:
                kind = "refused"
            with lock:
                counts[kind] += 1
            if not baseline and time.monotonic() > warm_until:
                with lock:
                    baseline.append(_rss_bytes() - kv_resident(engine))

    threads = [threading.Thread(target=worker, args=(rng.randrange(10**6),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end_kv = kv_resident(engine)
    end_rss = _rss_bytes() - end_kv
    growth = end_rss / baseline[0] - 1 if baseline else 0.0
    figures = {
        "minutes": minutes,
        **dict(counts),
        "rss_mb_after_warmup_less_kv": round((baseline or [end_rss])[0] / 2**20),
        "rss_mb_end_less_kv": round(end_rss / 2**20),
        "rss_growth_pct": round(100 * growth, 2),
        "kv_cache_resident_mb_end": round(end_kv / 2**20),
        "blocks_leaked": blocks_leaked(engine),
    }
    figures["ok"] = growth < 0.05 and figures["blocks_leaked"] == 0 and not counts["wrong_text"]
    return figures


def percentile(values: list, q: int) -> float:
    """Nearest-rank percentile: one of the measured values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(len(ordered) * q / 100), 1) - 1]


def _count_steps(engine: AsyncEngine) -> tuple[dict[str, int], dict[str, int]]:
    """Wrap the engine's step (its own thread calls it) to note per request id how many steps
    had run when it was queued and when its first token came: exact, however late a consumer
    thread reads its stream."""
    inner, queued, first = engine.engine, {}, {}
    step = inner.step

    def counting_step():
        for request_id in inner.parents:
            queued.setdefault(request_id, inner.num_steps)
        outputs = step()
        for out in outputs:
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, inner.num_steps)
        return outputs

    inner.step = counting_step
    return queued, first


def _hol_round(engine: AsyncEngine, rng: random.Random, tag: str) -> tuple[dict, float]:
    """One round: the long prompts, then the short ones, each short one from its own thread.
    Returns each short request's TTFT in seconds, by id, and the seconds until every long
    prompt had its first token."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    shorts = {f"short-{tag}-{i}": ids(HOL_SHORT_TOKENS) for i in range(HOL_SHORTS)}
    start = time.monotonic()
    longs = [engine.generate_stream(ids(HOL_LONG_TOKENS), params) for _ in range(HOL_LONGS)]
    ttfts: dict[str, float] = {}
    long_first: list[float] = []

    def short(request_id: str) -> None:
        submitted = time.monotonic()
        stream = engine.generate_stream(shorts[request_id], params, request_id)
        next(stream)
        ttfts[request_id] = time.monotonic() - submitted
        list(stream)

    def long_one(stream) -> None:
        next(stream)
        long_first.append(time.monotonic() - start)
        list(stream)

    threads = [threading.Thread(target=short, args=(i,)) for i in shorts]
    threads += [threading.Thread(target=long_one, args=(stream,)) for stream in longs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, max(long_first)


def head_of_line(model: str | None, rounds: int, seed: int) -> dict:
    """Short requests behind long prompts, with long prefills uncapped and capped (default)."""
    figures: dict = {}
    ok = True
    for label, threshold in (("cap_off", 0), ("cap_on", EngineConfig.long_prefill_token_threshold)):
        engine = AsyncEngine.from_model(model, long_prefill_token_threshold=threshold)
        queued, first = _count_steps(engine)
        rng = random.Random(seed)
        ttfts, long_seconds = {}, 0.0
        try:
            for r in range(rounds):
                got, seconds = _hol_round(engine, rng, f"{r}")
                ttfts.update(got)
                long_seconds += seconds
            steps = [first[i] - queued[i] for i in ttfts]
            figures[label] = {
                "long_prefill_token_threshold": threshold,
                "short_ttft_s_p50": round(percentile(list(ttfts.values()), 50), 3),
                "short_ttft_s_p99": round(percentile(list(ttfts.values()), 99), 3),
                "short_ttft_steps_p50": percentile(steps, 50),
                "short_ttft_steps_p99": percentile(steps, 99),
                "long_prefill_tok_per_s": round(
                    rounds * HOL_LONGS * HOL_LONG_TOKENS / long_seconds
                ),
                "blocks_leaked": blocks_leaked(engine),
            }
            ok = ok and len(ttfts) == rounds * HOL_SHORTS and not figures[label]["blocks_leaked"]
        finally:
            engine.shutdown()
    figures["setup"] = (
        f"{rounds} rounds of {HOL_LONGS} x {HOL_LONG_TOKENS}-token prompts, then "
        f"{HOL_SHORTS} x {HOL_SHORT_TOKENS}-token ones; max_num_batched_tokens "
        f"{EngineConfig.max_num_batched_tokens}"
    )
    figures["ok"] = ok
    return figures


def _run_one(name: str, refs: dict, args: argparse.Namespace) -> dict:
    model = args.model
    if name == "hol":
        return head_of_line(model, args.hol_rounds, args.seed)
    if name == "overload":
        # KV for ~20 requests (4-token blocks), a queue that refuses the rest of a burst.
        per_request = -(-(max(map(len, refs.values())) + args.max_tokens + 24) // 4)
        engine = AsyncEngine.from_model(
            model, dtype="float32", num_kv_blocks=20 * per_request, max_waiting_requests=128
        )
    else:
        # Batches of at most 8 for the faults: a failed forward fails one batch's requests.
        batch = {"max_num_seqs": 8} if name == "faults" else {}
        engine = AsyncEngine.from_model(model, dtype="float32", num_kv_blocks=4096, **batch)
    try:
        if name == "overload":
            return overload(engine, refs, args.requests, args.max_tokens)
        if name == "cancellations":
            return cancellations(engine, refs, args.streams, args.seed)
        if name == "faults":
            return faults(engine, refs, args.streams, args.seed)
        return soak(engine, refs, args.minutes, args.seed)
    finally:
        engine.shutdown()


SCENARIOS = ("overload", "cancellations", "faults", "soak", "hol")
DEFAULT_SCENARIOS = "overload,cancellations,faults,soak"  # hol is a measurement: ask for it


def run_scenarios(args: argparse.Namespace, echo: bool = False) -> dict:
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"error: unknown scenario {unknown[0]!r} (known: {', '.join(SCENARIOS)})")
    refs = {}
    if set(names) - {"hol"}:
        log(f"greedy references of {len(PROMPTS)} prompts, each alone")
        refs = references(args.model, PROMPTS, args.max_tokens)
    report = {}
    for name in names:
        log(f"{name} started")
        start = time.monotonic()
        report[name] = _run_one(name, refs, args)
        verdict = "ok" if report[name]["ok"] else "FAILED"
        log(f"{name} {verdict} in {time.monotonic() - start:.0f} s")
        if echo:
            print(f"{name}: {report[name]}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--hol-rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run_scenarios(args, echo=not args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    failed = [name for name, figures in report.items() if not figures["ok"]]
    print(
        f"stress: {len(report) - len(failed)} of {len(report)} scenarios ok"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
