"""Which kernel runs a CPU linear at each step size, chosen by timing both on this machine.

fp32 models (CPUs without native bf16) have the same choice between torch's `F.linear` and the
C fp32 linear (`cpu_ops.linear_f32`), timed the same way (`f32_max_rows`). On a 2-core AVX2 Zen 3
the C one wins at every timed step up to 64 rows (the default model's linears at one row: 12.2
against 20.7 ms; at five rows ~1.2x its own one-row time against 51.1 ms), since torch's GEMM
streams the weights slowly below a few dozen rows. Where torch does not win clearly at a
prefill's 256 rows either, the C one serves every step, whatever the smaller counts' timings say
(on a 2-core AVX2 EPYC it matched or beat torch at 512 rows on the default model's linears once
it took a prefill's rows in L2-sized blocks): then a row's bits never depend on its step, and a
prompt's logprobs are the same from the prefix cache, in chunks or in any batch.

Two kernels compute the same exact-bf16-product, fp32-sum linear: oneDNN's packed linear
(`CpuLinear.packed`, AMX tiles where the CPU has them) and the C GEMM (`cpu_ops.gemm`, AVX512-BF16
dot products, or AMX tiles too). Which is faster depends on the CPU and the number of rows: on a
Zen 4 without AMX the C GEMM wins at every step up to 64 rows; on a Xeon with AMX the C GEMM's
vector loop was several times slower than oneDNN from 16 rows, its tiles as fast or faster. So
nothing is assumed: at engine start each of the model's weight shapes is timed
under both kernels at 1-64 rows, and the C GEMM serves a shape up to the largest row count at
which oneDNN does not beat it clearly (and every smaller one). A model that keeps both copies
times its layer shapes at prefill sizes as well (`gemm_prefill_counts`), each count on its own:
there oneDNN's rate moves by 2x from one count to the next, by shape.

A near tie, or a small win, goes to the C kernel. A step of decodes whose layer linears all
run it goes through every layer in one C call (`fused_decode`), which saves ~0.3 ms a layer on
a Zen 4 (Python, dispatch, thread wake-ups) and ~1.6 ms on a 2-core Zen 1 (fp32, batch 32),
more than such a win is worth: torch takes a row count only where it needs less than 90% of
the C kernel's time and saves more than `_TORCH_SAVES_S` a call. Timings here move by ~10%
from run to run: with a 2% margin, the default model's gate/up linear (C and oneDNN within 1%
at 32 rows) flipped between runs, and the whole batch-32 decode step with it (~45 against ~57
ms); with 10% and no floor, the fp32 576x576 linear's 0.39 against 0.45 ms at 32 rows did.

The result is cached per CPU, thread count, torch, C-kernel build and rule under the cache dir,
so later starts read it instead of timing (about a second). Timings taken while other processes
load the machine mislead (a thread of either kernel waits for a core): when others used more
than `_BUSY_SHARE` of the CPUs this engine's threads needed meanwhile, the choice serves this
engine only and is timed again at the next start; a `notice` says so once a process (every
engine start on a busy machine would repeat it). `EngineConfig.cpu_gemm_max_rows` forces a
choice, and deleting `kernel_choice.json` in the cache dir times again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from paged_backend.cpu import library
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.features import cpu_description
from paged_backend.cpu.linear import PREFILL_ROW_COUNTS
from paged_backend.cpu.quant import (
    QuantWeight,
    dequantize,
    linear_blocks_f32,
    quant_gemm_bf16,
    quant_matmul,
    random_blocks,
)
from paged_backend.file_cache import cache_dir, locked, notice

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # the step sizes timed; GEMM_MAX_ROWS is the largest
_REPEATS = 7
# A count's calls stop repeating once they took this long, after at least _MIN_REPEATS: a
# prefill count's take milliseconds each, where their noise is smaller (Qwen2.5-0.5B's layer
# shapes at 128-2,048 rows: 3.7 s of timing at its first start on an AMX Xeon).
_TIMING_BUDGET_S = 0.2
_MIN_REPEATS = 3
_TORCH_WINS = 0.9  # torch (oneDNN, MKL) takes a row count where it needs less than this share of C
# and, where the C kernel would keep a step in one C call (`fused_decode`), saves at least this
# much a call: the one-call step is worth more than a small win of one linear. On a 2-core Zen 1
# the default model's batch-32 step took 184-186 ms fused and 233-253 ms unfused because torch
# won the 576x576 linear at 32 rows (0.39 against 0.45 ms): ~1.6 ms a layer of four linears.
_TORCH_SAVES_S = 0.25e-3
_BUSY_SHARE = 0.15
_CACHE_FILE = "kernel_choice.json"
_INT8_MIN_ROWS = 4  # the int8 product serves at least steps this small (`_time_int8`)
# The int8 product's step sizes timed: prefill chunks too, which its VNNI GEMM can win.
_INT8_ROW_COUNTS = (*ROW_COUNTS, 256)
ALL_ROWS = 1 << 30  # a kernel that wins at every timed count serves every step
# Raised where a choice comes to be timed otherwise (2: the int8 product and the dequantized GEMM
# timed as both fused), so that choices cached under the old way are timed again.
_TIMING_RULES = 2
_EVICT_BYTES = 128 << 20  # read before each cold call: more than a CPU's last-level cache
_F32_WIDE_ROWS = 256  # the fp32 linears' prefill step timed: C serves every step if it keeps up
_F32_WIDE_OUTPUTS = 4096


def gemm_max_rows(shapes: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """For each bf16 weight shape (out, in), the most rows of a step the C GEMM serves (0: none):
    from the cache when this machine timed the shape before, else timed now and cached."""
    return _max_rows(shapes, "", _time_shape)


def gemm_prefill_counts(shapes: set[tuple[int, int]]) -> dict[tuple[int, int], tuple[int, ...]]:
    """For each bf16 layer weight shape (out, in), the prefill step sizes of
    `linear.PREFILL_ROW_COUNTS` at which oneDNN does not beat the C GEMM clearly (each count
    decided on its own: oneDNN's rate there moves by 2x from one count to the next, by shape),
    from the cache or timed now. The output head is not asked: a step's head takes only the
    rows that sample."""
    return _max_rows(shapes, "prefill ", _time_prefill_shape)


def f32_max_rows(shapes: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """For each fp32 weight shape (out, in), the most rows of a step `cpu_ops.linear_f32` serves
    rather than torch's `F.linear` (0: none), as `gemm_max_rows` chooses for bf16."""
    return _max_rows(shapes, "fp32 ", _time_f32_shape)


def f32_block_max_rows(keys: set[tuple[str, int, int]]) -> dict[tuple[str, int, int], int]:
    """For each (block format, out, in) of an fp32 model's GGUF blocks, the most rows of a step
    `quant.linear_blocks_f32` serves rather than `cpu_ops.linear_f32` on the same values (the
    same bits either way): from the cache, or timed now with the weights out of the caches."""
    return _max_rows(keys, "blocks ", _time_block_shape)


def int8_max_rows(linears: dict[tuple, list[QuantWeight]]) -> dict[tuple, int]:
    """For each quantized linear of a bf16 model (keyed by its parts' formats and shapes, flat;
    one linear of those parts in `linears`), the most rows of a step the int8 product
    (`quant.quant_matmul`) serves rather than `quant.quant_gemm_bf16` (the weights dequantized
    to bf16 for the bf16 GEMM), its parts timed together as a step runs them. The dequantized
    GEMM costs more at a few rows (its dequantizing is paid once a step, whatever the rows) and
    ran prefills at ~2x the int8 product's rate on a Zen 4 before that had its VNNI GEMM (now
    0.6-0.8x of it there at 4-256 rows: the int8 product serves every step); on a Xeon with AMX
    its tiles take steps of more than 4-16 rows."""
    return _max_rows(set(linears), "int8 ", lambda *key: _time_int8(linears[key]))


def _time_int8(weights: list[QuantWeight]) -> int:
    """At least `_INT8_MIN_ROWS`: at so few rows a dequantizing win is small where there is one
    (a 1B model's shapes from memory on a Xeon with AMX: 0.9-1.3x the int8 product's time at
    four rows; the int8 product several times faster at one). `ALL_ROWS` where it wins at every
    count (the VNNI GEMM, ~1.3-1.5x the bf16 GEMM at 256 rows on a Zen 4). Both kernels run in
    the one-call decode step (`FusedDecode`), so neither gets its margin (`_TORCH_SAVES_S`):
    with it, the dequantized GEMM could not take a 1B model's attention linears (~0.3-0.8 ms a
    call) at any row count below 32."""
    rows = _rows_c_serves(
        weights[0].in_features,
        torch.bfloat16,
        lambda x: (quant_matmul, x, weights, torch.bfloat16),
        lambda x: (quant_gemm_bf16, x, weights, torch.bfloat16),
        counts=_INT8_ROW_COUNTS,
        fused=False,  # past its int8 rows a quantized linear's dequantized GEMM runs fused too
    )
    return ALL_ROWS if rows == _INT8_ROW_COUNTS[-1] else max(_INT8_MIN_ROWS, rows)


def _max_rows(shapes, kind: str, time_shape) -> dict[tuple[int, int], int]:
    path = cache_dir() / _CACHE_FILE
    key = _machine_key()
    known = _read(path).get(key, {})
    if any(kind + _name(s) not in known for s in shapes):
        with locked(_CACHE_FILE):
            entries = _read(path)  # another process may have timed some meanwhile
            timed = dict(entries.get(key, {}))
            before = _cpu_seconds()
            for shape in sorted(s for s in shapes if kind + _name(s) not in timed):
                timed[kind + _name(shape)] = rows = time_shape(*shape)
                logger.info("%slinear %s: the C kernel serves steps of %s rows", kind, shape, rows)
            others = _others_share(before, _cpu_seconds())
            if others > _BUSY_SHARE:
                notice(
                    f"other programs kept {others:.0%} of the CPUs busy while the engine picked "
                    "its fastest CPU kernels; the pick may be off, so it is not saved and later "
                    "starts pick again (answers do not change, only speed)",
                    once="busy kernel timing",
                )
            else:
                entries[key] = timed
                _write(path, entries)
            known = timed
    # (a tuple of counts comes back from JSON as a list)
    return {s: _tuple_if_list(known[kind + _name(s)]) for s in shapes}


def _tuple_if_list(value):
    return tuple(value) if isinstance(value, list) else value


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, CPU seconds every process ran, CPU seconds this process ran), or None
    where /proc/stat does not exist."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and waiting for I/O
    own = os.times()
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, own.user + own.system


def _others_share(before, after) -> float:
    """The share of the CPUs this process's threads needed that other processes used between
    two `_cpu_seconds` readings: what they ran on the CPUs left over (timing on 1 of 2 cores
    beside a test worker on the other) does not count."""
    if before is None or after is None or after[0] <= before[0]:
        return 0.0
    cpus = os.cpu_count() or 1
    spare = max(cpus - torch.get_num_threads(), 0)
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(others / (after[0] - before[0]) - spare, 0.0) / (cpus - spare)


def _time_shape(n: int, k: int) -> int:
    """The largest row count up to which oneDNN beats the C GEMM clearly at no timed count."""
    return _rows_c_serves(k, torch.bfloat16, *_bf16_calls(n, k))


def _time_prefill_shape(n: int, k: int) -> tuple[int, ...]:
    """`gemm_prefill_counts` for one shape."""
    calls = _bf16_calls(n, k)
    return tuple(
        rows
        for rows in PREFILL_ROW_COUNTS
        # prefill steps run the modules: no one-call step to keep (`fused`)
        if _rows_c_serves(k, torch.bfloat16, *calls, counts=(rows,), fused=False)
    )


def _bf16_calls(n: int, k: int) -> tuple:
    """The C GEMM's and oneDNN's calls (built for an input x) on one random bf16 weight [n, k],
    each in the layout it reads (`_rows_c_serves`' `c_call`, `torch_call`)."""
    weight = torch.randn(n, k).to(torch.bfloat16)
    gemm_weight = cpu_ops.pack_gemm_weight(weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return (
        lambda x: (cpu_ops.gemm, x, gemm_weight, torch.bfloat16),
        lambda x: (torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
    )


def _time_f32_shape(n: int, k: int) -> int:
    """`ALL_ROWS` where torch's fp32 linear does not beat `linear_f32` clearly at a prefill's
    `_F32_WIDE_ROWS` (timed on at most `_F32_WIDE_OUTPUTS` of the outputs: both kernels take
    outputs in independent tiles, and a head's 49,152 at 256 rows took ~0.3 s a call on a
    2-core Zen): a row's bits then never depend on its step (prefix-cache hits, chunks and
    batches give the same logits), worth more than a near tie at some smaller count, which a
    2-core VM's timings flip from run to run. Else the largest row count up to which torch
    beats it clearly at no timed count."""

    def rows_c_serves(outputs: int, counts: tuple[int, ...]) -> int:
        weight = torch.randn(outputs, k)
        return _rows_c_serves(
            k,
            torch.float32,
            lambda x: (cpu_ops.linear_f32, x, weight, None),
            lambda x: (torch.nn.functional.linear, x, weight),
            counts=counts,
        )

    if rows_c_serves(min(n, _F32_WIDE_OUTPUTS), (_F32_WIDE_ROWS,)):
        return ALL_ROWS
    return rows_c_serves(n, ROW_COUNTS)  # the whole weight only where it is needed


def _time_block_shape(fmt: str, n: int, k: int) -> int:
    """The largest row count up to which `linear_f32` beats `linear_blocks_f32` clearly at no
    timed count, each call on weights evicted from the caches first: a model's weights stream
    from memory each step, where the blocks' fewer bytes pay for decoding them (at one row
    ~4x faster there), while weights that stay cached favour fp32 (~0.8x)."""
    blocks = random_blocks(fmt, n, k)
    weight = dequantize(blocks)
    evict = torch.ones(_EVICT_BYTES // 4)
    return _rows_c_serves(
        k,
        torch.float32,
        lambda x: (linear_blocks_f32, x, [blocks]),
        lambda x: (cpu_ops.linear_f32, x, weight, None),
        before=evict.sum,
        fused=False,  # both run in the one-call step
    )


def _rows_c_serves(
    k: int,
    dtype: torch.dtype,
    c_call,
    torch_call,
    before=None,
    counts=ROW_COUNTS,
    fused: bool = True,
) -> int:
    """The two kernels (calls built for an input x; `torch_call` the rival of the C kernel
    `c_call`) run in turns at each of `counts`, so that both see the same conditions, and
    each keeps its best time (`before` runs untimed before each call). `fused`: the C kernel
    keeps decode steps in one C call, the rival does not (`_TORCH_SAVES_S`)."""
    best = 0
    with torch.inference_mode():
        for rows in counts:
            x = torch.randn(rows, k).to(dtype)
            calls = (c_call(x), torch_call(x))
            if all(_torch_wins(*_best_times(*calls, before=before), fused) for _ in range(2)):
                break
            best = rows
    return best


def _torch_wins(c_time: float, torch_time: float, fused: bool) -> bool:
    """Whether torch's time is a clear win (and, against a `fused` C kernel, saves more than
    `_TORCH_SAVES_S`). A win must hold when timed again: load from outside what /proc/stat shows
    (another VM on the host) once made the C fp32 linear lose at one row of a 576x576 weight,
    and the cached choice ran every later start of the default model without its one-call
    decode step (~1.5x slower a token)."""
    saves = _TORCH_SAVES_S if fused else 0.0
    return torch_time < _TORCH_WINS * c_time and c_time - torch_time > saves


def _best_times(*calls: tuple, before=None) -> list[float]:
    """Each `(kernel, *args)` call's best time (`before()` first, untimed, where given)."""
    best = [float("inf")] * len(calls)
    for kernel, *args in calls:
        kernel(*args)  # warm: first calls set kernels up
    began = time.perf_counter()
    for repeat in range(_REPEATS):
        for i, (kernel, *args) in enumerate(calls):
            if before is not None:
                before()
            start = time.perf_counter()
            kernel(*args)
            best[i] = min(best[i], time.perf_counter() - start)
        if repeat + 1 >= _MIN_REPEATS and time.perf_counter() - began > _TIMING_BUDGET_S:
            break
    return best


def _machine_key() -> str:
    """What the timings depend on: the CPU, the threads, torch (its oneDNN) and the C kernels'
    build (its file name holds a hash of the source, the flags and the CPU's flags)."""
    lib = library.load_library()
    built = Path(lib.path).name if lib is not None else ""
    rule = (
        f"{torch.__version__}|{built}|{_TORCH_WINS}|{_TORCH_SAVES_S}|{_F32_WIDE_ROWS}"
        f"|{_TIMING_RULES}"
    )
    build = hashlib.sha256(rule.encode()).hexdigest()[:12]  # a new rule: time again
    return f"{cpu_description()} / {torch.get_num_threads()} threads / {build}"


def _name(shape: tuple) -> str:
    return "x".join(map(str, shape))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, entries: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
