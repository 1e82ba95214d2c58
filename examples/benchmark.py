"""Throughput benchmark: paged-backend vs transformers `generate` one request at a time.

Workloads (default model, greedy, EOS ignored so every request makes the same number of tokens):
  rag       32 requests sharing a ~900-token system prompt + retrieved context, distinct questions
  distinct  32 requests with no shared prefix
transformers runs the way HuggingFacePipeline does: one request at a time. It is slow, so it runs
on the first `--hf-requests` requests of each workload and its tokens/s is taken from those.

    python examples/benchmark.py [--workloads rag,distinct] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paged_backend import EngineConfig, LLMEngine, SamplingParams

TOPICS = ["solar panels", "the French revolution", "protein folding", "jazz harmony",
          "volcanoes", "sourdough bread", "black holes", "the Roman roads", "coral reefs",
          "compilers", "honey bees", "glaciers", "chess openings", "the printing press",
          "tea cultivation", "plate tectonics"]


def rag_prompts(tokenizer, n: int, context_tokens: int = 900) -> list[list[int]]:
    passage = (
        "Document {i}: The municipal archive of Lindenfeld was founded in 1873 to preserve the "
        "records of the town council, the parish registers and the guild books. Its reading "
        "room is open to researchers on weekdays, and its collection of maps covers the river "
        "valley from the sixteenth century onwards. "
    )
    context = ""
    i = 0
    while len(tokenizer(context).input_ids) < context_tokens:
        context += passage.format(i=i)
        i += 1
    questions = [f"Question {k}: what does the archive say about {TOPICS[k % len(TOPICS)]}?"
                 for k in range(n)]
    system = "You answer questions using only the retrieved documents.\n\n" + context
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True, return_dict=True,
        )["input_ids"]
        for q in questions
    ]


def distinct_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Request {k}: write a short paragraph about "
              f"{TOPICS[k % len(TOPICS)]}, number {k}, for a school magazine."}],
            add_generation_prompt=True, return_dict=True,
        )["input_ids"]
        for k in range(n)
    ]


def run_ours(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    for p in prompts:
        engine.add_request(None, params, prompt_token_ids=list(p))
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    ttft = sorted(first_token.values())
    return {
        "tokens_per_s": generated / elapsed,
        "elapsed_s": elapsed,
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "max_batch_size": after["max_batch_size"],
    }


def run_transformers(model, prompts: list[list[int]], max_tokens: int) -> dict:
    generated, ttfts = 0, []
    start = time.perf_counter()
    for p in prompts:
        t0 = time.perf_counter()
        ids = torch.tensor([p])
        with torch.no_grad():
            first = model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - t0)
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False)
        assert first.shape[1] == ids.shape[1] + 1
        generated += out.shape[1] - ids.shape[1]
    # The first-token probe ran the prompt twice; count only the full generate calls' time.
    elapsed = time.perf_counter() - start - sum(ttfts)
    return {"tokens_per_s": generated / elapsed, "elapsed_s": elapsed,
            "ttft_median_s": statistics.median(ttfts), "requests": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workloads", default="rag,distinct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=3)
    parser.add_argument("--hf-dtype", default="float32", help="transformers' CPU default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(dtype=args.dtype))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=getattr(torch, args.hf_dtype))
    tok = engine.tokenizer
    results = {}
    for name in args.workloads.split(","):
        prompts = (rag_prompts if name == "rag" else distinct_prompts)(tok, args.requests)
        engine.kv.pool.reset_cache()  # every workload starts cold
        ours = run_ours(engine, prompts, args.max_tokens)
        ref = run_transformers(hf, prompts[: args.hf_requests], args.max_tokens)
        results[name] = {
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "ours": ours,
            "transformers_sequential": ref,
            "speedup": ours["tokens_per_s"] / ref["tokens_per_s"],
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"engine dtype {engine.runner.dtype}, transformers dtype {args.hf_dtype}, "
          f"{torch.get_num_threads()} threads")
    for name, r in results.items():
        o, h = r["ours"], r["transformers_sequential"]
        print(f"[{name}] {args.requests} requests, {r['prompt_tokens_mean']:.0f} prompt tokens, "
              f"{args.max_tokens} new tokens each")
        print(f"  paged-backend : {o['tokens_per_s']:8.1f} tok/s  TTFT median "
              f"{o['ttft_median_s']:.2f}s p90 {o['ttft_p90_s']:.2f}s  prefix-cache hit rate "
              f"{o['prefix_cache_hit_rate']:.1%}  max batch {o['max_batch_size']}")
        print(f"  transformers  : {h['tokens_per_s']:8.1f} tok/s  TTFT median "
              f"{h['ttft_median_s']:.2f}s  (one at a time, {h['requests']} requests)")
        print(f"  speedup       : {r['speedup']:.1f}x")


if __name__ == "__main__":
    main()
