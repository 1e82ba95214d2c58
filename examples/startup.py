"""Start-up time with every cache warm: where `LLM()` spends it (phase by phase, then its imports
by package), and the best wall time over --runs fresh processes of `LLM()` and of
`paged-backend generate "Hi" --max-tokens 8`. The first run after a change may fill caches:
run it twice.

    python examples/startup.py [--runs 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict

# (module or class, function, phase): what a start runs, timed where the engine calls it.
PHASES = [
    ("paged_backend.engine", "resolve_model_path", "find the model (GGUF checksum)"),
    ("paged_backend.models.config.ModelConfig", "from_dir", "model config"),
    ("paged_backend.engine", "Tokenizer", "tokenizer"),
    ("paged_backend.cpu", "available", "C library (build or load)"),
    ("paged_backend.model_runner", "native_model_class", "build the modules"),
    ("paged_backend.model_runner", "load_safetensors", "load the weights"),
    ("paged_backend.cpu.kernel_choice", "gemm_max_rows", "kernel choice"),
    ("paged_backend.models.llama.LlamaForCausalLM", "use_cpu_linears_", "pack the linears"),
    ("paged_backend.attention.torch_backend.TorchAttention", "allocate_kv_cache", "KV cache"),
]


def _timed(fn, label: str, totals: dict):
    """`fn`, adding its time to `totals[label]`; a class it returns is timed as it is built."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
        return _timed(result, label, totals) if isinstance(result, type) else result

    return wrapper


def _patch(dotted: str, name: str, label: str, totals: dict) -> None:
    try:
        owner = importlib.import_module(dotted)
    except ModuleNotFoundError:  # a class: patch its raw attribute, so methods still bind
        module, _, cls = dotted.rpartition(".")
        owner = getattr(importlib.import_module(module), cls)
    raw = vars(owner)[name]
    if isinstance(raw, classmethod):
        setattr(owner, name, classmethod(_timed(raw.__func__, label, totals)))
    else:
        setattr(owner, name, _timed(raw, label, totals))


def phases(model: str | None) -> None:
    """In this fresh process: each phase of one `LLM()`, then two generates."""
    start = time.perf_counter()
    from paged_backend import LLM, SamplingParams

    totals: dict[str, float] = defaultdict(float)
    totals["import paged_backend"] = time.perf_counter() - start
    for dotted, name, label in PHASES:
        _patch(dotted, name, label, totals)
    begin = time.perf_counter()
    llm = LLM(model)
    whole = time.perf_counter() - begin
    totals["rest of LLM()"] = whole - (sum(totals.values()) - totals["import paged_backend"])
    totals["LLM() in all"] = whole
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for label in ("first generate (8 tokens)", "second generate"):
        begin = time.perf_counter()
        llm.generate("Hi", params, use_tqdm=False)
        totals[label] = time.perf_counter() - begin
    for label, seconds in totals.items():
        print(f"{label}\t{seconds}")


def best_phases(model: list[str], runs: int) -> dict[str, float]:
    """Each phase's best time over `runs` fresh processes."""
    best: dict[str, float] = {}
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, __file__, "--phases", *model], check=True, stdout=subprocess.PIPE
        ).stdout.decode()
        for label, seconds in (line.split("\t") for line in out.splitlines()):
            best[label] = min(best.get(label, float("inf")), float(seconds))
    return best


def best_imports(code: str, runs: int, top: int = 8) -> dict[str, float]:
    """The packages whose imports take longest (best of `runs` fresh processes running `code`)."""
    best: dict[str, float] = {}
    for _ in range(runs):
        err = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True
        ).stderr
        by_package: dict[str, float] = defaultdict(float)
        for us, name in re.findall(r"import time:\s+(\d+) \|\s+\d+ \|\s+(\S+)", err):
            by_package[f"imports of {name.split('.')[0]}"] += int(us) / 1e6
        for name, seconds in by_package.items():
            best[name] = min(best.get(name, float("inf")), seconds)
    return dict(sorted(best.items(), key=lambda kv: -kv[1])[:top])


def best_wall(command: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phases:
        return phases(args.model)
    model = ["--model", args.model] if args.model else []
    llm_code = f"from paged_backend import LLM; LLM({args.model!r})"
    print(f"| phase of LLM() (best of {args.runs}) | seconds |\n|---|---|")
    rows = best_phases(model, args.runs) | best_imports(llm_code, args.runs)
    for label, seconds in rows.items():
        print(f"| {label} | {seconds:.2f} |")
    cli = shutil.which("paged-backend") or "paged-backend"
    generate = [cli, "generate", "Hi", "--max-tokens", "8", *model]
    print(f"\nbest of {args.runs}, each in a fresh process:")
    print(f"LLM(): {best_wall([sys.executable, '-c', llm_code], args.runs):.2f} s")
    print(f"paged-backend generate 'Hi' --max-tokens 8: {best_wall(generate, args.runs):.2f} s")


if __name__ == "__main__":
    main()
