"""One stream, with and without ngram speculative decoding: output tokens/s of the default model
(greedy) on two workloads, and the acceptance figures of the drafting engine.

  quote     the answer repeats a passage of its prompt (drafts match: the case drafting is for)
  rag       questions over the retrieved documents of `benchmark.py`'s RAG workload, one on each
            of its topics (`--rag-questions`, default all 16: answers differ widely in how much
            they quote, from none to whole passages, so a few questions are a poor sample)
  distinct  prose on a topic that the prompt does not contain (drafts rarely match)
  batch     `--batch` RAG questions at once, `--batch-rounds` times (the per-step rule
            `disable_by_batch_size` keeps large steps from drafting; set it higher with
            `--disable-by-batch-size` to price drafting at that batch size)

Both engines run the same requests, one at a time (but batch), taking turns on each (after a
warm-up request; which goes first alternates), and must give the same tokens; the rate is total
output tokens over total time.

    python examples/speculative_benchmark.py [--k 4] [--lookup-min 2] [--lookup-max 4]
                                             [--requests 3] [--rag-questions 16]
                                             [--max-tokens 96] [--batch 32]
                                             [--batch-rounds 3] [--disable-by-batch-size M]
                                             [--dtype auto] [--threads N] [--llama-cpp]

`--llama-cpp` adds llama-cpp-python on the default model's GGUF file (its Q4_1 weights: other
tokens, so only its rate compares), plain and with its prompt-lookup decoding (k drafts), one
stream: quote, rag and distinct.
"""

from __future__ import annotations

import argparse
import time

import torch
from benchmark import TOPICS as RAG_TOPICS
from benchmark import LlamaCpp, _chat_ids, rag_messages

from paged_backend import LLM, SamplingParams
from paged_backend.cpu.features import cpu_description
from paged_backend.default_model import default_model_file

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


def workloads(n: int, tokenizer, batch: int, questions: int) -> dict[str, list[list[dict]]]:
    quote = [
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{p}"}]
        for p in PASSAGES
    ]
    distinct = [[{"role": "user", "content": f"Write a few paragraphs about {t}."}] for t in TOPICS]
    rag = rag_messages(tokenizer, max(questions, batch))
    loads = {
        "quote": quote[:n],
        "rag": rag[:questions],
        "distinct": distinct[:n],
        "batch": rag[:batch],
    }
    return {name: conversations for name, conversations in loads.items() if conversations}


def run(engines: dict[str, LLM], conversations: list[list[dict]], params, batch_rounds: int = 0):
    """Per engine: (token ids of each answer, seconds of each request, drafted, accepted), one
    request at a time (`batch_rounds`: all at once, that many times), the engines taking turns
    on each request, the first of each turn alternating, so that both see the same load from
    elsewhere."""
    results = {name: ([], [], 0, 0) for name in engines}
    groups = [conversations] * batch_rounds or [[c] for c in conversations]
    for turn, group in enumerate(groups):
        for name, llm in sorted(engines.items(), reverse=turn % 2 == 1):
            before = llm.stats()
            start = time.perf_counter()
            outs = llm.chat(group, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.stats()
            tokens, total, drafted, accepted = results[name]
            results[name] = (
                [*tokens, *(o.outputs[0].token_ids for o in outs)],
                [*total, seconds],
                drafted + after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"],
                accepted + after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"],
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3, help="quote and distinct (at most 3)")
    parser.add_argument(
        "--rag-questions", type=int, default=len(RAG_TOPICS), help="rag requests (one a topic)"
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--batch", type=int, default=32, help="requests of the batch workload (0: none)"
    )
    parser.add_argument("--batch-rounds", type=int, default=3, help="runs of the batch workload")
    parser.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="the per-step rule (default 4)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="num_threads (default: torch's)")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama-cpp-python's rates")
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    common = dict(dtype=args.dtype, num_threads=args.threads)
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = [[{"role": "user", "content": "Say hello."}]]
    run(engines, warm, SamplingParams(temperature=0, max_tokens=8))
    print(f"CPU: {cpu_description()}; dtype {args.dtype}; speculative_config {spec}")
    tokenizer = engines["plain"].get_tokenizer()
    loads = workloads(args.requests, tokenizer, args.batch, args.rag_questions)
    for name, conversations in loads.items():
        rounds = args.batch_rounds if name == "batch" else 0
        results = run(engines, conversations, params, rounds)
        plain, ngram = results["plain"], results["ngram"]
        plain_rate = sum(map(len, plain[0])) / sum(plain[1])
        rate = sum(map(len, ngram[0])) / sum(ngram[1])
        drafted, accepted = ngram[2], ngram[3]
        print(
            f"{name:9s} plain {plain_rate:6.1f} tok/s  ngram {rate:6.1f} tok/s  "
            f"x{rate / plain_rate:.2f}  acceptance {accepted / max(drafted, 1):.2f} "
            f"({accepted}/{drafted} drafts)  identical tokens: {plain[0] == ngram[0]}"
        )
        if len(plain[1]) > 1:
            ratios = sorted(p / n for p, n in zip(plain[1], ngram[1], strict=True))
            each = "per run" if rounds else "per request"
            print(f"{'':9s} {each} x{ratios[0]:.2f} to x{ratios[-1]:.2f}")
        if args.llama_cpp and name != "batch":
            prompts = [_chat_ids(tokenizer, c) for c in conversations]
            print(f"{'':9s} llama-cpp-python {llama_cpp_rates(prompts, args, engines['plain'])}")


def llama_cpp_rates(prompts: list[list[int]], args, llm: LLM) -> str:
    """llama-cpp-python's one-stream rate on `prompts`, plain and with prompt lookup (k drafts),
    each generating `--max-tokens` tokens a prompt."""
    rates = []
    for lookup in (0, args.k):
        peer = LlamaCpp(
            str(default_model_file()),
            llm.engine.eos_token_ids,
            args.threads or torch.get_num_threads(),
            max(map(len, prompts)) + args.max_tokens + args.k + 1,  # drafts past the end
            lookup_tokens=lookup,
        )
        peer.run(prompts[:1], 8)  # warm-up
        start = time.perf_counter()
        outs, _ = peer.run(prompts, args.max_tokens)
        rates.append(sum(map(len, outs)) / (time.perf_counter() - start))
    return f"plain {rates[0]:6.1f} tok/s  lookup {rates[1]:6.1f} tok/s"


if __name__ == "__main__":
    main()
