"""Fused RMSNorm (with the residual add), rotary embedding, and decode and shared-prefix
attention for bf16 models on CPU.

At this model size a decode step is mostly per-op dispatch: torch runs `F.rms_norm` on bf16 as
~8 ops (18-20 µs at 1-32 rows) and rotate-half rotary as 6 (13-27 µs); the residual add is one
more. `csrc/cpu_ops.c` does each in one call (3-9 µs), rounding to bf16 where those torch ops
do, so outputs are the same bits but for rare last-bit differences of summation order in the
norm. It is compiled at first use with the system C compiler (`CC`, else `cc`/`gcc`) into the
cache directory, keyed by source, flags and CPU; without a compiler the engine keeps torch ops.

`prefix_attention` is cascade attention over a shared prefix (a RAG batch's system prompt and
context, `TorchAttention`'s `_Shared`), on CPUs with AVX512-BF16: QK^T and PV on bf16 dot products
(exact products, fp32 sums; the probabilities enter PV rounded to bf16, as in flash attention on
bf16), softmax in fp32, over keys packed once per prefix (`pack_prefix`). At 32 x 9 query heads
over 944 keys it takes 215 µs on two threads (416 on one) where torch's fp32 flash kernel takes
445 on two.

`decode_attention` is one decode step of paged attention (cache write included) for the torch
backend's steps of decodes only (`TorchAttention`), merging a shared prefix's `prefix_attention`
result by log-sum-exp: one call a layer where the torch path gathers, casts, runs the flash
kernel and merges in ~15-30 ops. Per layer, with two threads (QK^T on AVX512-BF16 dot products
where the CPU has them): 192 against 834 µs for 32 sequences of 100 tokens, 4.1 against 9.0 ms
for 32 of 1,000, 137 against 400 µs for 8 of 300, 202 against 469 for one of 3,000.

Every kernel splits its loops over torch's OpenMP threads (`OPENMP_FLAGS`); the elementwise
ones only from 32K elements a step (prefill), where waking the second thread pays.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from paged_backend.file_cache import cache_dir, locked, notice

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.c"
# torch's own CPU kernels can be capped below what the CPU has (ATEN_CPU_CAPABILITY=avx2 or
# default), so that one machine stands in for an older one; ours follow the same cap.
_CAPPED_ARCH = {"avx2": "x86-64-v3", "default": "x86-64-v2"}
CPU_CAP = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
FLAGS = ["-O3", f"-march={_CAPPED_ARCH.get(CPU_CAP, 'native')}", "-shared", "-fPIC"]
# Where torch runs on OpenMP (libgomp on Linux), the kernels build with it too: the loader then
# reuses torch's already-loaded libgomp.so.1, so their parallel loops run on torch's thread pool,
# whose threads are still spinning from the last torch op, instead of a second pool fighting it.
OPENMP_FLAGS = ["-fopenmp"] if torch.backends.openmp.is_available() else []


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """RMSNorm of x, or with `residual` of h = x + residual, returning (normed, h); `F.rms_norm`
    is one fused op that accumulates in fp32."""
    h = x if residual is None else x + residual
    normed = F.rms_norm(h, weight.shape, weight, eps)
    return normed if residual is None else (normed, h)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads, head_dim]; cos, sin [T, 1, rotary_dim]. A
    partial rotary (rotary_dim < head_dim) rotates each head's first rotary_dim dims only."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _cpu_info(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpu_info("flags")


_KERNEL_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_features() -> set[str]:
    """The CPU's flags the kernels use, less those above the ATEN_CPU_CAPABILITY cap."""
    flags = set(_cpu_flags().split()) & set(_KERNEL_FEATURES)
    if CPU_CAP in _CAPPED_ARCH:
        flags = flags & {"avx2"} if CPU_CAP == "avx2" else set()
    return flags


def cpu_description() -> str:
    """The CPU's model name and the features the kernels use, so that figures and kernel
    choices from different machines are never taken as equal."""
    features = ", ".join(f for f in _KERNEL_FEATURES if f in cpu_features()) or "no AVX2"
    capped = f", capped by ATEN_CPU_CAPABILITY={CPU_CAP}" if CPU_CAP in _CAPPED_ARCH else ""
    return f"{_cpu_info('model name') or 'unknown CPU'} ({features}{capped})"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled ops, built on first use; None (and a warning) where that fails."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU ops stay in torch")
        return None
    lib = _build(compiler, FLAGS + OPENMP_FLAGS) or (OPENMP_FLAGS and _build(compiler, FLAGS))
    if not lib:
        return None
    ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rms_norm_bf16.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, c_int]
    lib.rotary_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, c_int]
    lib.silu_and_mul_bf16.argtypes = [ptr, ptr, i64, i64, c_int]
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr, c_int]
    lib.store_kv_bf16.argtypes = [*(ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, c_int)]
    lib.decode_attention_bf16.argtypes = [
        *(ptr, ptr, ptr, i64, i64, i64),  # q, k, v and their row strides
        *(ptr, ptr, i64),  # the caches and their head stride
        *(ptr, i64, ptr, i64),  # block tables, their width, sequence lengths, block size
        *(i64, i64, i64, i64, ctypes.c_float, ptr, ptr),  # sizes, scale, out, scratch
        *(i64, c_int),  # scratch row stride, threads
        *(ptr, i64, ptr, ptr, i64),  # a shared prefix's rows, length, out, lse, rows a head
        *(i64, ctypes.c_float),  # window, soft-cap
    ]
    lib.has_bf16_kernels.restype = c_int
    if lib.has_bf16_kernels():
        lib.pack_prefix_bf16.argtypes = [*(ptr, ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, c_int)]
        lib.gemm_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, c_int, c_int]
        lib.prefix_attention_bf16.argtypes = [
            *(ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_float, ptr, ptr, ptr, c_int),
            *(i64, i64, i64),  # causal: group, offset, window
            ctypes.c_float,  # soft-cap
        ]
        lib.prefill_attention_bf16.argtypes = [
            *(ptr, i64, i64, i64, i64, i64),  # q, its row stride, tokens, kv heads, group, dim
            *(ptr, ptr, i64, ctypes.c_float, ptr, i64, ptr, c_int),  # packs ... threads
            *(i64, i64, ctypes.c_float),  # offset, window, soft-cap
        ]
        lib.decode_layers_bf16.argtypes = [
            *(ptr, ptr, i64, i64, ptr, ptr),  # x, residual, rows, hidden, cos, sin
            *(i64, ptr, ptr, ptr, i64, ptr),  # layers, weights, caches, head stride, windows
            *(ptr, i64, ptr, i64),  # block tables, their width, sequence lengths, block size
            *(i64, i64, i64, i64, i64),  # heads, kv heads, head_dim, rotary_dim, intermediate
            *(ctypes.c_float, ctypes.c_float),  # eps, scale
            *(ptr, ptr, i64, c_int),  # work, scores scratch, its row stride, threads
            *(ptr, ptr, i64, ptr, i64, ptr, ptr),  # the cascade's packs, rows, pos, work
        ]
    return lib


def _build(compiler: str, flags: list[str]) -> ctypes.CDLL | None:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_flags()]).encode()).hexdigest()
    try:
        path = cache_dir() / f"cpu_ops-{key[:16]}.so"
        if not path.exists():
            with locked(path.name):
                if not path.exists():  # not built by another process while we waited
                    _compile(compiler, flags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("building %s with %s failed: %s %s", SOURCE, flags, exc, detail)
        return None


def _compile(compiler: str, flags: list[str], path: Path) -> None:
    notice(f"building the C kernels once into {path} (a few seconds)")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        command = [compiler, *flags, "-o", str(built), str(SOURCE), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(built, path)  # atomic: a reader never loads half a library


def available() -> bool:
    return load_library() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """`torch_rms_norm` in one call for bf16 rows [T, hidden] (unit stride within a row;
    `residual` contiguous)."""
    rows, dim = x.shape
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        return torch_rms_norm(x, weight, eps, residual)
    out = torch.empty(rows, dim, dtype=x.dtype)
    if residual is not None:
        residual = residual.contiguous()  # kept alive across the call
    new_residual = None if residual is None else torch.empty_like(out)
    load_library().rms_norm_bf16(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if residual is None else new_residual.data_ptr(),
        rows,
        dim,
        x.stride(0),
        eps,
        torch.get_num_threads(),
    )
    return out if residual is None else (out, new_residual)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in place on bf16 x [T, heads, head_dim] (heads packed within a token's
    row) and returned; cos, sin: bf16 tables at each token's position, [T, 1, rotary_dim]."""
    tokens, heads, dim = x.shape
    if (
        x.dtype != torch.bfloat16
        or x.stride(2) != 1
        or x.stride(1) != dim
        or cos.dtype != torch.bfloat16
    ):
        return apply_rotary(x, cos, sin)
    rot = cos.shape[-1]
    cos, sin = cos.reshape(tokens, rot).contiguous(), sin.reshape(tokens, rot).contiguous()
    load_library().rotary_bf16(
        *(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim, rot, x.stride(0)),
        torch.get_num_threads(),
    )
    return x


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`torch_silu_and_mul` in one call for contiguous bf16 rows [T, 2 * dim] (gate | up)."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        return torch_silu_and_mul(x)
    rows, dim = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, dim, dtype=x.dtype)
    threads = torch.get_num_threads()
    load_library().silu_and_mul_bf16(x.data_ptr(), out.data_ptr(), rows, dim, threads)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (int64) for fp32 CPU rows x [rows, n] with unit stride within a row
    (torch's otherwise), vectorised and over the threads (`argmax_rows_f32`)."""
    lib = load_library() if x.device.type == "cpu" else None
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not x.numel():
        return x.argmax(dim=-1)
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), rows, n, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
) -> None:
    """`cache.index_copy_(1, slots, x.transpose(0, 1))` for k and v [T, kv_heads, dim] into the
    head-major bf16 caches [kv_heads, slots, dim], in one call (slots: int64, one a token; a slot
    < 0 is padding and is skipped)."""
    k_cache, v_cache = kv_cache
    kv_heads, num_slots, dim = _check_cache(kv_cache)
    tokens = k.shape[0]
    _check_rows("k", k, (tokens, kv_heads, dim))
    _check_rows("v", v, (tokens, kv_heads, dim))
    _check_rows("slots", slots, (tokens,), torch.int64)
    _require(not tokens or int(slots.max()) < num_slots, f"slots must be < {num_slots}")
    k, v, slots = _heads_packed(k), _heads_packed(v), slots.contiguous()
    load_library().store_kv_bf16(
        *(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), tokens),
        *(kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0)),
        torch.get_num_threads(),
    )


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel is asked (madvise, before the first touch)
    to back with 2 MiB pages, where Linux allows it (transparent huge pages in `madvise` mode,
    a common default). The KV cache needs it: a decode step reads each sequence's blocks, a few
    hundred bytes each, from all over the cache, and on 4 KiB pages nearly every block read
    missed the TLB (a 32-sequence step of the default model took 39 instead of 35 ms with
    freshly allocated blocks, 63 instead of 47 once a long run had scattered them)."""
    tensor = torch.empty(shape, dtype=dtype)
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (start + size - first) // _HUGE_PAGE * _HUGE_PAGE
    if length > 0 and hasattr(os, "sched_getaffinity"):  # Linux
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return tensor.zero_()


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] with each token's heads side by side (any row stride)."""
    dim = x.shape[2]
    return x if x.stride(2) == 1 and x.stride(1) == dim else x.contiguous()


def _require(ok: bool, what: str) -> None:
    """The C kernels take raw pointers and trust every size and layout: a call that breaks one
    raises here instead of reading or writing past a tensor."""
    if not ok:
        raise ValueError(f"cpu_ops: {what}")


def _check_cache(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int, int]:
    """(kv_heads, slots, dim) of head-major bf16 caches [kv_heads, slots, dim] whose slots are
    contiguous within a head and whose K and V heads lie the same stride apart."""
    k_cache, v_cache = kv_cache
    _require(
        k_cache.dtype == v_cache.dtype == torch.bfloat16 and k_cache.dim() == 3,
        "the KV caches must be bf16 [kv_heads, slots, dim]",
    )
    _require(k_cache.shape == v_cache.shape, "the K and V caches must have one shape")
    dim = k_cache.shape[2]
    _require(
        all(c.stride(2) == 1 and c.stride(1) == dim for c in kv_cache)
        and k_cache.stride(0) == v_cache.stride(0),
        "each KV cache head must be contiguous, the K and V heads equally far apart",
    )
    return tuple(k_cache.shape)


def _check_rows(name: str, x: torch.Tensor, shape: tuple[int, ...], dtype=torch.bfloat16) -> None:
    _require(x.dtype == dtype, f"{name} must be {dtype}, got {x.dtype}")
    _require(tuple(x.shape) == shape, f"{name} must have shape {shape}, got {tuple(x.shape)}")


def _check_index(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    _check_rows(name, x, shape, torch.int32)
    _require(x.is_contiguous(), f"{name} must be contiguous")


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scratch: torch.Tensor,
    prefix: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write each sequence's new k/v [S, kv_heads, dim] into the head-major bf16 caches
    [kv_heads, slots, dim] and attend its q [S, heads, dim] over its `seq_lens` (int32) tokens
    through `block_tables` (int32 [S, width], contiguous): out [S, heads, dim] in bf16. `scratch`:
    fp32 [threads, heads / kv_heads * max(seq_lens)], one row for each thread to use.

    `prefix` = (pos, length, out, lse) merges a shared prefix's attention (`prefix_attention`'s
    out [kv_heads, rows, dim] and lse): sequence s with pos[s] >= 0 (int32 [S]) attends itself
    only from token `length` on and takes the prefix's result at rows pos[s] * group + g.
    With a `window` (and no prefix), each new token sees its last `window` positions only. With a
    `softcap`, a scaled score s becomes tanh(s / softcap) * softcap (Gemma 2)."""
    k_cache, v_cache = kv_cache
    kv_heads, _, dim = _check_cache(kv_cache)
    num_seqs, num_heads = q.shape[:2]
    _require(num_heads % kv_heads == 0 and dim % 16 == 0, "heads must group over kv heads")
    _check_rows("q", q, (num_seqs, num_heads, dim))
    _check_rows("k", k, (num_seqs, kv_heads, dim))
    _check_rows("v", v, (num_seqs, kv_heads, dim))
    _check_index("block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    _check_index("seq_lens", seq_lens, (num_seqs,))
    _require(
        scratch.dtype == torch.float32 and scratch.is_contiguous() and scratch.dim() == 2,
        "scratch must be contiguous fp32 [threads, scores]",
    )
    pos, length, p_out, p_lse = prefix or (None, 0, None, None)
    if pos is not None:
        _check_index("prefix positions", pos, (num_seqs,))
        _require(
            all(t.dtype == torch.float32 and t.is_contiguous() for t in (p_out, p_lse)),
            "the prefix's out and lse must be contiguous fp32",
        )
    q, k, v = _heads_packed(q), _heads_packed(k), _heads_packed(v)
    out = torch.empty(num_seqs, num_heads, dim, dtype=q.dtype)
    load_library().decode_attention_bf16(
        *(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0)),
        *(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0)),
        *(block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), block_size),
        *(num_seqs, num_heads, k_cache.shape[0], dim, dim**-0.5),
        *(out.data_ptr(), scratch.data_ptr(), scratch.shape[1], scratch.shape[0]),
        *(None if pos is None else pos.data_ptr(), length),
        *(None, None, 0) if p_out is None else (p_out.data_ptr(), p_lse.data_ptr(), p_out.shape[1]),
        *(window or 0, softcap or 0.0),
    )
    return out


def has_bf16_kernels() -> bool:
    lib = load_library()
    return lib is not None and bool(lib.has_bf16_kernels())


def padded_length(length: int) -> int:
    """Tokens rounded up to the 32 that `pack_prefix` and `prefix_attention` work in."""
    return -(-length // 32) * 32


def pack_prefix(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    blocks: torch.Tensor,
    block_size: int,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of the first `length` tokens (default: all) of `blocks` (int32) of the
    head-major bf16 caches, packed for `prefix_attention`: [kv_heads, padded * dim] each (padded:
    tokens rounded up to 32)."""
    k_cache, v_cache = kv_cache
    num_kv_heads, num_slots, dim = _check_cache(kv_cache)
    length = len(blocks) * block_size if length is None else length
    _require(0 <= length <= len(blocks) * block_size, "length must fit in the blocks")
    _require(
        not len(blocks) or (int(blocks.min()) >= 0 and int(blocks.max()) < num_slots // block_size),
        f"blocks must be block ids in [0, {num_slots // block_size})",
    )
    blocks = blocks.to(torch.int32).contiguous()
    kp = torch.empty(num_kv_heads, padded_length(length) * dim, dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    load_library().pack_prefix_bf16(
        *(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), blocks.data_ptr()),
        *(block_size, length, num_kv_heads, dim, kp.data_ptr(), vp.data_ptr()),
        torch.get_num_threads(),
    )
    return kp, vp


def prefix_attention(
    q: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor],
    length: int,
    causal: tuple[int, int, int] | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of bf16 query rows q [kv_heads, rows, dim] (each kv head's queries) over the
    `length` tokens of a `pack_prefix`: (out [kv_heads, rows, dim], log-sum-exp [kv_heads, rows]),
    fp32. No mask, or `causal` = (group, offset, window): row r is the query of token r // group of
    a chunk that starts after key `offset`, and sees the keys up to its own (with a window > 0,
    the last `window` of them). `softcap`: as in `decode_attention`."""
    num_kv_heads, rows, dim = q.shape
    kp, vp = packed
    rows4 = -(-rows // 4) * 4
    q = (q if rows4 == rows else F.pad(q, (0, 0, 0, rows4 - rows))).contiguous()
    out = torch.empty(num_kv_heads, rows4, dim)
    lse = torch.empty(num_kv_heads, rows4)
    threads = torch.get_num_threads()
    work = torch.empty(threads, 6 * padded_length(length))  # 4 rows of fp32 scores and bf16 copies
    load_library().prefix_attention_bf16(
        *(q.data_ptr(), num_kv_heads, rows4, dim, kp.data_ptr(), vp.data_ptr(), length),
        *(dim**-0.5, out.data_ptr(), lse.data_ptr(), work.data_ptr(), threads),
        *(causal or (0, 0, 0)),
        softcap or 0.0,
    )
    return out[:, :rows].contiguous(), lse[:, :rows].contiguous()


def prefill_attention(
    q: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor],
    length: int,
    offset: int,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of a prefill chunk's bf16 queries q [tokens, heads, dim] (heads packed in
    a row) over the `length` tokens of a `pack_prefix` (its context, then the chunk: token t sees
    keys up to `offset + t`, with a `window` its last `window` of them), written in bf16 to `out`
    [tokens, heads, dim] (heads packed in a row). `prefix_attention` with `causal` gives the
    same values in fp32, with the queries regrouped by kv head first."""
    tokens, heads, dim = q.shape
    kp, vp = packed
    num_kv_heads = kp.shape[0]
    q = _heads_packed(q)
    if out.stride(2) != 1 or out.stride(1) != dim:
        raise ValueError("out must have each token's heads side by side")
    threads = torch.get_num_threads()
    work = torch.empty(threads, 6 * padded_length(length))
    load_library().prefill_attention_bf16(
        *(q.data_ptr(), q.stride(0), tokens, num_kv_heads, heads // num_kv_heads, dim),
        *(kp.data_ptr(), vp.data_ptr(), length, dim**-0.5, out.data_ptr(), out.stride(0)),
        *(work.data_ptr(), threads, offset, window or 0, softcap or 0.0),
    )


GEMM_MAX_ROWS = 64  # the most rows `gemm` takes (`kernel_choice` times it against oneDNN)


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [n, k] (n a multiple of 16, k even) packed for `gemm`: [n/16, k/2, 16, 2]."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`x @ weight.T` for bf16 rows x [rows <= GEMM_MAX_ROWS, k] (unit stride within a row) and
    a `pack_gemm_weight`, in `out_dtype` (bf16: rounded once; or fp32)."""
    rows, k = x.shape
    n = packed.shape[0] * 16
    out = torch.empty(rows, n, dtype=out_dtype)
    load_library().gemm_bf16(
        *(x.data_ptr(), rows, x.stride(0), packed.data_ptr(), n, k, out.data_ptr()),
        *(out_dtype == torch.bfloat16, torch.get_num_threads()),
    )
    return out
