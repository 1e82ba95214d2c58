"""How close a model served quantized comes to the same weights in full precision: top-1
agreement and perplexity, teacher-forced, on held-out text, on the reference's own greedy text
from a few prompts, and on its 2,000 greedy tokens continuing windows of the held-out text (only
those tokens scored).

The reference is `quantization="none"` (a GGUF file dequantized: the values transformers'
conversion gives). `--quantization gguf` (default) serves a GGUF file's blocks as they are,
`--quantization int8` the linears as int8 blocks (Q8_256 or Q8_0, `paged_backend.cpu.quant`);
both quantize activations to int8. Every position of a sequence is scored in one forward pass.

    python examples/quantized_accuracy.py [--model FILE.gguf | DIR] [--quantization gguf|int8]
                                          [--tokens 2000] [--dtype float32] [--llama-cpp]
                                          [--kv-cache-dtype auto|float16|float32]
                                          [--float32]

`--llama-cpp` scores llama-cpp-python on the same GGUF file too (its own kernels, which also
quantize activations), against the same reference: how far a quantized file's own runtime lands.
`--float32` scores the reference's own weights in fp32 too: how far a bf16 reference lands from
them, the noise of the number format alone.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sysconfig
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.config import KV_CACHE_DTYPES
from paged_backend.cpu.features import cpu_description
from paged_backend.default_model import default_model_file
from paged_backend.request import Request

HELD_OUT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"  # Python's license and history
PROMPTS = [
    "Explain how a bill becomes a law in the United States.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the water cycle to a ten-year-old.",
    "What are the trade-offs between renting and buying a home?",
]
CHUNK = 512  # tokens scored per forward pass
WINDOWS = 8  # held-out windows the reference continues greedily, each HELD_OUT_PROMPT tokens
HELD_OUT_PROMPT = 256


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of every position, from one step: the first token as the prompt
    and the rest as drafts to verify, which the runner scores as rows of the same step."""
    runner = llm.engine.runner
    request = Request("score", ids[:1], SamplingParams(max_tokens=1))
    blocks = list(range(-(-len(ids) // runner.block_size)))
    hidden, _, _ = runner.execute([(request, len(ids))], [blocks], {request: ids[1:]})
    return runner.logits(hidden).float()


def _serve_llama_cpp_logits(conn: Connection, path: str, threads: int) -> None:
    """The child process of `llama_cpp_logits`: the logits of each token list it receives,
    until the parent closes its end."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=path,
        n_ctx=CHUNK + 1,
        n_batch=CHUNK,
        logits_all=True,
        n_threads=threads,
        verbose=False,
    )
    while True:
        try:
            ids = conn.recv()
        except EOFError:  # the parent has finished
            return
        llm.reset()
        llm.eval(ids)
        conn.send(np.array(llm.scores[: len(ids)], dtype=np.float32))


def llama_cpp_logits(path: str, threads: int) -> Callable[[list[int]], torch.Tensor]:
    """`all_logits` of llama-cpp-python on the GGUF file at `path`, computed in a process of its
    own: on a CPU with AMX, llama.cpp loads a thread's tile configuration once, and torch's
    oneDNN, running on the same OpenMP threads, releases the tiles after its products, so
    llama.cpp's next product in this process would stop on an illegal instruction."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_serve_llama_cpp_logits, args=(theirs, path, threads))
    child.daemon = True
    child.start()

    def logits(ids: list[int]) -> torch.Tensor:
        ours.send(ids)
        return torch.from_numpy(ours.recv())

    return logits


def compare(
    scorers: dict[str, Callable], sequences: list[list[int]], scored_from: int = 1
) -> dict[str, dict]:
    """Each scorer's top-1 agreement with the first one (the reference) and each one's
    perplexity, over `sequences` read CHUNK tokens at a time, scoring the predictions of their
    tokens from index `scored_from` on (those before it: a prompt, only read)."""
    names = list(scorers)
    agree = dict.fromkeys(names, 0)
    nll = dict.fromkeys(names, 0.0)
    total = 0
    for ids in sequences:
        for start in range(0, len(ids) - 1, CHUNK):
            chunk = ids[start : start + CHUNK + 1]
            skip = max(0, scored_from - 1 - start)  # predictions of tokens before scored_from
            targets = torch.tensor(chunk[1 + skip :])
            logits = {name: scorer(chunk[:-1])[skip:] for name, scorer in scorers.items()}
            top = logits[names[0]].argmax(-1)
            total += len(targets)
            for name, these in logits.items():
                agree[name] += int((these.argmax(-1) == top).sum())
                picked = torch.log_softmax(these, -1).gather(1, targets[:, None])
                nll[name] -= float(picked.sum())
    return {
        name: {"tokens": total, "top1": agree[name] / total, "ppl": math.exp(nll[name] / total)}
        for name in names
    }


def greedy_text(reference: LLM, prompts: list, tokens: int) -> list[list[int]]:
    """Each prompt (a string or token ids) followed by the reference's greedy continuation,
    `tokens` generated in all."""
    greedy = SamplingParams(temperature=0, max_tokens=-(-tokens // len(prompts)), ignore_eos=True)
    as_inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outputs = reference.generate(as_inputs, greedy, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_file()))
    parser.add_argument("--quantization", choices=("gguf", "int8"), default="gguf")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the quantized engine's (auto: float16 for quantized weights in float32)",
    )
    parser.add_argument("--llama-cpp", action="store_true", help="score llama-cpp-python too")
    parser.add_argument("--float32", action="store_true", help="score the weights in fp32 too")
    args = parser.parse_args()
    common = dict(model=args.model, dtype=args.dtype, num_kv_blocks=2 * CHUNK, max_model_len=4096)
    reference = LLM(quantization="none", **common)
    quantized = LLM(
        quantization=None if args.quantization == "gguf" else "int8",
        kv_cache_dtype=args.kv_cache_dtype,
        **common,
    )
    scorers = {
        "reference": partial(all_logits, reference),
        args.quantization: partial(all_logits, quantized),
    }
    if args.llama_cpp:
        scorers["llama.cpp"] = llama_cpp_logits(args.model, torch.get_num_threads())
    if args.float32:
        fp32 = LLM(**{**common, "dtype": "float32"}, quantization="none")
        scorers["float32"] = partial(all_logits, fp32)
    tokenizer = reference.engine.tokenizer
    held_out = tokenizer.encode(HELD_OUT.read_text())
    windows = [held_out[i * len(held_out) // WINDOWS :][:HELD_OUT_PROMPT] for i in range(WINDOWS)]
    print(f"{args.model} on {cpu_description()}, {reference.engine.runner.dtype}")
    measures = (
        ("held-out text", [held_out[: args.tokens + 1]], 1),
        ("greedy text", greedy_text(reference, PROMPTS, args.tokens), 1),
        ("held-out greedy", greedy_text(reference, windows, args.tokens), HELD_OUT_PROMPT),
    )
    for text_name, sequences, scored_from in measures:
        results = compare(scorers, sequences, scored_from)
        ref = results.pop("reference")
        for name, r in results.items():
            print(
                f"{text_name:15s} {name:9s} {r['tokens']:5d} tokens: top-1 agreement "
                f"{r['top1']:.1%}, perplexity {ref['ppl']:.3f} -> {r['ppl']:.3f} "
                f"({r['ppl'] / ref['ppl'] - 1:+.2%})"
            )


if __name__ == "__main__":
    main()
