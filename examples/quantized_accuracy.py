"""How close a GGUF file served quantized comes to the same file dequantized: top-1 agreement and
perplexity, teacher-forced, on held-out text and on the dequantized model's own greedy text.

Both engines read the same file: `quantization="none"` dequantizes it (the reference: the values
transformers' conversion gives), the default keeps its block formats and quantizes activations
to int8 (`paged_backend.cpu.quant`). Every position of a sequence is scored in one forward pass.

    python examples/quantized_accuracy.py [--model FILE.gguf] [--tokens 2000] [--dtype float32]
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch

from paged_backend import LLM, SamplingParams
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


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of every position, from one step: the first token as the prompt
    and the rest as drafts to verify, which the runner scores as rows of the same step."""
    runner = llm.engine.runner
    request = Request("score", ids[:1], SamplingParams(max_tokens=1))
    blocks = list(range(-(-len(ids) // runner.block_size)))
    logits, _ = runner.execute([(request, len(ids))], [blocks], {request: ids[1:]})
    return logits.float()


def compare(reference: LLM, quantized: LLM, sequences: list[list[int]]) -> dict:
    agree = total = 0
    nll = {"reference": 0.0, "quantized": 0.0}
    for ids in sequences:
        for start in range(0, len(ids) - 1, CHUNK):
            chunk = ids[start : start + CHUNK + 1]
            ref, ours = all_logits(reference, chunk[:-1]), all_logits(quantized, chunk[:-1])
            targets = torch.tensor(chunk[1:])
            agree += int((ref.argmax(-1) == ours.argmax(-1)).sum())
            total += len(targets)
            for name, logits in (("reference", ref), ("quantized", ours)):
                picked = torch.log_softmax(logits, -1).gather(1, targets[:, None])
                nll[name] -= float(picked.sum())
    ppl = {name: math.exp(value / total) for name, value in nll.items()}
    return {
        "tokens": total,
        "top1_agreement": agree / total,
        **{f"ppl_{k}": v for k, v in ppl.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_file()))
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    common = dict(model=args.model, dtype=args.dtype, num_kv_blocks=2 * CHUNK, max_model_len=4096)
    reference = LLM(quantization="none", **common)
    quantized = LLM(**common)
    tokenizer = reference.engine.tokenizer
    text = tokenizer.encode(HELD_OUT.read_text())[: args.tokens + 1]
    per_prompt = -(-args.tokens // len(PROMPTS))
    greedy = SamplingParams(temperature=0, max_tokens=per_prompt, ignore_eos=True)
    outputs = reference.generate(PROMPTS, greedy, use_tqdm=False)
    own = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    print(f"{args.model} on {cpu_description()}, {reference.engine.runner.dtype}")
    for name, sequences in (("held-out text", [text]), ("greedy text", own)):
        r = compare(reference, quantized, sequences)
        change = r["ppl_quantized"] / r["ppl_reference"] - 1
        print(
            f"{name:14s} {r['tokens']:5d} tokens: top-1 agreement {r['top1_agreement']:.1%}, "
            f"perplexity {r['ppl_reference']:.3f} -> {r['ppl_quantized']:.3f} ({change:+.2%})"
        )


if __name__ == "__main__":
    main()
