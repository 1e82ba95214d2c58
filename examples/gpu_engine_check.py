"""GPU check of the whole engine: on random-weight models of real head shapes, the Triton backend
(what CUDA picks) gives the torch backend's greedy tokens and transformers' own, through chunked
prefill, prefix-cache hits, preemption and n-gram drafts; bf16 agreement and batch speed beside.

Run from the repository root on a CUDA machine (a few minutes on an H200):

    python examples/gpu_engine_check.py --json $OUT/gpu_engine.json [--tokenizer DIR]

Models (random weights, std 1.6/sqrt(fan-in) so that greedy text varies; the default model's
tokenizer, or `--tokenizer`'s): SmolLM2-135M's heads (9/3 x 64) on 4 layers, Llama-3-8B's
(32/8 x 128), Qwen2.5-0.5B's (14/2 x 64, q/k/v biases), Gemma 2 (head_dim 256, a 48-token
sliding window on alternate layers, scores capped at 5) and Phi-4-mini's partial rotary with
LongRoPE from 64 positions. Each runs one workload: 8 prompts sharing a 300-token prefix, 8
distinct ones of 20-200 tokens and one of ~700, 32 greedy tokens each, `max_num_batched_tokens`
128, KV blocks for about half of it (preemptions). fp32 must give identical tokens on both
backends and transformers' tokens (`--reference-prompts` of them, each alone); a drafting engine
(n-gram, 4 tokens) must give the same. bf16: the share of sequences equal across backends, and
decode tok/s of 64 x 64 tokens on each. Exit code 0 when every fp32 check holds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paged_backend import LLM, SamplingParams  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
NUM_TOKENS = 32
MODELS = {  # name: (architecture, config class, config fields)
    "smollm2": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3),
    ),
    "llama8b-heads": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=2048,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=2,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            hidden_size=896, intermediate_size=1024, num_attention_heads=14, num_key_value_heads=2
        ),
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=256,
            sliding_window=48,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            pad_token_id=0,
        ),
    ),
    "phi4-mini": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            hidden_size=384,
            intermediate_size=768,
            num_attention_heads=6,
            num_key_value_heads=2,
            partial_rotary_factor=0.75,
            pad_token_id=0,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(24)],
                "long_factor": [1.0 + 2.0 * i for i in range(24)],
            },
        ),
    ),
}


def write_model(path: Path, name: str, tokenizer_dir: Path, device: str) -> Path:
    """A random-weight transformers checkpoint of `MODELS[name]`, fp32, with the tokenizer."""
    import transformers

    architecture, config_class, fields = MODELS[name]
    config = getattr(transformers, config_class)(
        **{
            "vocab_size": 49152,
            "num_hidden_layers": 4,
            "max_position_embeddings": 4096,
            "eos_token_id": 2,
            "bos_token_id": 1,
            "tie_word_embeddings": False,
            **fields,
        }
    )
    config.architectures = [architecture]
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.6 / math.sqrt(p.shape[1]))
    model.save_pretrained(path)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, path / file)
    return path


def workload(seed: int = 0) -> list[list[int]]:
    """Token-id prompts: 8 over a shared 300-token prefix, 8 distinct, one long."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 49000, (n,), generator=gen).tolist()

    prefix = ids(300)
    prompts = [prefix + ids(int(n)) for n in torch.randint(5, 40, (8,), generator=gen)]
    prompts += [ids(int(n)) for n in torch.randint(20, 200, (8,), generator=gen)]
    return [*prompts, ids(700)]


def generate(model: Path, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], dict]:
    needed = sum(-(-(len(p) + NUM_TOKENS) // 16) for p in prompts)
    args = dict(block_size=16, num_kv_blocks=needed // 2, max_num_batched_tokens=128)
    start = time.perf_counter()
    llm = LLM(model=str(model), **{**args, **engine_args})
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    del llm
    print(f"  {engine_args}: {time.perf_counter() - start:.1f} s", flush=True)
    return [o.outputs[0].token_ids for o in outputs], stats


def transformers_tokens(model: Path, prompts: list[list[int]], device: str) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(
            ids, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False
        )
        tokens.append(out[0, len(prompt) :].tolist())
    del hf
    return tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Sequences equal, and the first differing position of each that is not."""
    pairs = [(s, t) for s, t in zip(a, b, strict=True) if s != t]
    first = [
        next((i for i, (x, y) in enumerate(zip(s, t, strict=False)) if x != y), len(s))
        for s, t in pairs
    ]
    return {"equal": len(a) - len(pairs), "of": len(a), "first_diffs": first}


def decode_speed(model: Path, backend: str, device: str) -> float:
    """tok/s of 64 prompts x 64 greedy tokens in bf16 (after one warm-up run)."""
    llm = LLM(
        model=str(model),
        device=device,
        dtype="bfloat16",
        attention_backend=backend,
        num_kv_blocks=2048,
    )
    prompts = workload(1)[8:16] * 8
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    del llm
    return round(len(prompts) * 64 / (time.perf_counter() - start), 1)


def check_model(path: Path, reference_prompts: int, device: str) -> dict:
    prompts = workload()
    fp32 = {}
    for backend in ("torch", "triton"):
        fp32[backend], stats = generate(
            path, prompts, device=device, dtype="float32", attention_backend=backend
        )
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    drafted, spec_stats = generate(
        path,
        prompts,
        device=device,
        dtype="float32",
        attention_backend="triton",
        speculative_config=spec,
    )
    half = reference_prompts // 2  # from the shared-prefix ones and from the end (the long one)
    picked = [*range(half), *range(len(prompts) - reference_prompts + half, len(prompts))]
    hf = transformers_tokens(path, [prompts[i] for i in picked], device)
    ours = [fp32["triton"][i] for i in picked]
    bf16 = [
        generate(path, prompts, device=device, dtype="bfloat16", attention_backend=b)[0]
        for b in ("torch", "triton")
    ]
    report = {
        "fp32_triton_vs_torch": agreement(fp32["triton"], fp32["torch"]),
        "fp32_triton_vs_transformers": agreement(ours, hf),
        "fp32_drafted_vs_plain": agreement(drafted, fp32["triton"]),
        "bf16_triton_vs_torch": agreement(*bf16),
        "preemptions": stats["num_preemptions"],
        "prefix_cache_hits": stats["prefix_cache_hits"],
        "accepted_drafts": spec_stats["spec_num_accepted_tokens"],
    }
    report["ok"] = all(
        report[k]["equal"] == report[k]["of"]
        for k in ("fp32_triton_vs_torch", "fp32_triton_vs_transformers", "fp32_drafted_vs_plain")
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a directory with tokenizer.json")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--reference-prompts", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="write the checkpoints here and keep them")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_engine_check: no CUDA device; nothing was run")
        return 2
    if args.tokenizer is None:
        from paged_backend.model_loader import resolve_model_path

        args.tokenizer = resolve_model_path(None)
    root = args.keep or Path(tempfile.mkdtemp(prefix="gpu-engine-check-"))
    gpu = args.device == "cuda"
    report: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "models": {}}
    ok = True
    for name in args.models.split(","):
        start = time.perf_counter()
        try:
            path = write_model(root / name, name, args.tokenizer, args.device)
            row = check_model(path, args.reference_prompts, args.device)
            if gpu:
                speeds = {b: decode_speed(path, b, args.device) for b in ("torch", "triton")}
                row["bf16_decode_tok_s"] = speeds
        except Exception as exc:  # report it and go on: device time is scarce
            import traceback

            traceback.print_exc()
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        row["seconds"] = round(time.perf_counter() - start, 1)
        report["models"][name] = row
        ok = ok and row["ok"]
        print(f"{name}: {json.dumps(row)}", flush=True)
        if args.keep is None:
            shutil.rmtree(root / name, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print("gpu_engine_check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
