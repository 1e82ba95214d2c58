"""Routing policies of the Ray backend on a RAG-shaped workload, and the Ray hop's overhead.

Workload: `--contexts` long shared contexts (retrieved documents), `--requests` questions on
each, arriving interleaved (context 0, 1, 2, 3, 0, 1, ...) and all in flight at once, against
`--replicas` replicas; greedy, `--max-tokens` new tokens each. Per policy, and for one local
engine as the reference: prefix-cache hit rate (the engines' own counters), prompt tokens
prefilled (prompt minus cached tokens), generated tokens per second, and time to first token.
Then one stream through a 1-replica Ray engine against the local engine: milliseconds per token.

    python examples/benchmark_ray.py                                   # 4 x 64, 2 replicas
    python examples/benchmark_ray.py --requests 8 --context-tokens 256 --max-tokens 8

On one machine the replicas share its cores: throughput does not scale here, only the prefill
work saved by routing shows.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import ray

from paged_backend import AsyncEngine, SamplingParams
from paged_backend.distributed import ROUTING_POLICIES, RayEngine

WORDS = ["river", "archive", "harbour", "bakery", "bridge", "orchard", "library", "market"]


def contexts(engine, count: int, tokens: int) -> list[str]:
    """`count` different documents of at least `tokens` tokens each."""
    docs = []
    for c in range(count):
        sentences, i = [f"Document {c}."], 0
        while len(engine.tokenize(" ".join(sentences))) < tokens:
            place = WORDS[(c + i) % len(WORDS)]
            sentences.append(f"The {place} number {i} of town {c} opened in {1800 + i}.")
            i += 1
        docs.append(" ".join(sentences))
    return docs


def workload(docs: list[str], per_context: int, seed: int) -> list[str]:
    """Every context's questions, mixed in a seeded random order: a strict rotation over 4
    contexts would hand round_robin on 2 replicas a perfect placement by accident."""
    prompts = [
        f"{doc}\nQuestion {q}: when did number {q} open?\nAnswer:"
        for q in range(per_context)
        for doc in docs
    ]
    random.Random(seed).shuffle(prompts)
    return prompts


async def run(engine, prompts: list[str], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()

    async def one(prompt: str) -> tuple[float, object]:
        start, first, last = time.perf_counter(), None, None
        async for out in engine.generate(prompt, params):
            first = first or time.perf_counter() - start
            last = out
        return first, last

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    ttfts = sorted(t for t, _ in results)
    outs = [out for _, out in results]
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "prefill": sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs),
        "prompt": sum(len(o.prompt_token_ids) for o in outs),
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "wall": wall,
    }


def per_token_ms(engine, prompt: str, max_tokens: int) -> float:
    """Milliseconds between tokens of one stream (time to first token left out)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    list(engine.generate_stream(prompt, params))  # warm-up
    stamps = [time.perf_counter() for _ in engine.generate_stream(prompt, params)]
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64, help="questions per context")
    parser.add_argument("--context-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES))
    parser.add_argument("--seed", type=int, default=0, help="of the arrival order")
    parser.add_argument("--num-cpus", type=int, default=None, help="local Ray cluster's CPUs")
    args = parser.parse_args()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)

    local = AsyncEngine.from_model(args.model)
    docs = contexts(local, args.contexts, args.context_tokens)
    prompts = workload(docs, args.requests, args.seed)
    print(
        f"{args.contexts} contexts x {args.requests} requests ({len(prompts)}), "
        f"~{args.context_tokens}-token contexts, {args.max_tokens} new tokens each, "
        f"{args.replicas} replicas"
    )
    rows = {"local (1 engine)": asyncio.run(run(local, prompts, args.max_tokens))}
    for policy in args.policies.split(","):
        engine = RayEngine(args.model, num_replicas=args.replicas, routing=policy)
        rows[f"ray {policy}"] = asyncio.run(run(engine, prompts, args.max_tokens))
        print(f"  ({policy} placed: {engine.stats()['routing']})")
        engine.shutdown()
    print(f"{'engine':<24}{'hit rate':>9}  {'prefilled/prompt':<17}{'tok/s':>6}  TTFT p50   p90")
    for name, r in rows.items():
        print(
            f"{name:<24}{r['hit_rate']:>9.1%}  {r['prefill']:>7}/{r['prompt']:<9}"
            f"{r['tok_s']:>6.0f}  {r['ttft_p50']:>7.2f}s {r['ttft_p90']:>5.2f}s"
        )
    if "ray round_robin" in rows and "ray prefix_affinity" in rows:
        ratio = rows["ray round_robin"]["prefill"] / max(1, rows["ray prefix_affinity"]["prefill"])
        print(f"prefix_affinity prefills {ratio:.1f}x fewer prompt tokens than round_robin")

    local.shutdown()
    # The same compute on both sides (one thread each), so that the difference is the hop.
    local = AsyncEngine.from_model(args.model, num_threads=1)
    single = RayEngine(args.model, num_replicas=1, num_threads=1)
    local_ms, ray_ms = per_token_ms(local, prompts[0], 64), per_token_ms(single, prompts[0], 64)
    print(
        f"one stream, 64 tokens, 1 thread: local {local_ms:.1f} ms/token, 1-replica Ray "
        f"{ray_ms:.1f} ms/token ({ray_ms - local_ms:+.1f} ms for the Ray hop)"
    )
    single.shutdown()
    local.shutdown()


if __name__ == "__main__":
    main()
