"""One stream, with and without ngram speculative decoding: output tokens/s of the default model
(greedy) on two workloads, and the acceptance figures of the drafting engine.

  quote     the answer repeats a passage of its prompt (drafts match: the case drafting is for)
  distinct  prose on a topic that the prompt does not contain (drafts rarely match)

Both engines run the same requests one at a time, taking turns on each (after a warm-up request)
and must give the same tokens; the rate is total output tokens over total time.

    python examples/speculative_benchmark.py [--k 4] [--lookup-min 2] [--lookup-max 4]
                                             [--requests 3] [--max-tokens 96] [--dtype auto]
"""

from __future__ import annotations

import argparse
import time

from paged_backend import LLM, SamplingParams
from paged_backend.cpu.features import cpu_description

PASSAGES = [
    "The municipal archive of Lindenfeld was founded in 1873 to preserve the records of the town "
    "council, the parish registers and the guild books. Its reading room is open to researchers "
    "on weekdays, and its collection of maps covers the river valley from the sixteenth century "
    "onwards. In 1921 the archive moved into the former grain exchange on the market square.",
    "Honey bees live in colonies of up to sixty thousand workers, a single queen and a few "
    "hundred drones. Workers build the comb from wax they secrete, gather nectar and pollen, "
    "and cool the hive by fanning their wings. A colony that loses its queen raises a new one "
    "from a young larva fed only on royal jelly.",
    "The printing press that Johannes Gutenberg built in Mainz around 1450 combined movable "
    "metal type, an oil-based ink and a screw press adapted from wine making. His Bible, printed "
    "in about 180 copies, took three years to finish, and within fifty years presses were "
    "running in more than two hundred European towns.",
]
TOPICS = ["the history of tea", "how glaciers move", "a day at a chess tournament"]


def workloads(n: int) -> dict[str, list[list[dict]]]:
    quote = [
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{p}"}]
        for p in PASSAGES
    ]
    distinct = [[{"role": "user", "content": f"Write a few paragraphs about {t}."}] for t in TOPICS]
    return {"quote": quote[:n], "distinct": distinct[:n]}


def run(engines: dict[str, LLM], conversations: list[list[dict]], params: SamplingParams):
    """Per engine: (token ids of each answer, seconds, drafted, accepted), one request at a time,
    the engines taking turns on each request so that both see the same load from elsewhere."""
    results = {name: ([], 0.0, 0, 0) for name in engines}
    for conversation in conversations:
        for name, llm in engines.items():
            before = llm.stats()
            start = time.perf_counter()
            out = llm.chat([conversation], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            after = llm.stats()
            tokens, total, drafted, accepted = results[name]
            results[name] = (
                [*tokens, out.outputs[0].token_ids],
                total + seconds,
                drafted + after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"],
                accepted + after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"],
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3, help="per workload (at most 3)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="num_threads (default: torch's)")
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    common = dict(dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = [[{"role": "user", "content": "Say hello."}]]
    run(engines, warm, SamplingParams(temperature=0, max_tokens=8))
    print(f"CPU: {cpu_description()}; dtype {args.dtype}; speculative_config {spec}")
    for name, conversations in workloads(args.requests).items():
        results = run(engines, conversations, params)
        plain, ngram = results["plain"], results["ngram"]
        plain_rate = sum(map(len, plain[0])) / plain[1]
        rate = sum(map(len, ngram[0])) / ngram[1]
        drafted, accepted = ngram[2], ngram[3]
        print(
            f"{name:9s} plain {plain_rate:6.1f} tok/s  ngram {rate:6.1f} tok/s  "
            f"x{rate / plain_rate:.2f}  acceptance {accepted / max(drafted, 1):.2f} "
            f"({accepted}/{drafted} drafts)  identical tokens: {plain[0] == ngram[0]}"
        )


if __name__ == "__main__":
    main()
