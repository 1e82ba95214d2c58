"""Typed wrappers of the C ops for bf16 and fp32 models on CPU (`csrc/cpu_ops.c` for bf16,
`csrc/f32_decode.c` and `csrc/f32_ops.c` for fp32, built and bound by
`paged_backend.cpu.library`): fused RMSNorm (with the residual add; Gemma's; per q/k head),
rotary embedding and SiLU- or GeGLU-and-mul, greedy argmax, KV-cache writes, decode attention
over the paged cache, attention over packed keys (a shared prefix, or a prefill chunk's
context) and a GEMM of a few rows. Each wrapper checks the dtypes, shapes and layouts its
kernel assumes, then calls it by keyword.

At small batch a decode step is mostly per-op dispatch: torch runs `F.rms_norm` on bf16 as ~8
ops and rotate-half rotary as 6; the C ops do each in one call, rounding to bf16 where those
torch ops do, so outputs are the same bits but for rare last-bit differences of summation order
in the norm. `decode_attention` is one decode step of paged attention (cache writes included)
in one call a layer, merging a shared prefix's `prefix_attention` result by log-sum-exp.

Every kernel splits its loops over torch's OpenMP threads (`library.OPENMP_FLAGS`); the
elementwise ones only from 4K elements a step, where waking the second thread pays. Timings
live in the README's benchmark section, with the CPU they came from.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from paged_backend.cpu.library import load_library

# The dtypes the elementwise ops, the KV writes and decode attention have kernels for, and the
# suffix of their names (the other kernels are bf16's only).
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def torch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
):
    """RMSNorm of x, or with `residual` of h = x + residual, returning (normed, h); `F.rms_norm`
    is one fused op that accumulates in fp32. With `offset` (1: Gemma, whose norm weights are
    offsets from 1), h times (offset + weight) in fp32, rounded once to h's dtype."""
    h = x if residual is None else x + residual
    if offset:
        normed = F.rms_norm(h.float(), weight.shape, offset + weight.float(), eps).to(h.dtype)
    else:
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


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
):
    """`torch_rms_norm` in one call for bf16 or fp32 rows [T, hidden] (unit stride within a row;
    `residual` contiguous)."""
    rows, dim = x.shape
    if x.dtype not in _SUFFIX or x.stride(1) != 1 or weight.dtype != x.dtype:
        return torch_rms_norm(x, weight, eps, residual, offset)
    out = torch.empty(rows, dim, dtype=x.dtype)
    if residual is not None:
        residual = residual.contiguous()  # kept alive across the call
    new_residual = None if residual is None else torch.empty_like(out)
    getattr(load_library(), f"rms_norm_{_SUFFIX[x.dtype]}")(
        x=x.data_ptr(),
        residual=None if residual is None else residual.data_ptr(),
        weight=weight.data_ptr(),
        out=out.data_ptr(),
        new_residual=None if residual is None else new_residual.data_ptr(),
        rows=rows,
        dim=dim,
        x_stride=x.stride(0),
        eps=eps,
        offset=offset,
        threads=torch.get_num_threads(),
    )
    return out if residual is None else (out, new_residual)


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """`rms_norm` times (1 + weight): Gemma stores its norm weights as offsets from 1."""
    return rms_norm(x, weight, eps, residual, offset=1.0)


def head_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None, offset: float = 0.0
):
    """`rms_norm` of each head of x [T, heads, head_dim] (q/k norms: Qwen3, Gemma 3), called as
    `RMSNorm` calls its norm (a head takes no residual)."""
    assert residual is None
    return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, offset=offset).view(x.shape)


def gemma_head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None):
    """`head_norm` times (1 + weight), as `gemma_rms_norm`."""
    return head_norm(x, weight, eps, residual, offset=1.0)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in place on bf16 or fp32 x [T, heads, head_dim] (heads packed within a
    token's row) and returned; cos, sin: tables of x's dtype at each token's position,
    [T, 1, rotary_dim]."""
    tokens, heads, dim = x.shape
    if x.dtype not in _SUFFIX or x.stride(2) != 1 or x.stride(1) != dim or cos.dtype != x.dtype:
        return apply_rotary(x, cos, sin)
    rot = cos.shape[-1]
    cos, sin = cos.reshape(tokens, rot).contiguous(), sin.reshape(tokens, rot).contiguous()
    getattr(load_library(), f"rotary_{_SUFFIX[x.dtype]}")(
        x=x.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        tokens=tokens,
        heads=heads,
        dim=dim,
        rot_dim=rot,
        x_stride=x.stride(0),
        threads=torch.get_num_threads(),
    )
    return x


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU of fused rows [T, 2 * dim] (gate | up), transformers' `gelu_pytorch_tanh`."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    if x.dtype not in _SUFFIX or not x.is_contiguous():
        return torch_gelu_tanh_and_mul(x) if gelu else torch_silu_and_mul(x)
    rows, dim = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, dim, dtype=x.dtype)
    getattr(load_library(), f"act_and_mul_{_SUFFIX[x.dtype]}")(
        x=x.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        dim=dim,
        gelu=int(gelu),
        threads=torch.get_num_threads(),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`torch_silu_and_mul` in one call for contiguous bf16 or fp32 rows [T, 2 * dim]
    (gate | up)."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`torch_gelu_tanh_and_mul` in one call, as `silu_and_mul` (gelu as g * sigmoid(z), the
    tanh approximation's identity: outputs agree with torch's to rounding)."""
    return _act_and_mul(x, gelu=True)


# The C gated activations, each to whether it is GeGLU: what kernels that apply one themselves
# (the one-call decode step, `QuantLinear.act_and_mul`) take as their `gelu` flag.
GELU = {silu_and_mul: False, gelu_tanh_and_mul: True}


HADAMARD_MAX_BLOCK = 4096  # csrc/cpu_ops.c's, and for columns:
HADAMARD_COLUMN_BLOCK = 256


def _hadamard(x: torch.Tensor, block: int, scale: torch.Tensor | None, columns: bool) -> None:
    along = x.shape[0] if columns else x.shape[-1]
    most = HADAMARD_COLUMN_BLOCK if columns else HADAMARD_MAX_BLOCK
    if block & (block - 1) or not 0 < block <= most or along % block:
        raise ValueError(
            f"block must be a power of two in [1, {most}] dividing the {along} values it "
            f"rotates, got {block}"
        )
    if x.dtype not in _SUFFIX or not x.is_contiguous():
        layout = "contiguous" if x.is_contiguous() else "not contiguous"
        raise ValueError(f"x must be contiguous fp32 or bf16, got {x.dtype}, {layout}")
    if columns and x.dim() != 2:
        raise ValueError(f"hadamard_columns_ takes a matrix, not shape {tuple(x.shape)}")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != (along,)):
        raise ValueError(f"scale must be {along} fp32 values, got {tuple(scale.shape)}")
    scale = None if scale is None else scale.contiguous()  # alive across the call
    n = x.shape[-1]
    getattr(load_library(), "hadamard_columns" if columns else "hadamard_rows")(
        x=x.data_ptr(),
        x_bf16=int(x.dtype == torch.bfloat16),
        rows=x.numel() // max(n, 1),
        n=n,
        block=block,
        scale=None if scale is None else scale.data_ptr(),
        threads=torch.get_num_threads(),
    )


def hadamard_(x: torch.Tensor, block: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (contiguous fp32 or bf16 rows [..., n]) with each row's values, `block` at a time, times
    the Hadamard matrix of that size over sqrt(block), in place (`hadamard_rows`): orthogonal
    and its own inverse; each row's value k times scale[k] first where given. `block`: a power
    of two up to `HADAMARD_MAX_BLOCK` dividing n."""
    _hadamard(x, block, scale, columns=False)
    return x


def hadamard_columns_(
    x: torch.Tensor, block: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`hadamard_` down the columns of x [rows, n]: blocks of `block` rows (up to
    `HADAMARD_COLUMN_BLOCK`), row r times scale[r] first where given; the bits of `hadamard_`
    on the transpose."""
    _hadamard(x, block, scale, columns=True)
    return x


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (int64) for fp32 CPU rows x [rows, n] with unit stride within a row
    (torch's otherwise), vectorised and over the threads (`argmax_rows_f32`)."""
    lib = load_library() if x.device.type == "cpu" else None
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not x.numel():
        return x.argmax(dim=-1)
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_rows_f32(
        x=x.data_ptr(),
        rows=rows,
        n=n,
        stride=x.stride(0),
        out=out.data_ptr(),
        threads=torch.get_num_threads(),
    )
    return out


# A head asked only for each row's largest output computes them this many bytes (fp32) at a time
ARGMAX_SLICE_BYTES = 8 << 20


def argmax_slice_width(rows: int, multiple: int) -> int:
    """Outputs a slice of `rows` rows' `ARGMAX_SLICE_BYTES`, a multiple of `multiple`."""
    return max(multiple, ARGMAX_SLICE_BYTES // (4 * rows) // multiple * multiple)


def argmax_of_slices(slices: Iterable[tuple[int, torch.Tensor]], rows: int) -> torch.Tensor:
    """Each row's argmax (int64) over outputs that come a slice at a time, (first column, fp32
    [rows, width]) in column order: the first of equal maxima, the first NaN where a row has one,
    as torch's and `argmax`. Only the slice in hand is held."""

    def candidates():
        for start, out in slices:
            top = argmax(out)
            yield out.gather(1, top[:, None]).squeeze(1), top + start

    return argmax_of_candidates(candidates(), rows)


def argmax_of_candidates(
    candidates: Iterable[tuple[torch.Tensor, torch.Tensor]], rows: int
) -> torch.Tensor:
    """Each row's argmax (int64) from the argmaxes of runs of its outputs, (each row's value
    (fp32), its column (int64)) a run, the runs in column order: `argmax_of_slices`' ties and
    NaNs."""
    best = torch.full((rows,), float("-inf"))
    index = torch.zeros(rows, dtype=torch.int64)
    for value, column in candidates:
        take = ~best.isnan() & ((value > best) | value.isnan())
        best = torch.where(take, value, best)
        index = torch.where(take, column, index)
    return index


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
) -> None:
    """Write k and v [T, kv_heads, dim] at `slots` (int64, one a token: block * block_size +
    offset; a slot < 0 is padding and is skipped) of the block-major bf16 or fp32 caches
    [blocks, kv_heads, block_size, dim], in one call."""
    k_cache, v_cache = kv_cache
    blocks, kv_heads, block_size, dim = _check_cache(kv_cache)
    tokens = k.shape[0]
    _check_rows("k", k, (tokens, kv_heads, dim), k_cache.dtype)
    _check_rows("v", v, (tokens, kv_heads, dim), k_cache.dtype)
    _check_rows("slots", slots, (tokens,), torch.int64)
    num_slots = blocks * block_size
    _require(not tokens or int(slots.max()) < num_slots, f"slots must be < {num_slots}")
    k, v = _heads_packed(k), _heads_packed(v)
    slots = _kernel_slots(slots, block_size, kv_heads)
    load_library().store_kv(
        k=k.data_ptr(),
        v=v.data_ptr(),
        k_stride=k.stride(0),
        v_stride=v.stride(0),
        slots=slots.data_ptr(),
        tokens=tokens,
        kv_heads=kv_heads,
        dim=dim,
        elem_bytes=k_cache.element_size(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        cache_head_stride=k_cache.stride(1),
        threads=torch.get_num_threads(),
    )


def kernel_blocks(blocks: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Block ids (int32, contiguous) as the C kernels read them. A kernel finds row `slot` of kv
    head h at h * head_stride + slot * dim, slot = block * block_size + offset: over a
    block-major cache that holds with head_stride = block_size * dim (the stride of its heads)
    and each block id b read as b * kv_heads. Negative ids (padding) stay negative."""
    return (blocks * kv_heads).to(torch.int32).contiguous()


def _kernel_slots(slots: torch.Tensor, block_size: int, kv_heads: int) -> torch.Tensor:
    """`slots` (block * block_size + offset) as the C kernels read them (`kernel_blocks`):
    block * kv_heads * block_size + offset; negative ones stay negative."""
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    return (slots + blocks * ((kv_heads - 1) * block_size)).contiguous()


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] with each token's heads side by side (any row stride)."""
    dim = x.shape[2]
    return x if x.stride(2) == 1 and x.stride(1) == dim else x.contiguous()


def _require(ok: bool, what: str) -> None:
    """The C kernels take raw pointers and trust every size and layout: a call that breaks one
    raises here instead of reading or writing past a tensor."""
    if not ok:
        raise ValueError(f"paged_backend.cpu.ops: {what}")


def _check_cache(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int, int, int]:
    """(blocks, kv_heads, block_size, dim) of block-major bf16, fp16 or fp32 caches [blocks,
    kv_heads, block_size, dim] (`TorchAttention.allocate_kv_cache`), each contiguous."""
    k_cache, v_cache = kv_cache
    _require(
        k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (*_SUFFIX, torch.float16)
        and k_cache.dim() == 4,
        "the KV caches must be bf16, fp16 or fp32 [blocks, kv_heads, block_size, dim]",
    )
    _require(k_cache.shape == v_cache.shape, "the K and V caches must have one shape")
    _require(
        k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV caches must be contiguous"
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
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write each sequence's new k/v [S, kv_heads, dim] into the block-major caches [blocks,
    kv_heads, block_size, dim] and attend its q [S, heads, dim] over its `seq_lens` (int32) tokens
    through `block_tables` (int32 [S, width], contiguous): out [S, heads, dim] in q's dtype, bf16 or
    fp32. The caches hold q's dtype, or fp16 for fp32 q (k/v rounded to nearest even as they are
    written; the scores and sums those of fp32 caches holding the same values). `scratch`: fp32
    [threads, at least heads / kv_heads * max(seq_lens)], one row for each thread to use. With
    `query_start` (int32 [S + 1]) a sequence has several rows, its last tokens (q, k, v, out are
    then [rows, ...]: a decode and its drafts, or a prompt's chunk), each attending causally. fp32's
    kernel reads a sequence's keys once for as many of its rows as a `scratch` row holds scores of
    (a longer one: fewer passes), each row with the bits it has alone; bf16's reads them for each
    row.

    `prefix` = (pos, length, out, lse) merges a shared prefix's attention (`prefix_attention`'s
    out [kv_heads, prefix rows, dim] and lse; bf16 only): row t with pos[t] >= 0 (int32
    [rows]) attends itself only from token `length` on and takes the prefix's result at rows
    pos[t] * group + g. With a `window` (and no prefix), each new token sees its last `window`
    positions only. With a `softcap`, a scaled score s becomes tanh(s / softcap) * softcap
    (Gemma 2)."""
    k_cache, v_cache = kv_cache
    _, kv_heads, cache_block_size, dim = _check_cache(kv_cache)
    _require(block_size == cache_block_size, f"block_size must be the cache's, {cache_block_size}")
    rows, num_heads = q.shape[:2]
    num_seqs = rows if query_start is None else len(query_start) - 1
    _require(num_heads % kv_heads == 0 and dim % 16 == 0, "heads must group over kv heads")
    half = (q.dtype, k_cache.dtype) == (torch.float32, torch.float16)
    _require(
        q.dtype in _SUFFIX and (k_cache.dtype == q.dtype or half),
        f"{q.dtype} queries cannot read a {k_cache.dtype} cache",
    )
    for name, x, heads in (("q", q, num_heads), ("k", k, kv_heads), ("v", v, kv_heads)):
        _check_rows(name, x, (rows, heads, dim), q.dtype)
    _check_index("block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    _check_index("seq_lens", seq_lens, (num_seqs,))
    if query_start is not None:
        _check_index("query_start", query_start, (num_seqs + 1,))
        counts = query_start.diff()
        _require(
            int(query_start[0]) == 0 and int(query_start[-1]) == rows and bool((counts > 0).all()),
            "query_start must rise from 0 to the rows",
        )
        _require(bool((counts <= seq_lens).all()), "a sequence's rows must fit in its seq_len")
    _require(
        scratch.dtype == torch.float32 and scratch.is_contiguous() and scratch.dim() == 2,
        "scratch must be contiguous fp32 [threads, scores]",
    )
    need = num_heads // kv_heads * int(seq_lens.max())
    _require(scratch.shape[1] >= need, f"scratch rows must hold {need} scores")
    q, k, v = _heads_packed(q), _heads_packed(k), _heads_packed(v)
    tables = kernel_blocks(block_tables, kv_heads)
    out = torch.empty(rows, num_heads, dim, dtype=q.dtype)
    args = dict(
        q=q.data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        q_stride=q.stride(0),
        k_stride=k.stride(0),
        v_stride=v.stride(0),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        cache_head_stride=k_cache.stride(1),
        block_tables=tables.data_ptr(),
        max_blocks=block_tables.shape[1],
        seq_lens=seq_lens.data_ptr(),
        block_size=block_size,
        num_seqs=num_seqs,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        dim=dim,
        scale=dim**-0.5,
        out=out.data_ptr(),
        scores=scratch.data_ptr(),
        scores_stride=scratch.shape[1],
        threads=scratch.shape[0],
        window=window or 0,
        softcap=softcap or 0.0,
    )
    if q.dtype == torch.float32:
        _require(prefix is None, "fp32 decode attention takes no shared prefix")
        if query_start is None:
            query_start = torch.arange(rows + 1, dtype=torch.int32)
        load_library().decode_attention_f32(
            **args, query_start=query_start.data_ptr(), kv_half=int(half)
        )
        return out
    pos, length, p_out, p_lse = prefix or (None, 0, None, None)
    if pos is not None:
        _check_index("prefix positions", pos, (rows,))
        _require(
            all(t.dtype == torch.float32 and t.is_contiguous() for t in (p_out, p_lse)),
            "the prefix's out and lse must be contiguous fp32",
        )
    load_library().decode_attention_bf16(
        **args,
        query_start=None if query_start is None else query_start.data_ptr(),
        prefix_pos=None if pos is None else pos.data_ptr(),
        prefix_len=length,
        prefix_out=None if p_out is None else p_out.data_ptr(),
        prefix_lse=None if p_out is None else p_lse.data_ptr(),
        prefix_rows=0 if p_out is None else p_out.shape[1],
    )
    return out


# A thread's floats of `prefix_attention`'s work for each padded key: 16 rows of fp32 scores and
# of bf16 probabilities (csrc/common.h's PREFIX_WORK).
PREFIX_WORK = 24


def padded_length(length: int) -> int:
    """Tokens rounded up to the 32 that `pack_prefix` and `prefix_attention` work in."""
    return -(-length // 32) * 32


def pack_prefix(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    blocks: torch.Tensor,
    block_size: int,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of the first `length` tokens (default: all) of `blocks` of the
    block-major bf16 caches, packed for `prefix_attention`: [kv_heads, padded * dim] each
    (padded: tokens rounded up to 32)."""
    k_cache, v_cache = kv_cache
    num_blocks, num_kv_heads, cache_block_size, dim = _check_cache(kv_cache)
    _require(k_cache.dtype == torch.bfloat16, "pack_prefix reads bf16 caches")
    _require(block_size == cache_block_size, f"block_size must be the cache's, {cache_block_size}")
    length = len(blocks) * block_size if length is None else length
    _require(0 <= length <= len(blocks) * block_size, "length must fit in the blocks")
    _require(
        not len(blocks) or (int(blocks.min()) >= 0 and int(blocks.max()) < num_blocks),
        f"blocks must be block ids in [0, {num_blocks})",
    )
    blocks = kernel_blocks(blocks, num_kv_heads)
    kp = torch.empty(num_kv_heads, padded_length(length) * dim, dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    load_library().pack_prefix_bf16(
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        cache_head_stride=k_cache.stride(1),
        blocks=blocks.data_ptr(),
        block_size=block_size,
        len=length,
        heads=num_kv_heads,
        dim=dim,
        kp=kp.data_ptr(),
        vp=vp.data_ptr(),
        threads=torch.get_num_threads(),
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
    work = torch.empty(threads, PREFIX_WORK * padded_length(length))
    group, offset, window = causal or (0, 0, 0)
    load_library().prefix_attention_bf16(
        q=q.data_ptr(),
        heads=num_kv_heads,
        rows=rows4,
        dim=dim,
        kp=kp.data_ptr(),
        vp=vp.data_ptr(),
        len=length,
        scale=dim**-0.5,
        out=out.data_ptr(),
        lse=lse.data_ptr(),
        work=work.data_ptr(),
        threads=threads,
        causal_group=group,
        causal_offset=offset,
        window=window,
        softcap=softcap or 0.0,
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
    work = torch.empty(threads, PREFIX_WORK * padded_length(length))
    load_library().prefill_attention_bf16(
        q=q.data_ptr(),
        q_stride=q.stride(0),
        tokens=tokens,
        kv_heads=num_kv_heads,
        group=heads // num_kv_heads,
        dim=dim,
        kp=kp.data_ptr(),
        vp=vp.data_ptr(),
        len=length,
        scale=dim**-0.5,
        out=out.data_ptr(),
        out_stride=out.stride(0),
        work=work.data_ptr(),
        threads=threads,
        offset=offset,
        window=window or 0,
        softcap=softcap or 0.0,
    )


GEMM_MAX_ROWS = 64  # the most rows `kernel_choice` times `gemm` at against oneDNN


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [n, k] (n a multiple of 16, k even) packed for `gemm`: [n/16, k/2, 16, 2]."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`x @ weight.T` for bf16 rows x [rows, k] (unit stride within a row) and a
    `pack_gemm_weight`, in `out_dtype` (bf16: rounded once; or fp32)."""
    rows, k = x.shape
    n = packed.shape[0] * 16
    out = torch.empty(rows, n, dtype=out_dtype)
    load_library().gemm_bf16(
        x=x.data_ptr(),
        rows=rows,
        x_stride=x.stride(0),
        wp=packed.data_ptr(),
        n=n,
        k=k,
        out=out.data_ptr(),
        out_bf16=out_dtype == torch.bfloat16,
        threads=torch.get_num_threads(),
    )
    return out


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight.float(), bias)` for fp32 rows x [rows, k] (unit stride within a row)
    and a contiguous fp32 or fp16 weight [n, k], k a multiple of 8 (`linear_f32_fits`), in C:
    each weight is read once for all rows, and a row's result does not depend on the others (an
    fp16 weight gives the bits of its fp32 conversion, for half the bytes read)."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    lib = load_library()
    (lib.linear_f16w if weight.dtype == torch.float16 else lib.linear_f32)(
        x=x.data_ptr(),
        rows=rows,
        x_stride=x.stride(0),
        w=weight.data_ptr(),
        n=n,
        k=k,
        y=out.data_ptr(),
        y_stride=n,
        threads=torch.get_num_threads(),
    )
    return out if bias is None else out.add_(bias)


def linear_f32_fits(weight: torch.Tensor) -> bool:
    """Whether `linear_f32` takes this weight."""
    return (
        weight.dtype in (torch.float32, torch.float16)
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 8 == 0
    )
