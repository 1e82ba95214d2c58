"""GPU check of the Triton kernels: the kernel tests compiled on the GPU, then timings and
numerical agreement against the torch code they replace.

Run from the repository root on a CUDA machine (meant to take under 3 minutes on an H200):

    python examples/gpu_check.py --json $OUT/gpu_check.json

Sections (`--sections`, comma-separated; all by default):
  tests    `python -m pytest -q tests/test_kernels.py` in a subprocess, TRITON_INTERPRET unset
  copy     a 1 GiB device-to-device copy: the memory bandwidth actually reachable
  decode   unified_attention vs SDPA over K/V gathered from the paged cache (gather included,
           and timed alone): ms, and K/V bytes read / time against the H200's ~4.8 TB/s
  prefill  4 x 1024 new tokens (causal) and 4 x 512 new tokens over a 2048-token cached prefix
           (SDPA with a mask): ms and TFLOP/s. Without a cached prefix torch needs no gather
           (the torch backend attends to the new K/V): compare with "sdpa ms" there
  cache    reshape_and_cache vs index_copy_
  fused    rms_norm (with residual), rotary_embedding, silu_and_mul vs their torch references
Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and a Llama-3-8B-like model
(32 / 8 / 128); bf16, block_size 16.

Timing: torch.cuda.Event around `--iters` calls, median of `--reps` repetitions, after
`--warmup` calls. The calls are captured in a CUDA graph when possible, so that microsecond
kernels are not measured as Python launch overhead; the eager figures are in the JSON too.
Inputs rotate over up to 8 copies (other cache blocks, for attention) of up to 256 MiB in all,
several times the 60 MB L2, so that bandwidth figures are not cache figures; the 128-token
cache and fused cases stay in L2 regardless: their times are latency. Bandwidth counts the bytes a
kernel must move at least (each input read once, each output written once; for attention the
K/V of every sequence, read once); FLOPs count the causal attention actually needed.

Agreement: attention against a float64 reference (the SDPA result's own error beside it);
the other kernels against their torch reference; reshape_and_cache must match exactly.
Exit code: 0 when every check agrees and the tests pass, 1 otherwise; without CUDA, 2, or 0
with `--allow-no-gpu`. paged_backend need not be installed: this checkout is used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda"
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
SEED = 0
ROTATE_BYTES = 256 * 2**20  # inputs per timed op: > 4 x the H200's 60 MB L2 (at most 8 sets)
MAX_INPUT_SETS = 8
SECTIONS = ("tests", "copy", "decode", "prefill", "cache", "fused")
# Agreement tolerances (those of tests/test_kernels.py for bf16).
ATTN_TOL = {"atol": 2e-2, "rtol": 1e-2}
FUSED_TOL = {"atol": 2e-2, "rtol": 1.6e-2}


# ---- using this checkout ----------------------------------------------------------------------
def use_this_checkout() -> None:
    """Import paged_backend, its Triton kernels included, from this checkout, installed or not."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# ---- model shapes and results -----------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


SMOLLM2 = ModelShape("smollm2", 9, 3, 64, 576, 1536)
LLAMA8B = ModelShape("llama8b", 32, 8, 128, 4096, 14336)
SHAPES = (SMOLLM2, LLAMA8B)
DECODE_BATCHES = (32, 128)
DECODE_CONTEXTS = (1024, 4096)
TOKENS = (128, 4096)  # reshape_and_cache and fused kernels: a decode step, a prefill chunk


@dataclass
class Row:
    """One timed case. Times are milliseconds per call."""

    section: str
    case: str
    kernel_ms: float | None = None
    torch_ms: float | None = None  # the torch path as a whole (gather + SDPA for attention)
    gather_ms: float | None = None  # attention: the gather of K/V from the paged cache alone
    sdpa_ms: float | None = None  # attention: SDPA alone, on K/V gathered beforehand
    kernel_eager_ms: float | None = None
    torch_eager_ms: float | None = None
    timing: str = ""  # "graph" when every figure comes from CUDA graph replays
    nbytes: int = 0  # the fewest bytes the op must move
    flops: int = 0
    gbps: float | None = None  # nbytes / kernel time
    peak_frac: float | None = None  # gbps / peak
    tflops: float | None = None  # flops / kernel time
    torch_tflops: float | None = None  # flops / torch time (SDPA alone for attention)
    max_abs_diff: float | None = None  # kernel vs torch
    kernel_err_f64: float | None = None  # attention: max abs error vs the float64 reference
    torch_err_f64: float | None = None
    ok: bool | None = None
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class TimingOptions:
    warmup: int
    iters: int
    reps: int


@dataclass(frozen=True)
class Timing:
    ms: float  # per call: from graph replays when captured, else eager
    eager_ms: float
    mode: str  # "graph" or "eager"


def input_sets(nbytes: int) -> int:
    """How many copies of an op's inputs to rotate over so that they do not stay in L2."""
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- timing -----------------------------------------------------------------------------------
def median_event_ms(run: Callable[[], object], reps: int) -> float:
    """Median over `reps` of the device time of `run()`, from CUDA events."""
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(loop: Callable[[], None], reps: int) -> float | None:
    """Device time of `loop` replayed as a CUDA graph; None when it cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream before capture, as torch asks
            loop()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop()
        graph.replay()
        torch.cuda.synchronize()
        return median_event_ms(graph.replay, reps)
    except Exception as exc:  # capture is an optimisation: fall back to the eager figure
        print(f"    (no CUDA graph, eager timing: {first_line(str(exc))[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


def time_op(fn: Callable[[int], object], num_sets: int, opts: TimingOptions) -> Timing:
    """Milliseconds per call of `fn(i)`, i cycling over `num_sets` input sets."""

    def loop() -> None:
        for i in range(opts.iters):
            fn(i % num_sets)

    for i in range(max(opts.warmup, num_sets)):  # every set: no compile inside a capture
        fn(i % num_sets)
    torch.cuda.synchronize()
    eager = median_event_ms(loop, opts.reps) / opts.iters
    replayed = graph_ms(loop, opts.reps)
    if replayed is None:
        return Timing(eager, eager, "eager")
    return Timing(replayed / opts.iters, eager, "graph")


def timing_mode(*timings: Timing) -> str:
    modes = {t.mode for t in timings}
    return modes.pop() if len(modes) == 1 else "mixed"


# ---- agreement --------------------------------------------------------------------------------
Tensors = torch.Tensor | tuple[torch.Tensor, ...]


def compare(got: Tensors, want: Tensors, *, atol: float, rtol: float) -> tuple[float, bool]:
    """Max abs difference and whether every element is finite and within tolerance."""
    pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
    diffs, ok = [0.0], True
    for a, b in pairs:
        a64, b64 = a.double(), b.double()
        if a.numel():
            diffs.append((a64 - b64).abs().max().item())
        finite = bool(torch.isfinite(a64).all())
        ok = ok and finite and torch.allclose(a64, b64, atol=atol, rtol=rtol)
    return (math.nan if any(math.isnan(d) for d in diffs) else max(diffs)), ok


# ---- kernel tests -----------------------------------------------------------------------------
PYTEST_BOOTSTRAP = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)
gpu_check.use_this_checkout()
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def parse_pytest_counts(output: str) -> dict[str, int]:
    """Counts from pytest's final summary line ("3 failed, 40 passed, 1 skipped in 9.1s")."""
    pattern = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")
    for line in reversed(output.splitlines()):
        found = pattern.findall(line)
        if found:
            counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
            for number, word in found:
                key = "errors" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(number)
            return counts
    return {}


def run_kernel_tests(timeout_s: float, pytest_args: Sequence[str] = ()) -> dict[str, object]:
    """`python -m pytest -q tests/test_kernels.py` against this checkout, compiled on the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [
        sys.executable,
        "-c",
        PYTEST_BOOTSTRAP,
        str(Path(__file__).resolve()),
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_kernels.py",
        *pytest_args,
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {
            "returncode": None,
            "timed_out": True,
            "seconds": timeout_s,
            "counts": {},
            "ok": False,
            "failures": [],
            "output_tail": out[-4000:],
        }
    output = proc.stdout + proc.stderr
    counts = parse_pytest_counts(proc.stdout)
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    return {
        "returncode": proc.returncode,
        "timed_out": False,
        "seconds": round(time.perf_counter() - start, 1),
        "counts": counts,
        "ok": ok,
        "failures": failures[:30],
        "output_tail": "" if ok else output[-4000:],
    }


# ---- attention --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionCase:
    """`num_seqs` sequences, each with `new` query tokens after `prefix` cached tokens."""

    section: str
    shape: ModelShape
    num_seqs: int
    prefix: int
    new: int

    @property
    def seq_len(self) -> int:
        return self.prefix + self.new

    @property
    def name(self) -> str:
        if self.new == 1:
            return f"{self.shape.name} b{self.num_seqs} ctx{self.seq_len}"
        cached = f"+{self.prefix}" if self.prefix else ""
        return f"{self.shape.name} {self.num_seqs}x{self.new}{cached}"

    @property
    def kv_bytes(self) -> int:
        """K and V of every sequence, read once."""
        s = self.shape
        return 2 * self.num_seqs * self.seq_len * s.num_kv_heads * s.head_dim * DTYPE.itemsize

    @property
    def flops(self) -> int:
        """QK^T and PV over the keys each query sees (causal), 2 FLOPs per multiply-add."""
        visible = self.new * self.prefix + self.new * (self.new + 1) // 2
        return 4 * self.num_seqs * visible * self.shape.num_heads * self.shape.head_dim


def attention_cases() -> list[AttentionCase]:
    cases = [
        AttentionCase("decode", shape, batch, ctx - 1, 1)
        for shape in SHAPES
        for batch in DECODE_BATCHES
        for ctx in DECODE_CONTEXTS
    ]
    for shape in SHAPES:
        cases.append(AttentionCase("prefill", shape, 4, 0, 1024))
        cases.append(AttentionCase("prefill", shape, 4, 2048, 512))  # chunked prefill
    return cases


@dataclass
class PagedInputs:
    q: torch.Tensor  # [num_seqs * new, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: list[torch.Tensor]  # per input set: [num_seqs, blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_inputs(case: AttentionCase) -> PagedInputs:
    """Random K/V for every context position (the new tokens' too, as after reshape_and_cache),
    in shuffled cache blocks; each input set's block table points at other blocks."""
    s = case.shape
    blocks_per_seq = cdiv(case.seq_len, BLOCK_SIZE)
    num_sets = input_sets(case.kv_bytes)
    num_blocks = num_sets * case.num_seqs * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim)
    order = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    tables = order.view(num_sets, case.num_seqs, blocks_per_seq)
    num_tokens = case.num_seqs * case.new
    return PagedInputs(
        q=torch.randn(num_tokens, s.num_heads, s.head_dim, dtype=DTYPE, device=DEVICE),
        k_cache=torch.randn(cache_shape, dtype=DTYPE, device=DEVICE),
        v_cache=torch.randn(cache_shape, dtype=DTYPE, device=DEVICE),
        block_tables=list(tables.unbind(0)),
        query_start_loc=torch.arange(0, num_tokens + 1, case.new, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.full((case.num_seqs,), case.seq_len, dtype=torch.int32, device=DEVICE),
    )


def gather_kv(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The sequences' K (or V) out of the paged cache: [num_seqs, kv_heads, seq_len, head_dim]."""
    num_seqs, blocks = table.shape
    picked = cache.index_select(0, table.reshape(-1))  # [num_seqs * blocks, bs, kvh, d]
    tokens = picked.view(num_seqs, blocks * cache.shape[1], *cache.shape[2:])
    return tokens[:, :seq_len].transpose(1, 2)


def visible_mask(case: AttentionCase) -> torch.Tensor:
    """[new, seq_len] True where query i (at position prefix + i) may see the key."""
    key_pos = torch.arange(case.seq_len, device=DEVICE)
    query_pos = case.prefix + torch.arange(case.new, device=DEVICE)
    return key_pos[None, :] <= query_pos[:, None]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    case: AttentionCase,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """torch SDPA over gathered K/V; q [num_seqs * new, H, D] -> the same shape."""
    s = case.shape
    q4 = q.view(case.num_seqs, case.new, s.num_heads, s.head_dim).transpose(1, 2)
    # is_causal aligns the mask top-left: right for a prefill without a cached prefix only.
    causal = mask is None and case.new > 1
    out = F.scaled_dot_product_attention(
        q4,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=s.num_heads != s.num_kv_heads,
    )
    return out.transpose(1, 2).reshape(q.shape)


def reference_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: AttentionCase
) -> torch.Tensor:
    """Causal attention in float64 with plain matmul + softmax, for the agreement check."""
    s = case.shape
    group = s.num_heads // s.num_kv_heads
    n, new, kvh, d = case.num_seqs, case.new, s.num_kv_heads, s.head_dim
    # Query head h = kv_head * group + g; rows of one KV head ordered (g, query position).
    q64 = (
        q.double()
        .view(n, new, kvh, group, d)
        .permute(0, 2, 3, 1, 4)
        .reshape(n, kvh, group * new, d)
    )
    scores = q64 @ k.double().transpose(-1, -2) * d**-0.5  # [n, kvh, group * new, seq_len]
    scores.masked_fill_(~visible_mask(case).repeat(group, 1), float("-inf"))
    out = scores.softmax(-1) @ v.double()  # [n, kvh, group * new, d]
    return out.view(n, kvh, group, new, d).permute(0, 3, 1, 2, 4).reshape(q.shape)


def bench_attention(case: AttentionCase, opts: TimingOptions, peak_tbps: float) -> Row:
    from paged_backend.attention.triton.attention import unified_attention

    torch.manual_seed(SEED)
    inputs = make_paged_inputs(case)
    num_sets = len(inputs.block_tables)
    scale = case.shape.head_dim**-0.5
    mask = visible_mask(case) if case.prefix > 0 and case.new > 1 else None
    out = torch.empty_like(inputs.q)

    def kernel(i: int) -> torch.Tensor:
        return unified_attention(
            inputs.q,
            inputs.k_cache,
            inputs.v_cache,
            out,
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.block_tables[i],
            scale,
            max_query_len=case.new,
        )

    def gather(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = inputs.block_tables[i]
        return (
            gather_kv(inputs.k_cache, table, case.seq_len),
            gather_kv(inputs.v_cache, table, case.seq_len),
        )

    def torch_path(i: int) -> torch.Tensor:
        return sdpa(inputs.q, *gather(i), case, mask)

    gathered = [gather(i) for i in range(num_sets)]

    def sdpa_only(i: int) -> torch.Tensor:
        return sdpa(inputs.q, *gathered[i], case, mask)

    out.fill_(float("nan"))  # every element must be written
    got = kernel(0).clone()
    want = torch_path(0)
    ref = reference_f64(inputs.q, *gathered[0], case)
    max_abs_diff, _ = compare(got, want, **ATTN_TOL)
    kernel_err, ok = compare(got, ref, **ATTN_TOL)
    torch_err, _ = compare(want, ref, **ATTN_TOL)
    del got, want, ref

    t_kernel = time_op(kernel, num_sets, opts)
    t_torch = time_op(torch_path, num_sets, opts)
    t_gather = time_op(gather, num_sets, opts)
    t_sdpa = time_op(sdpa_only, num_sets, opts)
    return finish(
        Row(
            section=case.section,
            case=case.name,
            kernel_ms=t_kernel.ms,
            torch_ms=t_torch.ms,
            gather_ms=t_gather.ms,
            sdpa_ms=t_sdpa.ms,
            kernel_eager_ms=t_kernel.eager_ms,
            torch_eager_ms=t_torch.eager_ms,
            timing=timing_mode(t_kernel, t_torch, t_gather, t_sdpa),
            nbytes=case.kv_bytes,
            flops=case.flops,
            max_abs_diff=max_abs_diff,
            kernel_err_f64=kernel_err,
            torch_err_f64=torch_err,
            ok=ok,
            extra={
                "input_sets": num_sets,
                "num_seqs": case.num_seqs,
                "prefix": case.prefix,
                "new_tokens": case.new,
                "gather_eager_ms": t_gather.eager_ms,
                "sdpa_eager_ms": t_sdpa.eager_ms,
            },
        ),
        peak_tbps,
    )


# ---- reshape_and_cache and the fused kernels --------------------------------------------------
def cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What the torch backend does: index_copy_ into the flattened slots."""
    kvh, d = k.shape[1:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def bench_reshape_and_cache(
    shape: ModelShape, num_tokens: int, opts: TimingOptions, peak_tbps: float
) -> Row:
    from paged_backend.attention.triton.cache import reshape_and_cache

    torch.manual_seed(SEED)
    kvh, d = shape.num_kv_heads, shape.head_dim
    new_kv_bytes = 2 * num_tokens * kvh * d * DTYPE.itemsize
    num_sets = input_sets(2 * new_kv_bytes)
    num_blocks = cdiv(2 * num_sets * num_tokens, BLOCK_SIZE)  # half the slots get written
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[: num_sets * num_tokens]
    sets = [
        (
            torch.randn(num_tokens, kvh, d, dtype=DTYPE, device=DEVICE),
            torch.randn(num_tokens, kvh, d, dtype=DTYPE, device=DEVICE),
            slots[i * num_tokens : (i + 1) * num_tokens],
        )
        for i in range(num_sets)
    ]
    caches = [
        torch.zeros(num_blocks, BLOCK_SIZE, kvh, d, dtype=DTYPE, device=DEVICE) for _ in range(4)
    ]  # kernel K, V; reference K, V

    def kernel(i: int) -> None:
        k, v, slot_mapping = sets[i]
        reshape_and_cache(k, v, caches[0], caches[1], slot_mapping)

    def reference(i: int) -> None:
        k, v, slot_mapping = sets[i]
        cache_ref(k, v, caches[2], caches[3], slot_mapping)

    kernel(0)
    reference(0)
    diff, _ = compare((caches[0], caches[1]), (caches[2], caches[3]), atol=0.0, rtol=0.0)
    ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    t_kernel = time_op(kernel, num_sets, opts)
    t_torch = time_op(reference, num_sets, opts)
    return finish(
        Row(
            section="cache",
            case=f"reshape_and_cache {shape.name} T{num_tokens}",
            kernel_ms=t_kernel.ms,
            torch_ms=t_torch.ms,
            kernel_eager_ms=t_kernel.eager_ms,
            torch_eager_ms=t_torch.eager_ms,
            timing=timing_mode(t_kernel, t_torch),
            nbytes=2 * new_kv_bytes,
            max_abs_diff=diff,
            ok=ok,
            extra={"input_sets": num_sets},
        ),
        peak_tbps,
    )


def bench_pair(
    section: str,
    case: str,
    kernel: Callable[[int], Tensors],
    reference: Callable[[int], Tensors],
    num_sets: int,
    nbytes: int,
    opts: TimingOptions,
    peak_tbps: float,
) -> Row:
    """Time a kernel and its torch reference over the same input sets; compare on set 0."""
    diff, ok = compare(kernel(0), reference(0), **FUSED_TOL)
    t_kernel = time_op(kernel, num_sets, opts)
    t_torch = time_op(reference, num_sets, opts)
    return finish(
        Row(
            section=section,
            case=case,
            kernel_ms=t_kernel.ms,
            torch_ms=t_torch.ms,
            kernel_eager_ms=t_kernel.eager_ms,
            torch_eager_ms=t_torch.eager_ms,
            timing=timing_mode(t_kernel, t_torch),
            nbytes=nbytes,
            max_abs_diff=diff,
            ok=ok,
            extra={"input_sets": num_sets},
        ),
        peak_tbps,
    )


def bench_rms_norm(
    shape: ModelShape, num_tokens: int, opts: TimingOptions, peak_tbps: float
) -> Row:
    from paged_backend.attention.triton.fused import rms_norm, rms_norm_ref

    torch.manual_seed(SEED)
    eps = 1e-5
    nbytes = 4 * num_tokens * shape.hidden * DTYPE.itemsize  # x, residual in; out, sum out
    num_sets = input_sets(nbytes)
    weight = (1 + 0.1 * torch.randn(shape.hidden, device=DEVICE)).to(DTYPE)
    sets = [
        (
            torch.randn(num_tokens, shape.hidden, dtype=DTYPE, device=DEVICE),
            torch.randn(num_tokens, shape.hidden, dtype=DTYPE, device=DEVICE),
        )
        for _ in range(num_sets)
    ]
    return bench_pair(
        "fused",
        f"rms_norm+residual {shape.name} T{num_tokens}",
        lambda i: rms_norm(sets[i][0], weight, eps, sets[i][1]),
        lambda i: rms_norm_ref(sets[i][0], weight, eps, sets[i][1]),
        num_sets,
        nbytes + shape.hidden * DTYPE.itemsize,
        opts,
        peak_tbps,
    )


def rope_tables(num_tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, head_dim] at random positions (rotate-half layout)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def bench_rotary(shape: ModelShape, num_tokens: int, opts: TimingOptions, peak_tbps: float) -> Row:
    from paged_backend.attention.triton.fused import rotary_embedding, rotary_embedding_ref

    torch.manual_seed(SEED)
    x_bytes = num_tokens * shape.num_heads * shape.head_dim * DTYPE.itemsize
    nbytes = 2 * x_bytes + 2 * num_tokens * shape.head_dim * DTYPE.itemsize  # x, out; cos, sin
    num_sets = input_sets(nbytes)
    sets = [
        (
            torch.randn(num_tokens, shape.num_heads, shape.head_dim, dtype=DTYPE, device=DEVICE),
            *rope_tables(num_tokens, shape.head_dim),
        )
        for _ in range(num_sets)
    ]
    return bench_pair(
        "fused",
        f"rotary q {shape.name} T{num_tokens}",
        lambda i: rotary_embedding(*sets[i]),
        lambda i: rotary_embedding_ref(*sets[i]),
        num_sets,
        nbytes,
        opts,
        peak_tbps,
    )


def bench_silu_and_mul(
    shape: ModelShape, num_tokens: int, opts: TimingOptions, peak_tbps: float
) -> Row:
    from paged_backend.attention.triton.fused import silu_and_mul, silu_and_mul_ref

    torch.manual_seed(SEED)
    nbytes = 3 * num_tokens * shape.intermediate * DTYPE.itemsize  # gate, up in; out
    num_sets = input_sets(nbytes)
    sets = [
        torch.randn(num_tokens, 2 * shape.intermediate, dtype=DTYPE, device=DEVICE)
        for _ in range(num_sets)
    ]
    return bench_pair(
        "fused",
        f"silu_and_mul {shape.name} T{num_tokens}",
        lambda i: silu_and_mul(sets[i]),
        lambda i: silu_and_mul_ref(sets[i]),
        num_sets,
        nbytes,
        opts,
        peak_tbps,
    )


def bench_copy(opts: TimingOptions, peak_tbps: float) -> Row:
    """A 1 GiB device-to-device copy: the bandwidth ceiling as measured, beside the datasheet's."""
    torch.manual_seed(SEED)
    src = torch.randn(2**29, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    timing = time_op(lambda _: dst.copy_(src), 1, opts)
    return finish(
        Row(
            section="copy",
            case="d2d copy 1 GiB",
            kernel_ms=timing.ms,
            kernel_eager_ms=timing.eager_ms,
            timing=timing.mode,
            nbytes=2 * src.numel() * src.element_size(),
            ok=True,
        ),
        peak_tbps,
    )


def finish(row: Row, peak_tbps: float) -> Row:
    """Fill in the rates from the times."""
    if row.kernel_ms:
        seconds = row.kernel_ms * 1e-3
        if row.nbytes:
            row.gbps = row.nbytes / seconds / 1e9
            row.peak_frac = row.gbps / (peak_tbps * 1e3)
        if row.flops:
            row.tflops = row.flops / seconds / 1e12
    torch_ms = row.sdpa_ms or row.torch_ms
    if row.flops and torch_ms:
        row.torch_tflops = row.flops / (torch_ms * 1e-3) / 1e12
    return row


# ---- running the sections ---------------------------------------------------------------------
def section_jobs(section: str) -> list[tuple[str, Callable[[TimingOptions, float], Row]]]:
    """(case label, function) for each case of a section; the label names a failed case."""
    jobs: list[tuple[str, Callable[[TimingOptions, float], Row]]] = []
    if section == "copy":
        jobs.append(("d2d copy", bench_copy))
    elif section in ("decode", "prefill"):
        for case in attention_cases():
            if case.section == section:
                jobs.append((case.name, lambda o, p, c=case: bench_attention(c, o, p)))
    elif section == "cache":
        for shape in SHAPES:
            for tokens in TOKENS:
                jobs.append(
                    (
                        f"reshape_and_cache {shape.name} T{tokens}",
                        lambda o, p, s=shape, t=tokens: bench_reshape_and_cache(s, t, o, p),
                    )
                )
    elif section == "fused":
        for bench in (bench_rms_norm, bench_rotary, bench_silu_and_mul):
            for shape in SHAPES:
                for tokens in TOKENS:
                    jobs.append(
                        (
                            f"{bench.__name__} {shape.name} T{tokens}",
                            lambda o, p, b=bench, s=shape, t=tokens: b(s, t, o, p),
                        )
                    )
    return jobs


def run_job(
    section: str,
    label: str,
    job: Callable[[TimingOptions, float], Row],
    opts: TimingOptions,
    peak_tbps: float,
) -> Row:
    """One case; an exception becomes a failed row, so that the other cases still run."""
    try:
        row = job(opts, peak_tbps)
    except Exception as exc:  # report it and go on: device time is scarce
        traceback.print_exc()
        row = Row(section=section, case=label, ok=False, error=f"{type(exc).__name__}: {exc}")
    torch.cuda.empty_cache()
    print(f"  {row.section:8} {row.case:34} {describe(row)}", flush=True)
    return row


def describe(row: Row) -> str:
    if row.error:
        return f"ERROR {first_line(row.error)[:200]}"
    parts = [f"kernel {fmt(row.kernel_ms, '.4f')} ms"]
    if row.torch_ms is not None:
        parts.append(f"torch {fmt(row.torch_ms, '.4f')} ms")
    if row.max_abs_diff is not None:
        parts.append(f"max|diff| {fmt(row.max_abs_diff, '.1e')}")
    parts.append("ok" if row.ok else "MISMATCH")
    return ", ".join(parts)


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def fmt(value: float | None, spec: str) -> str:
    """`format(value, spec)`, or a dash as wide as the spec asks for None."""
    if value is None:
        width = re.match(r"\d*", spec).group()
        return "-".rjust(int(width or 0))
    return format(value, spec)


def print_table(rows: list[Row], peak_tbps: float) -> None:
    header = (
        f"{'section':8} {'case':32} {'kern ms':>9} {'torch ms':>9} {'gath ms':>8} "
        f"{'sdpa ms':>8} {'x':>5} {'GB/s':>6} {'%peak':>5} {'TFLOP/s':>7} "
        f"{'|k-t|':>7} {'k err':>7} {'t err':>7} ok"
    )
    print(f"\n{header}\n{'-' * len(header)}")
    for r in rows:
        if r.error:
            print(f"{r.section:8} {r.case:32} ERROR {first_line(r.error)[:100]}")
            continue
        speedup = r.torch_ms / r.kernel_ms if r.torch_ms and r.kernel_ms else None
        peak = r.peak_frac * 100 if r.peak_frac is not None else None
        print(
            f"{r.section:8} {r.case:32} {fmt(r.kernel_ms, '9.4f')} {fmt(r.torch_ms, '9.4f')} "
            f"{fmt(r.gather_ms, '8.4f')} {fmt(r.sdpa_ms, '8.4f')} {fmt(speedup, '5.2f')} "
            f"{fmt(r.gbps, '6.0f')} {fmt(peak, '5.1f')} {fmt(r.tflops, '7.1f')} "
            f"{fmt(r.max_abs_diff, '7.1e')} {fmt(r.kernel_err_f64, '7.1e')} "
            f"{fmt(r.torch_err_f64, '7.1e')} {'yes' if r.ok else 'NO'}"
        )
    print(
        f"x: torch ms / kernel ms. GB/s: the op's fewest bytes (attention: K/V read once) / "
        f"kernel time; %peak of {peak_tbps} TB/s. TFLOP/s: causal attention FLOPs / kernel "
        f"time. |k-t|: kernel vs torch; k err, t err: vs a float64 reference."
    )


def device_info() -> dict[str, object]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
    }


def write_json(path: Path | None, report: dict[str, object]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument(
        "--allow-no-gpu", action="store_true", help="exit 0 (not 2) when torch.cuda is unavailable"
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument(
        "--peak-tbps",
        type=float,
        default=4.8,
        help="memory bandwidth of the datasheet, TB/s (H200: 4.8)",
    )
    parser.add_argument(
        "--test-timeout", type=float, default=300.0, help="seconds for the kernel tests"
    )
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"gpu_check: torch.cuda is not available (torch {torch.__version__}): this check "
            "needs a CUDA GPU; nothing was run."
        )
        write_json(args.json, {"cuda_available": False, "torch": torch.__version__})
        return 0 if args.allow_no_gpu else 2

    if os.environ.pop("TRITON_INTERPRET", None) is not None:
        print("gpu_check: ignoring TRITON_INTERPRET: the kernels must compile for the GPU")
    use_this_checkout()
    torch.manual_seed(SEED)
    started = time.perf_counter()
    opts = TimingOptions(warmup=args.warmup, iters=args.iters, reps=args.reps)
    report: dict[str, object] = {
        "cuda_available": True,
        "device": device_info(),
        "peak_tbps": args.peak_tbps,
        "timing": asdict(opts) | {"input_bytes_rotated": ROTATE_BYTES},
        "dtype": str(DTYPE),
        "block_size": BLOCK_SIZE,
        "seed": SEED,
    }
    print(f"gpu_check on {report['device']}", flush=True)

    tests_ok = True
    if "tests" in args.sections:
        print("kernel tests: python -m pytest -q tests/test_kernels.py ...", flush=True)
        tests = run_kernel_tests(args.test_timeout)
        tests_ok = bool(tests["ok"])
        report["tests"] = tests
        print(
            f"  {tests['counts']} rc={tests['returncode']} in {tests['seconds']} s"
            f"{'' if tests_ok else ' FAILED'}",
            flush=True,
        )
        for line in tests["failures"]:
            print(f"  {line}")
        if not tests_ok and tests["output_tail"]:
            print(str(tests["output_tail"])[-2000:])
        write_json(args.json, report)

    rows: list[Row] = []
    for section in args.sections:
        if section == "tests":
            continue
        print(f"{section}:", flush=True)
        for label, job in section_jobs(section):
            rows.append(run_job(section, label, job, opts, args.peak_tbps))
        report["rows"] = [asdict(r) for r in rows]
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_json(args.json, report)

    print_table(rows, args.peak_tbps)
    all_ok = tests_ok and all(r.ok for r in rows)
    report["ok"] = all_ok
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json(args.json, report)
    print(
        f"\n{'all checks agree' if all_ok else 'SOME CHECKS FAILED'}; "
        f"{report['elapsed_s']} s" + (f"; figures in {args.json}" if args.json else "")
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
