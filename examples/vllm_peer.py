"""vLLM (CPU build) as a peer for examples/benchmark.py, run by vLLM's own Python.

This script never imports paged_backend: it runs in a separate virtualenv that has vLLM. It reads
one JSON job from stdin and writes one JSON result to stdout; everything vLLM and its worker
processes print goes to stderr.

Job:
    {"model": HF directory, "dtype": "bfloat16" | "float32", "threads": int, "max_tokens": int,
     "workloads": {name: [[prompt token ids], ...], ...}, "serial": [names run one at a time]}

Result:
    {"vllm_version": str, "startup_s": float, "prefix_cache_reset": bool,
     "workloads": {name: {"outputs": [[token ids], ...], "ttfts": [s, ...], "elapsed_s": float,
                          "prompt_tokens": int, "cached_prompt_tokens": int}}}

Greedy, EOS ignored, `max_tokens` new tokens per request, prefix caching on (vLLM's default).
The engine is built and warmed up before anything is timed, and its prefix cache is reset
before every workload. Batch workloads submit every request at once; serial ones submit one
request, run it to the end, then the next. The engine is driven step by step
(`LLMEngine.add_request` + `step()`, with `RequestOutputKind.DELTA`), and a request's time to
first token is when its first token comes out of `step()`, counted from the moment the request
was submitted (the workload's start for a batch; the request's own start when serial), as the
benchmark counts it for every other engine.

    echo '{"model": ..., ...}' | /path/to/vllm-venv/bin/python examples/vllm_peer.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    # vLLM logs to stdout, and so do its worker processes: keep the real stdout for the result
    # and point file descriptor 1 (inherited by the workers) at stderr.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    # Run away from the repository, so that nothing in it shadows a package vLLM and its
    # subprocesses import.
    os.chdir(tempfile.gettempdir())
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.path.dirname(__file__))]

    # `threads` OpenMP threads for the model, as the benchmark's other engines use. vLLM sets the
    # model worker's OMP_NUM_THREADS from the CPU list it binds it to, and keeps its scheduler and
    # front-end processes at one torch thread unless OMP_NUM_THREADS is set for all of them, so
    # name the CPUs instead. (Its "auto" binding would keep one core for the scheduler and use one
    # logical CPU per physical core: 1 thread on a 2-core machine.)
    threads = int(job["threads"])
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    max_tokens = int(job["max_tokens"])
    workloads: dict[str, list[list[int]]] = job["workloads"]
    serial = set(job.get("serial", []))
    longest = max((len(p) for ps in workloads.values() for p in ps), default=0)

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job["dtype"],
        max_model_len=longest + max_tokens + 16,
        enable_prefix_caching=True,
        seed=0,
    )
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    counter = iter(range(1 << 62))

    def run(prompts: list[list[int]]) -> tuple[list[list[int]], list[float], list[int]]:
        """All of `prompts` at once: (output ids, seconds to first token, cached prompt tokens)."""
        # Outputs carry the id given here (add_request returns an internal, randomised one).
        ids = [f"r{next(counter)}" for _ in prompts]
        t0 = time.perf_counter()
        for i, p in zip(ids, prompts, strict=True):
            engine.add_request(i, TokensPrompt(prompt_token_ids=p), params)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        first: dict[str, float] = {}
        cached: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].token_ids if out.outputs else []
                if new and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - t0
                tokens[out.request_id].extend(new)
                if out.num_cached_tokens is not None:
                    cached[out.request_id] = out.num_cached_tokens
        return [tokens[i] for i in ids], [first[i] for i in ids], [cached.get(i, 0) for i in ids]

    warm = next((ps[0] for ps in workloads.values() if ps), [1, 2, 3, 4])
    engine.add_request("warmup", TokensPrompt(prompt_token_ids=warm[:16]), params)
    while engine.has_unfinished_requests():
        engine.step()
    startup_s = time.perf_counter() - start

    results, reset_ok = {}, True
    for name, prompts in workloads.items():
        reset_ok = bool(llm.reset_prefix_cache()) and reset_ok  # every workload starts cold
        t0 = time.perf_counter()
        if name in serial:
            outputs, ttfts, cached = [], [], []
            for p in prompts:
                o, t, c = run([p])
                outputs += o
                ttfts += t
                cached += c
        else:
            outputs, ttfts, cached = run(prompts)
        results[name] = {
            "outputs": outputs,
            "ttfts": ttfts,
            "elapsed_s": time.perf_counter() - t0,
            "prompt_tokens": sum(map(len, prompts)),
            "cached_prompt_tokens": sum(cached),
        }
        print(f"vllm_peer: {name} done in {results[name]['elapsed_s']:.2f}s", file=sys.stderr)

    payload = {
        "vllm_version": vllm.__version__,
        "startup_s": startup_s,
        "prefix_cache_reset": reset_ok,
        "workloads": results,
    }
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(payload))
        out.flush()


if __name__ == "__main__":
    main()
