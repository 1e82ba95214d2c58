"""Performance record: paged-backend against what RAG users would otherwise run, in one process.

Workloads (default model, greedy, EOS ignored so every request makes the same number of tokens):
  rag       32 requests arriving together, sharing a ~900-token system prompt + retrieved context
  distinct  32 requests arriving together, ~250-token prompts with no shared prefix
  single    one request at a time (decode speed of a single stream)
  chat      a many-turn chat: each turn's prompt extends the previous turn's prompt and answer
Engines: ours; transformers one request at a time (what HuggingFacePipeline does; slow, so it
runs on the first --hf-requests requests and its rate is taken from those); transformers with all
requests in one left-padded static batch (its best case); llama-cpp-python on the same GGUF when
it is installed; vLLM's CPU build on the same prompts when --vllm-python (or the environment
variable PAGED_BACKEND_VLLM_PYTHON) names the Python of a virtualenv that has it (it runs
examples/vllm_peer.py in a subprocess, started and compiled before anything is timed; the chat
workload replays the turn prompts ours built). Reported: output tokens/s, ratios, TTFT
median/p90, prefix-cache hit rate, peak RSS, KV slot utilisation, and achieved GFLOP/s against a
bf16 matmul peak measured in this run: over the whole run the linears' and the head's FLOPs (a
lower bound), and at batch 32 decode the model FLOPs of each step (linears, head, and attention
over each sequence's context) and the step's roofline: the larger of those FLOPs at the matmul
peak and its bytes (every weight, each sequence's keys and values) at the memory read rate
measured in this run; for vLLM also the share of requests whose first 16 tokens match
ours.

    python examples/benchmark.py [--workloads rag,distinct,single,chat] [--json]
                                 [--vllm-python /path/to/vllm-venv/bin/python]
                                 [--model PATH_OR_HUB_ID] [--engines ours,ours-transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from paged_backend import EngineConfig, LLMEngine, SamplingParams
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.features import cpu_description
from paged_backend.cpu.linear import CpuLinear, can_pack
from paged_backend.default_model import default_model_file
from paged_backend.request import Request

TOPICS = [
    "solar panels",
    "the French revolution",
    "protein folding",
    "jazz harmony",
    "volcanoes",
    "sourdough bread",
    "black holes",
    "the Roman roads",
    "coral reefs",
    "compilers",
    "honey bees",
    "glaciers",
    "chess openings",
    "the printing press",
    "tea cultivation",
    "plate tectonics",
]
PASSAGE = (
    "Document {i}: The municipal archive of Lindenfeld was founded in 1873 to preserve the "
    "records of the town council, the parish registers and the guild books. Its reading room is "
    "open to researchers on weekdays, and its collection of maps covers the river valley from "
    "the sixteenth century onwards. "
)


# ---- workloads --------------------------------------------------------------------------------
def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )


def rag_prompts(tokenizer, n: int, context_tokens: int = 900) -> list[list[int]]:
    context, i = "", 0
    while len(tokenizer(context).input_ids) < context_tokens:
        context += PASSAGE.format(i=i)
        i += 1
    system = "You answer questions using only the retrieved documents.\n\n" + context
    return [
        _chat_ids(
            tokenizer,
            [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": f"Question {k}: what does the archive say about "
                    f"{TOPICS[k % len(TOPICS)]}?",
                },
            ],
        )
        for k in range(n)
    ]


NOTES = [
    "Mention one fact a reader could check in a library.",
    "Keep the sentences short and the tone friendly.",
    "Explain one technical word the way a teacher would.",
    "Give a date or a number where it helps the reader.",
    "End with a question that invites the reader to learn more.",
    "Avoid lists; write connected prose.",
    "Compare the subject with something from everyday life.",
    "Name one person or place linked to the subject.",
    "Say why the subject matters to people today.",
    "Do not repeat the title in the first sentence.",
]


def distinct_prompts(tokenizer, n: int, tokens: int = 250) -> list[list[int]]:
    """`n` prompts of about `tokens` tokens each that share no block: the request's own header
    comes first, then editor's notes in an order and with numbers of its own."""
    prompts = []
    for k in range(n):
        text = (
            f"Request {k}: write a short paragraph about {TOPICS[k % len(TOPICS)]}, "
            f"number {k}, for a school magazine.\n"
        )
        order = random.Random(k).sample(range(len(NOTES)), len(NOTES))
        j = 0
        while len(tokenizer(text).input_ids) < tokens - 8:
            text += f"Note {k}.{j}: {NOTES[order[j % len(NOTES)]]}\n"
            j += 1
        prompts.append(tokenizer(text + "Answer:").input_ids)
    return prompts


CHAT_TURNS = [
    "Hi! I am planning a trip to the mountains.",
    "What should I pack?",
    "How do I stay safe on a glacier?",
    "And what should I eat?",
    "Can you summarize all of that?",
    "Thanks! Any last advice?",
]


# ---- engines ----------------------------------------------------------------------------------
class Ours:
    name = "paged-backend"

    def __init__(self, dtype: str, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        # Decode-only steps: (batch size, seconds, context tokens attended over, summed).
        self.decode_steps: list[tuple[int, float, int]] = []
        self.kv_usage: list[float] = []
        # (prompt, output token ids) of every request run, for peers that replay them.
        self.requests: list[tuple[list[int], list[int]]] = []

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float]]:
        engine = self.engine
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        ids = [engine.add_request(None, params, prompt_token_ids=list(p)) for p in prompts]
        first: dict[str, float] = {}
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            decode_only = (
                all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
                and not engine.scheduler.waiting
            )
            batch = len(engine.scheduler.running)
            context = sum(r.num_tokens for r in engine.scheduler.running)
            t0 = time.perf_counter()
            outs = engine.step()
            if decode_only and batch:
                self.decode_steps.append((batch, time.perf_counter() - t0, context))
            stats = engine.stats()
            if stats["kv_slots_allocated"]:
                self.kv_usage.append(stats["kv_tokens_stored"] / stats["kv_slots_allocated"])
            for out in outs:
                first.setdefault(out.request_id, time.perf_counter() - start)
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        self.requests += [(list(p), list(outputs[i])) for p, i in zip(prompts, ids, strict=True)]
        return [outputs[i] for i in ids], [first[i] for i in ids]


class TransformersSequential:
    name = "transformers (one at a time)"

    def __init__(self, model) -> None:
        self.model = model

    def run(self, prompts, max_tokens):
        outs, ttfts = [], []
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            with torch.no_grad():
                self.model(ids)  # time to first token = one forward over the prompt
                ttfts.append(time.perf_counter() - t0)
                out = self.model.generate(
                    ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
                )
            outs.append(out[0, ids.shape[1] :].tolist())
        return outs, ttfts


class TransformersStaticBatch:
    name = "transformers (padded static batch)"

    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id

    def run(self, prompts, max_tokens):
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        elapsed = time.perf_counter() - t0
        # Every request gets its first token after the whole padded prefill: about one step.
        ttft = elapsed / max_tokens
        return [row[width:].tolist() for row in out], [ttft] * len(prompts)


class LlamaCpp:
    name = "llama-cpp-python"

    def __init__(self, eos_id: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(default_model_file()),
            n_ctx=4096,
            n_threads=torch.get_num_threads(),
            verbose=False,
        )
        self.eos_id = eos_id

    def run(self, prompts, max_tokens):
        outs, ttfts = [], []
        for p in prompts:  # no batching: one request at a time, reusing the previous prefix
            t0 = time.perf_counter()
            tokens = []
            # reset=True keeps the longest prefix shared with the previous prompt (llama.cpp reuse).
            for tok in self.llm.generate(p, temp=0.0, reset=True, logits_processor=[self._no_eos]):
                if not tokens:
                    ttfts.append(time.perf_counter() - t0)
                tokens.append(tok)
                if len(tokens) == max_tokens:
                    break
            outs.append(tokens)
        return outs, ttfts

    def _no_eos(self, _ids, logits):
        logits[self.eos_id] = -float("inf")
        return logits


VLLM_PEER = Path(__file__).resolve().parent / "vllm_peer.py"
VLLM_TIMEOUT_S = 3600
AGREEMENT_TOKENS = 16


class VllmPeer:
    """vLLM's CPU build, in its own virtualenv: examples/vllm_peer.py runs every workload in one
    subprocess (engine start-up, compilation and a warm-up request are not timed) and sends back
    each request's tokens and time to first token."""

    name = "vLLM (CPU)"

    def __init__(self, python: str, model: str, dtype: torch.dtype, max_tokens: int) -> None:
        self.python, self.model, self.max_tokens = python, model, max_tokens
        self.dtype = str(dtype).removeprefix("torch.")
        self.threads = torch.get_num_threads()
        self.log = Path(tempfile.gettempdir()) / "paged_backend_vllm_peer.log"

    def run_all(self, workloads: dict[str, list[list[int]]], serial: list[str]) -> dict:
        """vllm_peer.py's result; RuntimeError with a one-line reason when it fails."""
        job = {
            "model": self.model,
            "dtype": self.dtype,
            "threads": self.threads,
            "max_tokens": self.max_tokens,
            "workloads": workloads,
            "serial": serial,
        }
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        env.pop("OMP_NUM_THREADS", None)  # vllm_peer.py gives vLLM's model `threads` threads
        env["HF_HUB_OFFLINE"] = "1"
        print(
            f"vLLM peer: starting {self.python} (its first start compiles for minutes; "
            f"log: {self.log})",
            file=sys.stderr,
            flush=True,
        )
        try:
            with self.log.open("w") as log:
                proc = subprocess.run(
                    [self.python, str(VLLM_PEER)],
                    input=json.dumps(job),
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                    cwd=tempfile.gettempdir(),
                    timeout=VLLM_TIMEOUT_S,
                )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {VLLM_TIMEOUT_S} s (log: {self.log})") from None
        except OSError as e:
            raise RuntimeError(f"could not start {self.python}: {e}") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()]
            # The exception's own line (vLLM logs its shutdown after it), else the last line.
            errors = [ln for ln in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", ln)]
            last = (errors or [ln for ln in lines if ln] or ["no output"])[-1]
            raise RuntimeError(f"failed (exit {proc.returncode}): {last} (log: {self.log})")
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(f"sent no result (log: {self.log})") from None


def run_vllm(args, ours: Ours, replay: dict[str, list[tuple[list[int], list[int]]]], results):
    """vLLM on the prompts ours ran (chat: the turn prompts ours built), into `results`; a
    one-line reason in results["vllm"] when it cannot run."""
    if not args.vllm_python:
        results["vllm"] = (
            "not run: no vLLM Python given (--vllm-python or PAGED_BACKEND_VLLM_PYTHON; "
            "see docs/benchmark.md)"
        )
        return
    if not Path(args.vllm_python).exists():
        results["vllm"] = f"not run: {args.vllm_python} does not exist"
        return
    peer = VllmPeer(
        args.vllm_python, str(ours.engine.model_path), ours.engine.runner.dtype, args.max_tokens
    )
    serial = [name for name in replay if name in ("single", "chat")]
    try:
        got = peer.run_all({name: [p for p, _ in reqs] for name, reqs in replay.items()}, serial)
    except RuntimeError as e:
        results["vllm"] = f"not run: {e}"
        return
    results["vllm"] = {
        "version": got["vllm_version"],
        "startup_s": got["startup_s"],
        "prefix_cache_reset": got["prefix_cache_reset"],
        "dtype": peer.dtype,
        "threads": peer.threads,
    }
    for name, reqs in replay.items():
        w = got["workloads"][name]
        r = summarize(w["outputs"], w["ttfts"], w["elapsed_s"])
        r["ours_speedup"] = results[name]["ours"]["tokens_per_s"] / r["tokens_per_s"]
        r["prefix_cache_hit_rate"] = (
            w["cached_prompt_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0
        )
        n = AGREEMENT_TOKENS
        r["token_agreement"] = sum(
            list(theirs[:n]) == list(mine[:n])
            for theirs, (_, mine) in zip(w["outputs"], reqs, strict=True)
        ) / len(reqs)
        results[name]["vllm"] = r


# ---- measuring --------------------------------------------------------------------------------
def matmul_peak_gflops(dtype: torch.dtype) -> float:
    """The better of torch's matmul and oneDNN's packed linear (bf16) on a 1024-row product of the
    model's shapes: the most this machine's kernels do here."""
    a, b = torch.randn(1024, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    products = [lambda: a @ b.t()]
    if can_pack(dtype, torch.device("cpu")):
        packed = CpuLinear(b, None, pack=True, fp16_copy=False)
        products.append(lambda: packed(a))
    best = 0.0
    with torch.inference_mode():
        for product in products:
            for _ in range(3):
                product()
            for _ in range(5):  # the best of several short runs: a VM's neighbours come and go
                n, t0 = 20, time.perf_counter()
                for _ in range(n):
                    product()
                best = max(best, 2 * 1024 * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9)
    return best


def read_bandwidth_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """The best rate at which this machine's threads read a large tensor (an fp32 sum: one
    pass over memory, little arithmetic per byte): the memory roof of a decode step."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def _layer_weights(engine: LLMEngine) -> int:
    """Weights of one decoder layer's linears (q, k, v, o, gate, up, down)."""
    mc = engine.model_config
    return (
        mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        + mc.num_heads * mc.head_dim * mc.hidden_size
        + 3 * mc.hidden_size * mc.intermediate_size
    )


def model_flops(engine: LLMEngine) -> tuple[float, float, float]:
    """FLOPs (multiply-adds count 2) of (one token through the decoder layers' linears, one token
    through the output head, one query token attending to one context token in every layer),
    the terms of the usual model-FLOPs count; the embedding lookup is not arithmetic."""
    mc = engine.model_config
    attention = 2 * 2 * mc.num_heads * mc.head_dim * mc.num_layers  # q.k and p.v
    layers = _layer_weights(engine) * mc.num_layers
    return 2.0 * layers, 2.0 * mc.hidden_size * mc.vocab_size, attention


def step_bytes(engine: LLMEngine) -> tuple[float, float]:
    """Bytes a decode step must read: (every weight once: the layers' linears and the head; the
    keys and values of one context token in every layer)."""
    mc = engine.model_config
    size = engine.runner.dtype.itemsize
    weights = (_layer_weights(engine) * mc.num_layers + mc.hidden_size * mc.vocab_size) * size
    return float(weights), 2.0 * mc.num_layers * mc.num_kv_heads * mc.head_dim * size


def summarize(outputs, ttfts, elapsed) -> dict:
    tokens = sum(map(len, outputs))
    ttfts = sorted(ttfts)
    return {
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[round(0.9 * (len(ttfts) - 1))],
    }


def run_workload(engine, name: str, prompts, max_tokens: int, serial_prompts: int | None = None):
    """Run `prompts` (chat: turn by turn, each prompt built from the previous answer)."""
    if name == "chat":
        return run_chat(engine, max_tokens)
    if name == "single":
        outs, ttfts, start = [], [], time.perf_counter()
        for p in prompts:
            o, t = engine.run([p], max_tokens)
            outs += o
            ttfts += t
        return summarize(outs, ttfts, time.perf_counter() - start)
    if serial_prompts is not None:
        prompts = prompts[:serial_prompts]
    start = time.perf_counter()
    outs, ttfts = engine.run(prompts, max_tokens)
    return summarize(outs, ttfts, time.perf_counter() - start)


def run_chat(engine, max_tokens: int) -> dict:
    tokenizer = run_chat.tokenizer
    messages: list[dict] = [{"role": "system", "content": "You are a helpful travel assistant."}]
    outs, ttfts, start = [], [], time.perf_counter()
    for turn in CHAT_TURNS:
        messages.append({"role": "user", "content": turn})
        o, t = engine.run([_chat_ids(tokenizer, messages)], max_tokens)
        outs += o
        ttfts += t
        messages.append(
            {"role": "assistant", "content": tokenizer.decode(o[0], skip_special_tokens=True)}
        )
    return summarize(outs, ttfts, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workloads", default="rag,distinct,single,chat")
    parser.add_argument("--engines", default="ours,hf-seq,hf-batch,llama-cpp,vllm")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--distinct-tokens", type=int, default=250, help="prompt length of the distinct workload"
    )
    parser.add_argument(
        "--hf-requests",
        type=int,
        default=3,
        help="requests transformers runs one at a time (its rate is measured)",
    )
    parser.add_argument("--hf-dtype", default="float32", help="transformers' CPU default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--no-pack-weights",
        action="store_true",
        help="our linears read plain bf16 weights through F.linear (to measure the packing)",
    )
    parser.add_argument(
        "--quantization", default=None, help="int4: our 4-bit copy for steps of 1-4 tokens"
    )
    parser.add_argument(
        "--no-cpu-kernels",
        action="store_true",
        help="ours without the C kernels (fused norm and rotary, decode and shared-prefix "
        "attention), to measure them",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("PAGED_BACKEND_VLLM_PYTHON"),
        help="the Python of a virtualenv with vLLM's CPU build (default: the environment "
        "variable PAGED_BACKEND_VLLM_PYTHON); without it the vllm engine is skipped",
    )
    parser.add_argument(
        "--model", default=None, help="a model directory, .gguf file or hub id (default: ours)"
    )
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "native", "transformers"],
        help="who runs the layers for ours; the engine ours-transformers runs the same model "
        "through transformers' modules beside it, for the ratio",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    wanted = set(args.engines.split(","))

    ours = Ours(
        args.dtype,
        model=args.model,
        model_impl=args.model_impl,
        pack_weights=False if args.no_pack_weights else None,
        quantization=args.quantization,
        cpu_kernels=False if args.no_cpu_kernels else None,
    )
    tok = ours.tokenizer
    run_chat.tokenizer = tok
    prompts = {
        "rag": rag_prompts(tok, args.requests),
        "distinct": distinct_prompts(tok, args.requests, args.distinct_tokens),
        "single": distinct_prompts(tok, 2, tokens=0),
        "chat": None,
    }
    peak = matmul_peak_gflops(ours.engine.runner.dtype)
    bandwidth = read_bandwidth_gbps()
    weight_bytes, kv_bytes = step_bytes(ours.engine)
    model = ours.engine.runner.model
    native = ours.engine.model_config.impl == "native"  # else transformers' modules
    layer_flops, head_flops, attention_flops = model_flops(ours.engine)
    results: dict = {
        "config": {
            "dtype": str(ours.engine.runner.dtype),
            "model_impl": ours.engine.model_config.impl,
            "packed_weights": native
            and model.cpu_head is not None
            and model.cpu_head.packed is not None,
            "block_size": ours.engine.config.block_size,
            "quantization": args.quantization,
            "cpu_kernels": native and model.layers[0].input_layernorm.norm is cpu_ops.rms_norm,
            "threads": torch.get_num_threads(),
            "hf_dtype": args.hf_dtype,
            "matmul_peak_gflops": peak,
            "read_bandwidth_gbps": bandwidth,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "block_hash_ns_per_token": block_hash_ns_per_token(ours.engine.config.block_size),
            "cpu": cpu_description(),
        }
    }
    replay: dict[str, list[tuple[list[int], list[int]]]] = {}  # what ours ran, per workload
    big_steps: dict[str, list[tuple[int, float, int]]] = {}  # decode steps at the full batch
    for name in workloads:
        ours.engine.kv.pool.reset_cache()  # every workload starts cold
        before = ours.engine.stats()
        ours.decode_steps.clear()
        ours.kv_usage.clear()
        ours.requests.clear()
        r = run_workload(ours, name, prompts[name], args.max_tokens)
        after = ours.engine.stats()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        r["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        r["kv_utilization_min"] = min(ours.kv_usage) if ours.kv_usage else None
        r["kv_utilization_mean"] = statistics.mean(ours.kv_usage) if ours.kv_usage else None
        computed = queries - hits + r["output_tokens"]
        # Linears only here (attention over prefills is not counted): a lower bound.
        linear_flops = computed * layer_flops + r["output_tokens"] * head_flops
        r["gflops_achieved"] = linear_flops / r["elapsed_s"] / 1e9
        big_steps[name] = [s for s in ours.decode_steps if s[0] >= min(32, args.requests)]
        results.setdefault(name, {})["ours"] = r
        replay[name] = list(ours.requests)
    # The machine's roofs again, after the workloads: the better of the two measurements, so that
    # a neighbour's burst during one of them does not move every roofline below.
    peak = max(peak, matmul_peak_gflops(ours.engine.runner.dtype))
    bandwidth = max(bandwidth, read_bandwidth_gbps())
    results["config"].update(matmul_peak_gflops=peak, read_bandwidth_gbps=bandwidth)
    for name, big in big_steps.items():
        if not big:
            continue
        r = results[name]["ours"]
        step_flops = [b * (layer_flops + head_flops) + c * attention_flops for b, _, c in big]
        r["decode_step_ms_at_max_batch"] = 1000 * statistics.median(s for _, s, _ in big)
        r["decode_gflops_at_max_batch"] = statistics.median(
            f / s / 1e9 for f, (_, s, _) in zip(step_flops, big, strict=True)
        )
        r["decode_fraction_of_peak"] = r["decode_gflops_at_max_batch"] / peak
        # The step's roofline: the larger of its FLOPs at the matmul peak and its bytes
        # (weights, plus each sequence's keys and values) at the read bandwidth.
        roofs = [
            max(f / (peak * 1e9), (weight_bytes + c * kv_bytes) / (bandwidth * 1e9))
            for f, (_, _, c) in zip(step_flops, big, strict=True)
        ]
        r["decode_roofline_ms"] = 1000 * statistics.median(roofs)
        r["decode_over_roofline"] = statistics.median(
            s / roof for (_, s, _), roof in zip(big, roofs, strict=True)
        )
    results["peak_rss_mb_ours"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    peers = []
    if wanted & {"hf-seq", "hf-batch"}:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            ours.engine.model_path, dtype=getattr(torch, args.hf_dtype)
        ).eval()
        if "hf-seq" in wanted:
            peers.append(("hf_sequential", TransformersSequential(hf), args.hf_requests))
        if "hf-batch" in wanted:
            peers.append(
                ("hf_static_batch", TransformersStaticBatch(hf, tok.pad_token_id or 0), None)
            )
    if "ours-transformers" in wanted:  # the same model through transformers' modules
        through = Ours(args.dtype, model=args.model, model_impl="transformers")
        peers.append(("ours_transformers_impl", through, None))
    if "llama-cpp" in wanted and args.model is not None:
        results["llama_cpp"] = "not run: it runs the default model's GGUF only"
    elif "llama-cpp" in wanted:
        try:
            peers.append(("llama_cpp", LlamaCpp(ours.engine.eos_token_ids[0]), None))
        except ImportError:
            results["llama_cpp"] = "not installed (pip install llama-cpp-python)"
    for key, peer, serial in peers:
        for name in workloads:
            if key == "hf_static_batch" and name in ("single", "chat"):
                continue  # one request at a time: same as sequential
            r = run_workload(
                peer,
                name,
                prompts[name],
                args.max_tokens,
                serial if name in ("rag", "distinct") else None,
            )
            results[name][key] = r
            results[name][key]["ours_speedup"] = (
                results[name]["ours"]["tokens_per_s"] / r["tokens_per_s"]
            )
    if "vllm" in wanted:
        run_vllm(args, ours, replay, results)
    results["peak_rss_mb_total"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, workloads)


def block_hash_ns_per_token(block_size: int, tokens: int = 4096, repeats: int = 20) -> float:
    """What hashing a prompt's blocks for the prefix cache costs per token (the best of
    `repeats`, as the engine computes it on a request's first lookup)."""
    best = float("inf")
    for i in range(repeats):
        request = Request(f"hash-{i}", list(range(i, i + tokens)), SamplingParams())
        start = time.perf_counter()
        request.update_block_hashes(block_size)
        best = min(best, time.perf_counter() - start)
    return best / tokens * 1e9


def print_table(results: dict, workloads: list[str]) -> None:
    c = results["config"]
    print(f"CPU: {c['cpu']}")
    print(
        f"dtype {c['dtype']} ({c['model_impl']} modules, packed weights {c['packed_weights']}, "
        f"block size {c['block_size']}, "
        f"quantization {c['quantization']}, C ops {c['cpu_kernels']}; "
        f"transformers {c['hf_dtype']}), "
        f"{c['threads']} threads, "
        f"bf16 matmul peak {c['matmul_peak_gflops']:.0f} GFLOP/s, "
        f"memory read {c['read_bandwidth_gbps']:.0f} GB/s, "
        f"peak RSS ours {results['peak_rss_mb_ours']:.0f} MB, "
        f"prefix-cache block hashing (SHA-256) {c['block_hash_ns_per_token']:.0f} ns/prompt token"
    )
    for name in workloads:
        print(f"\n[{name}]")
        for key, r in results[name].items():
            line = (
                f"  {key:16s} {r['tokens_per_s']:8.1f} tok/s  TTFT median "
                f"{r['ttft_median_s']:6.2f}s p90 {r['ttft_p90_s']:6.2f}s"
            )
            if key == "ours":
                line += f"  hit rate {r['prefix_cache_hit_rate']:.1%}"
                if r.get("kv_utilization_mean") is not None:
                    line += f"  KV use {r['kv_utilization_mean']:.1%}"
                line += f"  {r['gflops_achieved']:.0f} GFLOP/s"
                if "decode_gflops_at_max_batch" in r:
                    line += (
                        f"  decode@batch {r['decode_step_ms_at_max_batch']:.0f} ms/step "
                        f"{r['decode_fraction_of_peak']:.0%} of peak, roofline "
                        f"{r['decode_roofline_ms']:.0f} ms ({r['decode_over_roofline']:.1f}x)"
                    )
            else:
                line += f"  ours {r['ours_speedup']:.1f}x"
                if "prefix_cache_hit_rate" in r:
                    line += f"  prompt tokens cached {r['prefix_cache_hit_rate']:.1%}"
                if "token_agreement" in r:
                    line += f"  same first {AGREEMENT_TOKENS} tokens {r['token_agreement']:.0%}"
            print(line)
    if isinstance(results.get("llama_cpp"), str):
        print(f"\nllama-cpp-python: {results['llama_cpp']}")
    v = results.get("vllm")
    if isinstance(v, str):
        print(f"\nvLLM: {v}")
    elif v:
        print(
            f"\nvLLM {v['version']} (CPU build, {v['dtype']}, {v['threads']} threads): started, "
            f"compiled and warmed up in {v['startup_s']:.0f} s (not timed); prefix cache "
            f"{'reset' if v['prefix_cache_reset'] else 'NOT reset (reset_prefix_cache failed)'} "
            "before each workload; chat replays the turn prompts ours built"
        )


if __name__ == "__main__":
    main()
