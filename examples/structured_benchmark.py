"""Throughput cost of constrained decoding (structured output) at batch 32.

The same 32 prompts run greedy for a fixed number of tokens, once unconstrained (EOS ignored) and
once under a JSON schema (a list of records with strings, bounded integers, enums and a pattern).
The model lists records for as long as it may, and the budget guard closes the list in the last
tokens: every request of both runs makes the same number of tokens, so tokens/s compare like for
like, and the constrained run pays for the mask, the forced text and the guard. Runs alternate
and the best of each kind is kept, to damp noise from other work on the machine.

    python examples/structured_benchmark.py [--requests 32] [--max-tokens 128] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import time

from paged_backend import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "array",
    "minItems": 2,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        },
        "required": ["name", "age", "email", "role", "tags"],
    },
}
TOPICS = [
    "a chess club",
    "a bakery",
    "a hospital ward",
    "a jazz band",
    "a school class",
    "a football team",
    "a research lab",
    "a book club",
]


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    """Output tokens per second for the whole batch, and how many outputs parse as JSON."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, sum(
        _parses(o.outputs[0].text) for o in outs
    )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype)
    questions = [
        f"List the members of {TOPICS[i % len(TOPICS)]} (#{i}) as JSON records."
        for i in range(args.requests)
    ]
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    run(llm, prompts[:4], SamplingParams(temperature=0, max_tokens=8))  # warm up
    best = {"plain": 0.0, "constrained": 0.0}
    parsed = []
    for _ in range(args.repeats):
        best["plain"] = max(best["plain"], run(llm, prompts, plain)[0])
        rate, parses = run(llm, prompts, constrained)
        best["constrained"] = max(best["constrained"], rate)
        parsed.append(parses)
    cost = 100 * (1 - best["constrained"] / best["plain"])
    print(f"batch {args.requests}, {args.max_tokens} tokens each, greedy")
    print(f"unconstrained: {best['plain']:8.1f} tok/s")
    print(f"JSON schema:   {best['constrained']:8.1f} tok/s")
    print(f"cost of constrained decoding: {cost:.1f}%")
    print(f"constrained outputs that parse: {sum(parsed)} of {args.requests * args.repeats}")


if __name__ == "__main__":
    main()
