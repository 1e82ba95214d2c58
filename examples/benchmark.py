"""Performance record: paged-backend against what RAG users would otherwise run.

Workloads (default model, greedy, EOS ignored so every request makes the same number of tokens):
  rag       32 requests arriving together, sharing a ~900-token system prompt + retrieved context
  distinct  32 requests arriving together, ~250-token prompts with no shared prefix
  single    one request at a time (decode speed of a single stream)
  chat      a many-turn chat: each turn's prompt extends the previous turn's prompt and answer
Engines: ours; transformers one request at a time (what HuggingFacePipeline does; slow, so it
runs on the first --hf-requests requests and its rate is taken from those); transformers with all
requests in one left-padded static batch (its best case); llama-cpp-python when it is installed,
on the GGUF file ours runs (--model X.gguf; the default model's by default) or on --gguf X.gguf
while ours runs --model DIR (the same weights as safetensors); vLLM's CPU build when
--vllm-python (or the environment variable PAGED_BACKEND_VLLM_PYTHON) names the Python of a
virtualenv that has it (it runs examples/vllm_peer.py in a subprocess, started and compiled
before anything is timed), on ours' model or on --vllm-model DIR (a GGUF file's bf16 copy).
Every engine runs ours' prompts (token ids; chat: the turn prompts ours built from its answers)
on --threads threads (2 by default). Each engine runs each workload in a Python process of its
own (vLLM: in its own processes), which reports its resident set
before and after building the engine and its peak: weights apart from the KV cache and
activations. Reported: output tokens/s, ratios ours/peer (speed and memory), TTFT median/p90
(from the request's arrival: for a batch workload, the workload's start), prefix-cache hit rate,
RSS, KV slot utilisation, and achieved GFLOP/s against a bf16 matmul peak measured in this run:
over the whole run the linears' and the head's FLOPs (a lower bound), and at batch 32 decode the
model FLOPs of each step (linears, head, and attention over each sequence's context) and the
step's roofline: the larger of those FLOPs at the matmul peak and its bytes (every weight, each
sequence's keys and values) at the memory read rate measured in this run; for each peer also
the share of requests whose first 16 tokens match ours. The CPU's name and features are printed
with the figures.

    python examples/benchmark.py [--workloads rag,distinct,single,chat] [--json] [--threads 2]
                                 [--vllm-python /path/to/vllm-venv/bin/python]
                                 [--model PATH_OR_HUB_ID] [--gguf X.gguf] [--vllm-model DIR]
                                 [--engines ours,ours-transformers]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from paged_backend import EngineConfig, LLMEngine, SamplingParams
from paged_backend.config import KV_CACHE_DTYPES
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.features import cpu_description
from paged_backend.cpu.linear import CpuLinear, can_pack
from paged_backend.cpu.quant import QuantLinear
from paged_backend.default_model import default_model_file
from paged_backend.model_loader import gguf_weights_file, resolve_model_path
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
    """The chat's ids as the engine's chat makes them: the template's text, then `encode` (ours
    renders it without transformers' tokenizer, which a peak would otherwise count)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def rag_messages(tokenizer, n: int, context_tokens: int = 900) -> list[list[dict]]:
    """`n` chat requests sharing a system prompt of ~`context_tokens` retrieved documents, each
    with a question of its own."""
    context, i = "", 0
    while len(tokenizer.encode(context)) < context_tokens:
        context += PASSAGE.format(i=i)
        i += 1
    system = "You answer questions using only the retrieved documents.\n\n" + context
    return [
        [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": f"Question {k}: what does the archive say about "
                f"{TOPICS[k % len(TOPICS)]}?",
            },
        ]
        for k in range(n)
    ]


def rag_prompts(tokenizer, n: int, context_tokens: int = 900) -> list[list[int]]:
    return [_chat_ids(tokenizer, m) for m in rag_messages(tokenizer, n, context_tokens)]


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
    comes first, then editor's notes in an order and with numbers of its own. Encoded as the
    engine encodes a text prompt (`encode`: ours' never loads transformers' tokenizer for it,
    whose import and second copy of the vocabulary a peak would otherwise count)."""
    prompts = []
    for k in range(n):
        text = (
            f"Request {k}: write a short paragraph about {TOPICS[k % len(TOPICS)]}, "
            f"number {k}, for a school magazine.\n"
        )
        order = random.Random(k).sample(range(len(NOTES)), len(NOTES))
        j = 0
        while len(tokenizer.encode(text)) < tokens - 8:
            text += f"Note {k}.{j}: {NOTES[order[j % len(NOTES)]]}\n"
            j += 1
        prompts.append(tokenizer.encode(text + "Answer:"))
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

    def __init__(self, dtype: str, scattered_blocks: bool = False, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        if scattered_blocks:  # free blocks in no order, as a long-running server's pool holds them
            free = self.engine.kv.pool.free_queue
            blocks = list(free.items())
            random.Random(0).shuffle(blocks)
            free.clear()
            free.update(blocks)
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
            # the KV slots' use from the cache itself: `stats()` also counts resident pages
            # (mincore over the weights and the whole cache), ~5 ms, a fifth of a 1B decode step
            slots, stored = engine.kv.usage(engine.scheduler.running)
            if slots:
                self.kv_usage.append(stored / slots)
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
        outs, ttfts, start = [], [], time.perf_counter()
        for p in prompts:  # all arrived at `start`: a request's TTFT counts the ones before it
            ids = torch.tensor([p])
            with torch.no_grad():
                self.model(ids)  # time to first token = one forward over the prompt
                ttfts.append(time.perf_counter() - start)
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
    """llama-cpp-python on a GGUF file, with the benchmark's thread count and a context of
    `n_ctx` tokens (the longest prompt and its answer). It serves one sequence at a time, so a
    batch workload (rag, distinct) runs its requests one after another in their order, all
    arrived at the workload's start (a request's time to first token counts the requests before
    it); each request keeps the KV of the longest prefix it shares with the previous one (RAG's
    shared system prompt and context are computed once) and computes the rest."""

    name = "llama-cpp-python"

    def __init__(
        self, gguf: str, eos_ids: list[int], threads: int, n_ctx: int, lookup_tokens: int = 0
    ) -> None:
        """`lookup_tokens`: draft that many tokens by prompt lookup (llama.cpp's lookup
        decoding, `LlamaPromptLookupDecoding`); 0: none."""
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            logits_all=draft is not None,  # drafts are verified from every position's logits
            verbose=False,
        )
        self.eos_ids = eos_ids
        self.about = {
            "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "n_ctx": self.llm.n_ctx(),
        }

    def run(self, prompts, max_tokens):
        outs, ttfts, start = [], [], time.perf_counter()
        for p in prompts:
            tokens = []
            # reset=True keeps the longest prefix shared with the previous prompt (llama.cpp reuse).
            for tok in self.llm.generate(p, temp=0.0, reset=True, logits_processor=[self._no_eos]):
                if not tokens:
                    ttfts.append(time.perf_counter() - start)
                tokens.append(tok)
                if len(tokens) == max_tokens:
                    break
            outs.append(tokens)
        return outs, ttfts

    def _no_eos(self, _ids, logits):
        logits[self.eos_ids] = -float("inf")
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


def run_vllm(args, replay: dict, model_path: str, dtype: torch.dtype, results: dict) -> None:
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
    peer = VllmPeer(args.vllm_python, model_path, dtype, args.max_tokens)
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
        r["token_agreement"] = token_agreement(w["outputs"], reqs)
        results[name]["vllm"] = r


def token_agreement(outputs: list[list[int]], reqs: list[tuple[list[int], list[int]]]) -> float:
    """The share of `outputs` whose first AGREEMENT_TOKENS tokens are ours' for the same request
    (`reqs`: what ours ran, in order; a peer that ran the first few has as many outputs)."""
    n = AGREEMENT_TOKENS
    return sum(
        list(theirs[:n]) == list(mine[:n])
        for theirs, (_, mine) in zip(outputs, reqs[: len(outputs)], strict=True)
    ) / len(outputs)


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
    """Bytes a decode step must read: (every weight once: the layers' linears and the head, at
    their size in memory: a quantized model's blocks; the keys and values of one context token
    in every layer)."""
    mc = engine.model_config
    size = engine.runner.dtype.itemsize
    weights = (_layer_weights(engine) * mc.num_layers + mc.hidden_size * mc.vocab_size) * size
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if linears:  # blocks, plus any linear left in float
        quantized = sum(m.in_features * m.out_features for m in linears)
        weights += sum(m.nbytes for m in linears) - quantized * size
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
    """Run `prompts`, one request at a time on single and chat, else all at once (the first
    `serial_prompts` of them where given). `prompts` None (ours' chat): build the turns, each
    prompt from the previous answer. Returns (figures, each request's output token ids)."""
    if prompts is None:
        return run_chat(engine, max_tokens)
    if serial_prompts is not None:
        prompts = prompts[:serial_prompts]
    start = time.perf_counter()
    if name in ("single", "chat"):
        outs, ttfts = [], []
        for p in prompts:
            o, t = engine.run([p], max_tokens)
            outs += o
            ttfts += t
    else:
        outs, ttfts = engine.run(prompts, max_tokens)
    return summarize(outs, ttfts, time.perf_counter() - start), outs


def run_chat(engine, max_tokens: int):
    tokenizer = engine.tokenizer
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
    return summarize(outs, ttfts, time.perf_counter() - start), outs


# ---- one process per engine and workload ------------------------------------------------------
def measure_ours(ours: Ours, args, name: str) -> dict:
    """Ours on the workload `name`, with what the parent needs for its rooflines and for the
    peers: the prompts ours ran (chat: the turns it built from its answers), and its outputs."""
    engine, tok = ours.engine, ours.tokenizer
    if name == "rag":
        prompts = rag_prompts(tok, args.requests)
    elif name == "distinct":
        prompts = distinct_prompts(tok, args.requests, args.distinct_tokens)
    elif name == "single":
        prompts = distinct_prompts(tok, 2, tokens=0)
    else:
        prompts = None  # chat
    engine.kv.pool.reset_cache()  # nothing left from the warm-up
    ours.decode_steps.clear()
    ours.kv_usage.clear()
    ours.requests.clear()
    before = engine.stats()
    r, _ = run_workload(ours, name, prompts, args.max_tokens)
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    r["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    r["kv_utilization_min"] = min(ours.kv_usage) if ours.kv_usage else None
    r["kv_utilization_mean"] = statistics.mean(ours.kv_usage) if ours.kv_usage else None
    # The engine's own account: its weights (every copy) and KV cache, and what is resident.
    r["engine_memory_mb"] = {k: v / 2**20 for k, v in after.items() if k.endswith("_bytes")}
    layer_flops, head_flops, _ = flops = model_flops(engine)
    computed = queries - hits + r["output_tokens"]
    # Linears only here (attention over prefills is not counted): a lower bound.
    r["linear_flops"] = computed * layer_flops + r["output_tokens"] * head_flops
    model = engine.runner.model
    native = engine.model_config.impl == "native"  # else transformers' modules
    return {
        "figures": r,
        "replay": ours.requests,
        "big_steps": [s for s in ours.decode_steps if s[0] >= min(32, args.requests)],
        "config": {
            "dtype": str(engine.runner.dtype),
            "model_impl": engine.model_config.impl,
            # (a GGUF's quantized head is a QuantLinear, which packs nothing)
            "packed_weights": native and getattr(model.cpu_head, "packed", None) is not None,
            "block_size": engine.config.block_size,
            "quantization": args.quantization,
            "kv_cache_dtype": str(engine.runner.kv_dtype),
            "cpu_kernels": native and model.layers[0].input_layernorm.norm is cpu_ops.rms_norm,
        },
        "flops": flops,
        "bytes": step_bytes(engine),
        "model_path": str(engine.model_path),
        "eos_ids": list(engine.eos_token_ids),
    }


def measure_peer(peer, args, job: dict) -> dict:
    """A peer on the prompts ours ran, with the share of requests whose first tokens are ours'."""
    reqs = job["replay"]
    slow = isinstance(peer, TransformersSequential) and job["workload"] in ("rag", "distinct")
    serial = args.hf_requests if slow else None  # its rate is taken from the first few
    r, outs = run_workload(peer, job["workload"], [p for p, _ in reqs], args.max_tokens, serial)
    r["token_agreement"] = token_agreement(outs, reqs)
    return {"figures": r, "about": getattr(peer, "about", None)}


def _hf_model(args, job: dict):
    from transformers import AutoModelForCausalLM

    path, kwargs = Path(job["model_path"]), {"dtype": getattr(torch, args.hf_dtype)}
    gguf = gguf_weights_file(path)
    if gguf is not None:  # ours reads a GGUF's weights from the file: transformers dequantizes it
        path, kwargs["gguf_file"] = gguf.parent, gguf.name
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


# Each engine by its key in the results: how its process builds it.
ENGINES = {
    "ours": lambda args, job: Ours(
        args.dtype,
        model=args.model,
        model_impl=args.model_impl,
        num_threads=args.threads,
        pack_weights=False if args.no_pack_weights else None,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        cpu_kernels=False if args.no_cpu_kernels else None,
        scattered_blocks=args.scattered_blocks,
    ),
    "hf_sequential": lambda args, job: TransformersSequential(_hf_model(args, job)),
    "hf_static_batch": lambda args, job: TransformersStaticBatch(
        _hf_model(args, job), job["pad_id"]
    ),
    # The same model through transformers' modules.
    "ours_transformers_impl": lambda args, job: Ours(
        args.dtype, model=args.model, model_impl="transformers", num_threads=args.threads
    ),
    "llama_cpp": lambda args, job: LlamaCpp(
        job["gguf"], job["eos_ids"], args.threads, job["n_ctx"]
    ),
}
# The peers' --engines names, in the order they run.
PEERS = {
    "hf-seq": "hf_sequential",
    "hf-batch": "hf_static_batch",
    "ours-transformers": "ours_transformers_impl",
    "llama-cpp": "llama_cpp",
}


def memory_mb(*fields: str) -> list[float]:
    """Fields of Linux's /proc/self/status, in MB: VmRSS (the resident set now), RssFile (its
    file-backed part: mapped weight files and libraries), VmHWM (the peak so far). Not
    getrusage's ru_maxrss: Linux carries it over exec, so a process spawned by a parent that
    once held more (the read-bandwidth test's tensor) reports the parent's peak."""
    status = Path("/proc/self/status").read_text()
    return [int(re.search(rf"^{f}:\s*(\d+) kB", status, re.M)[1]) / 1024 for f in fields]


WARMUP_PROMPT = list(range(100, 116))


def engine_process(key: str, args, job: dict) -> dict:
    """Build the engine `key` and run the workload job["workload"] on it, in a process of its
    own; its figures get the resident set before the engine is built (Python, torch and this
    script), after it is built (its weights, and what it allocates and writes up front:
    llama.cpp clears its whole KV cache, ours' pages are touched as they fill), the peak while
    building it, and the peak from then on (the workload's KV cache and activations). A short
    request runs first, untimed, as vLLM's peer warms up: every engine starts each workload
    warm."""
    torch.set_num_threads(args.threads)
    start, start_file = memory_mb("VmRSS", "RssFile")
    engine = ENGINES[key](args, job)
    loaded, loaded_file, load_peak = memory_mb("VmRSS", "RssFile", "VmHWM")
    with contextlib.suppress(OSError):  # else the peak below counts the load's too
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from VmRSS (Linux 4.0)
    engine.run([WARMUP_PROMPT], 4)  # first-use costs (lazy set-up, kernel selection): untimed
    if key == "ours":
        out = measure_ours(engine, args, job["workload"])
    else:
        out = measure_peer(engine, args, job)
    (peak,) = memory_mb("VmHWM")
    if key == "ours":  # past the peak: transformers' tokenizer, which only a peer's padding needs
        out["pad_id"] = engine.tokenizer.pad_token_id or 0
    out["figures"]["memory"] = {
        "start_mb": start,
        "loaded_mb": loaded,
        "loaded_file_backed_mb": loaded_file - start_file,  # of loaded - start
        "load_peak_mb": load_peak,
        "peak_mb": peak,
    }
    return out


def in_own_process(key: str, args, job: dict) -> dict:
    """engine_process in a new Python process (spawned: nothing of this one's memory is
    inherited), so that its resident set is that engine's alone. A crash of that process
    raises BrokenProcessPool here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(engine_process, key, args, job).result()


def peer_gguf(args) -> str | None:
    """The GGUF file llama.cpp runs: --gguf, else the file ours runs, if ours runs one."""
    if args.gguf:
        return args.gguf
    if args.model is None:
        return str(default_model_file())
    return args.model if str(args.model).endswith(".gguf") else None


def memory_ratios(ours: dict, peer: dict) -> dict:
    """Ours' memory over a peer's, on what each engine adds to its process's starting resident
    set: once loaded (weights, and what is allocated up front) and at its peak running the
    workload."""
    return {
        f"ours_memory_ratio_{when}": (ours[f"{when}_mb"] - ours["start_mb"])
        / (peer[f"{when}_mb"] - peer["start_mb"])
        for when in ("loaded", "peak")
    }


WORKLOADS = ("rag", "distinct", "single", "chat")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--engines", default="ours,hf-seq,hf-batch,llama-cpp,vllm")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=2, help="threads of every engine (and of the roofs)"
    )
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
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="ours' KV cache (auto: float16 for quantized weights in float32, as llama.cpp)",
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
        "--model",
        default=None,
        help="a model directory, .gguf file or hub id (default: ours); llama.cpp runs the same "
        ".gguf file",
    )
    parser.add_argument(
        "--gguf",
        default=None,
        help="the GGUF file llama.cpp runs, when --model names a directory of the same weights",
    )
    parser.add_argument(
        "--vllm-model",
        default=None,
        help="the model directory vLLM runs (default: ours'), such as the bf16 safetensors copy "
        "of the GGUF file --model names, with the same tokenizer",
    )
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "native", "transformers"],
        help="who runs the layers for ours; the engine ours-transformers runs the same model "
        "through transformers' modules beside it, for the ratio",
    )
    parser.add_argument(
        "--scattered-blocks",
        action="store_true",
        help="ours' free KV blocks shuffled before the workload: a sequence's blocks then lie all "
        "over the cache, as in a long-running server's pool after requests came and went",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    wanted = set(args.engines.split(","))
    torch.set_num_threads(args.threads)  # for the roofs measured here
    # A hub download or GGUF conversion happens here once, not inside an engine's process.
    resolve_model_path(args.model)

    ours = {name: in_own_process("ours", args, {"workload": name}) for name in workloads}
    first = ours[workloads[0]]  # what every workload's process says alike: model, config
    dtype = getattr(torch, first["config"]["dtype"].removeprefix("torch."))
    peak, bandwidth = matmul_peak_gflops(dtype), read_bandwidth_gbps()
    results: dict = {
        "config": {
            **first["config"],
            "threads": args.threads,
            "hf_dtype": args.hf_dtype,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "block_hash_ns_per_token": block_hash_ns_per_token(first["config"]["block_size"]),
            "cpu": cpu_description(),
        }
    }
    for name, out in ours.items():
        r = out["figures"]
        r["gflops_achieved"] = r.pop("linear_flops") / r["elapsed_s"] / 1e9
        results[name] = {"ours": r}

    replay = {name: out["replay"] for name, out in ours.items()}
    longest = max(len(p) for reqs in replay.values() for p, _ in reqs)
    job = {
        "model_path": first["model_path"],
        "pad_id": first["pad_id"],
        "eos_ids": first["eos_ids"],
        "gguf": peer_gguf(args),
        "n_ctx": -(-(longest + args.max_tokens + 1) // 256) * 256,
    }
    for engine, key in PEERS.items():
        if engine not in wanted:
            continue
        if key == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
            results[key] = "not installed (pip install llama-cpp-python)"
            continue
        if key == "llama_cpp" and job["gguf"] is None:
            results[key] = "not run: ours runs no GGUF file; name one with --gguf"
            continue
        for name in workloads:
            if key == "hf_static_batch" and name in ("single", "chat"):
                continue  # one request at a time: same as sequential
            try:
                out = in_own_process(key, args, {**job, "workload": name, "replay": replay[name]})
            except Exception as e:  # a peer that fails (a GGUF llama.cpp refuses) is reported
                results[key] = f"failed on {name}: {type(e).__name__}: {e}"
                break
            r, mine = out["figures"], results[name]["ours"]
            r["ours_speedup"] = mine["tokens_per_s"] / r["tokens_per_s"]
            r.update(memory_ratios(mine["memory"], r["memory"]))
            results[name][key] = r
            if out["about"]:
                results["config"][key] = out["about"]
    if "vllm" in wanted:
        run_vllm(args, replay, args.vllm_model or first["model_path"], dtype, results)

    # The machine's roofs again, after the workloads: the better of the two measurements, so that
    # a neighbour's burst during one of them does not move every roofline below.
    peak = max(peak, matmul_peak_gflops(dtype))
    bandwidth = max(bandwidth, read_bandwidth_gbps())
    results["config"].update(matmul_peak_gflops=peak, read_bandwidth_gbps=bandwidth)
    layer_flops, head_flops, attention_flops = first["flops"]
    weight_bytes, kv_bytes = first["bytes"]
    for name, out in ours.items():
        big = out["big_steps"]
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
        f"quantization {c['quantization']}, KV cache {c['kv_cache_dtype']}, "
        f"C ops {c['cpu_kernels']}; "
        f"transformers {c['hf_dtype']}), "
        f"{c['threads']} threads, "
        f"bf16 matmul peak {c['matmul_peak_gflops']:.0f} GFLOP/s, "
        f"memory read {c['read_bandwidth_gbps']:.0f} GB/s, "
        f"prefix-cache block hashing (SHA-256) {c['block_hash_ns_per_token']:.0f} ns/prompt token"
    )
    if "llama_cpp" in c:
        about = c["llama_cpp"]
        print(
            f"llama-cpp-python {about['version']}, n_ctx {about['n_ctx']}: {about['system_info']}"
        )
    print(
        "Each engine runs each workload in a process of its own. RSS, in MB above what the "
        "process held before (Python, torch, this script: the 'of N'): once the model is loaded "
        "(file: of that, pages of mapped files; and the peak while loading) and the peak from "
        "then on, running the workload"
    )
    for name in workloads:
        print(f"\n[{name}]")
        for key, r in results[name].items():
            m = r.get("memory")
            line = (
                f"  {key:16s} {r['tokens_per_s']:8.1f} tok/s  TTFT median "
                f"{r['ttft_median_s']:6.2f}s p90 {r['ttft_p90_s']:6.2f}s"
            )
            if m:
                line += (
                    f"  RSS loaded +{m['loaded_mb'] - m['start_mb']:.0f} "
                    f"(file {m['loaded_file_backed_mb']:.0f}, loading peak "
                    f"+{m['load_peak_mb'] - m['start_mb']:.0f}) "
                    f"peak +{m['peak_mb'] - m['start_mb']:.0f} (of {m['start_mb']:.0f})"
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
                e = r["engine_memory_mb"]
                line += (
                    f"\n{'':18s} its own account at the end, MB: weights {e['weights_bytes']:.0f} "
                    f"({e['weights_resident_bytes']:.0f} resident), KV cache "
                    f"{e['kv_cache_bytes']:.0f} ({e['kv_cache_resident_bytes']:.0f} resident)"
                )
            else:
                line += f"  ours {r['ours_speedup']:.1f}x"
                if m:
                    line += (
                        f"  ours/peer RSS loaded {r['ours_memory_ratio_loaded']:.2f}x "
                        f"peak {r['ours_memory_ratio_peak']:.2f}x"
                    )
                if "prefix_cache_hit_rate" in r:
                    line += f"  prompt tokens cached {r['prefix_cache_hit_rate']:.1%}"
                if "token_agreement" in r:
                    line += f"  same first {AGREEMENT_TOKENS} tokens {r['token_agreement']:.0%}"
            print(line)
    for key in PEERS.values():
        if isinstance(results.get(key), str):
            print(f"\n{key}: {results[key]}")
    v = results.get("vllm")
    if isinstance(v, str):
        print(f"\nvLLM: {v}")
    elif v:
        print(
            f"\nvLLM {v['version']} (CPU build, {v['dtype']}, {v['threads']} threads): started, "
            f"compiled and warmed up in {v['startup_s']:.0f} s (not timed); prefix cache "
            f"{'reset' if v['prefix_cache_reset'] else 'NOT reset (reset_prefix_cache failed)'} "
            "before each workload; chat replays the turn prompts ours built; its RSS is not "
            "measured (its engine runs in processes of its own)"
        )


if __name__ == "__main__":
    main()
