"""Throughput cost of random sampling against greedy decoding at batch 32.

The same prompts run for a fixed number of tokens (EOS ignored): greedy, sampled at a
temperature, and sampled with top-p (nucleus) and top-k filters, the settings chat pipelines
pass. Sampling work grows with the vocabulary (49,152 tokens on the default model) and the batch,
not with the model, so on a small model it shows most. Runs alternate and the best of each kind
is kept, to damp noise from other work on the machine.

    python examples/sampling_benchmark.py [--requests 32] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

from paged_backend import LLM, SamplingParams

KINDS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 0.7, top_k 50, top_p 0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
}
SUBJECTS = ["a cat", "a lighthouse", "a robot", "a baker", "a river", "a violin", "a map", "a king"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=args.model)
    prompts = [
        f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]}, number {i}."
        for i in range(args.requests)
    ]
    params = {
        kind: SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **settings)
        for kind, settings in KINDS.items()
    }
    llm.generate(prompts[:4], params["greedy"], use_tqdm=False)  # warm-up
    best = dict.fromkeys(KINDS, 0.0)
    for _ in range(args.repeats):
        for kind, p in params.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, p, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best[kind] = max(best[kind], tokens / (time.perf_counter() - start))
    for kind, rate in best.items():
        print(f"{kind:38s} {rate:7.1f} tok/s  {rate / best['greedy']:.2f}x greedy")


if __name__ == "__main__":
    main()
