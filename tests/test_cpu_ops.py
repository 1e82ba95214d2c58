"""Fused C ops for bf16 models on CPU (`paged_backend.cpu.ops`): RMSNorm with the residual add,
rotary and SiLU-and-mul give the torch ops' values (rotary, SiLU-and-mul and the residual bit for
bit, the norm within a last-bit difference of summation order) at decode and prefill sizes (one
thread, and both threads from 32K elements), decode, shared-prefix and causal prefill attention
the torch backend's (and the same cache writes), each falls back to torch where it does not
apply, and an engine uses them by default for bf16 and runs on torch ops when they cannot be
built."""

from __future__ import annotations

import mmap
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import head_major, make_tiny_model, random_kv_cache
from torch import nn

from paged_backend import LLM, SamplingParams, cpu, model_runner
from paged_backend.attention import AttentionMetadata
from paged_backend.attention.planner import CDecodePlan, TorchPlan
from paged_backend.attention.torch_backend import TorchAttention
from paged_backend.cpu import library
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.features import cpu_flags
from paged_backend.cpu.memory import (
    advise_huge_pages,
    huge_page_tokens,
    move_to_huge_pages_,
    release_freed_heap,
    resident_bytes,
    zeros_on_huge_pages,
)

needs_ops = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
BF16 = torch.bfloat16


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 64, 301])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gives_the_torch_values(rows, with_residual):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 640) * 3).to(BF16)[:, 32:608]  # strided rows, 576 wide
    residual = (torch.randn(rows, 576) * 5).to(BF16) if with_residual else None
    weight = (torch.rand(576) + 0.5).to(BF16)
    got = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    want = cpu_ops.torch_rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # x + residual, rounded once to bf16
        got, want = got[0], want[0]
    assert got.shape == want.shape and got.dtype == BF16
    assert _bf16_ulps(got, want).max() <= 1
    assert (got != want).float().mean() < 1e-3


@needs_ops
@pytest.mark.parametrize(("rows", "dim"), [(1, 1536), (9, 1536), (250, 1536), (7, 100)])
def test_silu_and_mul_gives_the_torch_values(rows, dim):
    """Exactly torch's bits: 16 lanes at a time, and (dim 100) the scalar tail of each row."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * dim) * 4).to(BF16)
    assert torch.equal(cpu_ops.silu_and_mul(x), cpu_ops.torch_silu_and_mul(x))


@needs_ops
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 9, 250])
def test_gemma_ops_give_the_torch_values(rows, dtype):
    """Gemma's pieces on the C ops: norms times (1 + weight) (with the residual add, and on
    each q/k head), and GeGLU with gelu as g * sigmoid(z), vector lanes and a scalar tail."""
    torch.manual_seed(rows)
    x, residual = (torch.randn(rows, 576) * 3).to(dtype), (torch.randn(rows, 576) * 5).to(dtype)
    weight = (torch.randn(576) * 0.5).to(dtype)  # offsets from 1, some below -1
    got, got_sum = cpu_ops.gemma_rms_norm(x, weight, 1e-6, residual)
    want, want_sum = cpu_ops.torch_rms_norm(x, weight, 1e-6, residual, offset=1.0)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # bf16: equal but for ~1 ulp
    heads = (torch.randn(rows, 12 * 64 + 7) * 2).to(dtype)[:, 7:].view(rows, 12, 64)  # strided
    head_weight = (torch.randn(64) * 0.5).to(dtype)
    torch.testing.assert_close(
        cpu_ops.gemma_head_norm(heads, head_weight, 1e-6),
        cpu_ops.torch_rms_norm(heads, head_weight, 1e-6, offset=1.0),
    )
    gate_up = (torch.randn(rows, 2 * 1540) * 4).to(dtype)  # 1540: a scalar tail after the lanes
    got, want = cpu_ops.gelu_tanh_and_mul(gate_up), cpu_ops.torch_gelu_tanh_and_mul(gate_up)
    # torch's 0.5 g (1 + tanh(u)) is 0 once tanh(u) rounds to -1 (g < ~-4.5), where g * sigmoid(2u)
    # keeps the tiny true value: hence the absolute tolerance; else within two bf16 steps (a step
    # of the rounded gelu, times up, rounded again)
    torch.testing.assert_close(got, want, rtol=2**-7 if dtype == BF16 else 1e-5, atol=1e-5)


@needs_ops
@pytest.mark.parametrize("rotary_dim", [64, 48], ids=["full", "partial"])
@pytest.mark.parametrize("tokens", [1, 5, 100])
def test_rotary_gives_the_torch_values_in_place(tokens, rotary_dim):
    """On the q/k heads of a fused qkv row (a strided view), as the model calls it; a partial
    rotary (Phi-4-mini) rotates each head's first `rotary_dim` dims and leaves the others."""
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, 12 * 64 + 3 * 64).to(BF16)
    positions = torch.randint(0, 4000, (tokens,))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(BF16)[:, None], emb.sin().to(BF16)[:, None]
    qk = qkv[:, : 12 * 64].view(tokens, 12, 64)
    want = cpu_ops.apply_rotary(qk, cos, sin)
    v_before = qkv[:, 12 * 64 :].clone()
    got = cpu_ops.rotary_embedding(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # the rest of the row is untouched


@needs_ops
def test_other_dtypes_run_the_torch_ops():
    fp16 = torch.float16
    weight = torch.rand(576).to(fp16)
    x16 = torch.randn(4, 576).to(fp16)
    assert torch.equal(
        cpu_ops.rms_norm(x16, weight, 1e-5), cpu_ops.torch_rms_norm(x16, weight, 1e-5)
    )
    q = torch.randn(3, 2, 8).to(fp16)
    cos, sin = torch.rand(3, 1, 8).to(fp16), torch.rand(3, 1, 8).to(fp16)
    out = cpu_ops.rotary_embedding(q, cos, sin)
    assert torch.equal(out, cpu_ops.apply_rotary(q, cos, sin)) and out.data_ptr() != q.data_ptr()
    x = torch.randn(3, 16).to(fp16)
    assert torch.equal(cpu_ops.silu_and_mul(x), cpu_ops.torch_silu_and_mul(x))


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 301])
def test_fp32_elementwise_ops_give_the_torch_values(rows):
    """The fp32 kernels (`csrc/f32_decode.c`): torch's formulas, summed in another order."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, 640) * 3)[:, 32:608]  # strided rows, 576 wide
    residual, weight = torch.randn(rows, 576) * 5, torch.rand(576) + 0.5
    got, got_sum = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    want, want_sum = cpu_ops.torch_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = F.rms_norm(x, (576,), weight, 1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), alone, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(rows, 2 * 100) * 30  # large |gate| both ways, a scalar tail
    torch.testing.assert_close(
        cpu_ops.silu_and_mul(gate_up), cpu_ops.torch_silu_and_mul(gate_up), rtol=1e-5, atol=1e-5
    )
    qkv = torch.randn(rows, 15 * 64)
    emb = torch.outer(torch.randint(0, 4000, (rows,)).float(), 1e-4 ** (torch.arange(24) / 24))
    emb = torch.cat((emb, emb), dim=-1)  # a partial rotary: 48 of 64 dims
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    qk = qkv[:, : 12 * 64].view(rows, 12, 64)
    want = cpu_ops.apply_rotary(qk, cos, sin)
    v_before = qkv[:, 12 * 64 :].clone()
    got = cpu_ops.rotary_embedding(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr() and torch.equal(qkv[:, 12 * 64 :], v_before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _decode_step(
    lens, bs, num_kv_heads, group, dim, packed_qkv, seed, shared_blocks=0, sharing=None, dtype=BF16
):
    """Random caches (of `dtype`) and one step of decodes (`lens`: context after the step) over
    shuffled blocks, the first `sharing` sequences (default all) sharing their first
    `shared_blocks`, as (q, k, v, (k_cache, v_cache), meta)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // bs) for n in lens]
    blocks = torch.randperm(sum(widths) + 3, generator=gen).tolist()
    tables = np.zeros((len(lens), max(widths)), dtype=np.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = [blocks.pop() for _ in range(w)]
    tables[:sharing, :shared_blocks] = tables[0, :shared_blocks]
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    cache = random_kv_cache(sum(widths) + 3, num_kv_heads, bs, dim, gen, dtype)
    heads, s = num_kv_heads * group, len(lens)
    if packed_qkv:  # views into one fused qkv row per token, as the model passes them
        qkv = torch.randn(s, (heads + 2 * num_kv_heads) * dim, generator=gen).to(dtype)
        q, k, v = qkv.split([heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=1)
        q, k, v = q.view(s, heads, dim), k.view(s, -1, dim), v.view(s, -1, dim)
    else:  # separate tensors (q/k norms), one of them not heads-packed
        q = torch.randn(heads, s, dim, generator=gen).to(dtype).transpose(0, 1)
        k, v = (torch.randn(s, num_kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    meta = AttentionMetadata(
        num_decodes=s,
        query_start_loc=list(range(s + 1)),
        seq_lens=list(lens),
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.tensor(slots),
        block_size=bs,
        block_tables_cpu=tables,
    )
    return q, k, v, cache, meta


@needs_ops
@pytest.mark.parametrize(
    ("lens", "bs", "num_kv_heads", "group", "dim", "packed_qkv"),
    [
        ([1], 4, 3, 3, 64, True),
        ([37, 5, 130], 4, 3, 3, 64, True),
        ([300, 17], 16, 2, 1, 128, False),
        ([64] * 4, 4, 1, 4, 16, True),
        ([90, 15, 33], 4, 1, 8, 64, False),  # more query heads a kv head than PV keeps at once
        ([25, 70], 4, 2, 2, 80, True),  # 80 dims: two 32-dim value tiles and a 16-dim one
    ],
)
@pytest.mark.parametrize(
    ("dtype", "window", "softcap"),
    [(BF16, None, None), (torch.float32, None, None), (torch.float32, 23, 5.0)],
    ids=["bf16", "fp32", "fp32-window-softcap"],
)
def test_decode_attention_gives_the_torch_backends_output_and_cache(
    lens, bs, num_kv_heads, group, dim, packed_qkv, dtype, window, softcap
):
    outs, caches = [], []
    for c_decode in (True, False):
        q, k, v, cache, meta = _decode_step(
            lens, bs, num_kv_heads, group, dim, packed_qkv, 0, dtype=dtype
        )
        backend = TorchAttention(
            num_kv_heads * group, num_kv_heads, c_decode=c_decode, windows=(window,)
        )
        backend.prepare(meta)
        assert isinstance(meta.prepared[window], CDecodePlan) == c_decode
        outs.append(backend.forward(q, k, v, cache, meta, window, softcap))
        caches.append(cache)
    got, want = outs
    assert got.shape == want.shape == (len(lens), num_kv_heads * group, dim)
    assert got.dtype == dtype
    tolerance = 1e-2 if dtype == BF16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    if dtype == BF16:
        assert (got != want).float().mean() < 0.01  # rounding differences only
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))


@needs_ops
@pytest.mark.parametrize(
    ("window", "softcap", "dtype"),
    [(None, None, torch.float32), (6, 5.0, torch.float32), (None, None, BF16), (6, 5.0, BF16)],
)
def test_decode_attention_takes_several_rows_a_sequence(window, softcap, dtype):
    """A step verifying drafts (and short chunks): each sequence's last rows attend causally,
    as the torch path's prefill chunks do; longer chunks keep the torch path."""
    lens, rows = [9, 37, 130, 3], [1, 3, 5, 3]  # decodes first; the last: a 3-token prompt
    gen = torch.Generator().manual_seed(1)
    outs, caches = [], []
    for c_decode in (True, False):
        *_, cache, meta = _decode_step(lens, 4, 2, 3, 64, True, 0, dtype=dtype)
        qsl = [0, *np.cumsum(rows).tolist()]
        tables = meta.block_tables_cpu
        slots = [
            int(tables[i, p // 4]) * 4 + p % 4
            for i, n in enumerate(lens)
            for p in range(n - rows[i], n)
        ]
        meta = AttentionMetadata(
            num_decodes=1,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=meta.block_tables,
            slot_mapping=torch.tensor(slots),
            block_size=4,
            block_tables_cpu=tables,
            c_decode_rows=5,
        )
        gen.manual_seed(1)
        q, k, v = (torch.randn(qsl[-1], h, 64, generator=gen).to(dtype) for h in (6, 2, 2))
        backend = TorchAttention(6, 2, c_decode=c_decode, windows=(window,))
        backend.prepare(meta)
        assert isinstance(meta.prepared[window], CDecodePlan) == c_decode
        outs.append(backend.forward(q, k, v, cache, meta, window, softcap))
        caches.append(cache)
    got, want = outs
    assert got.dtype == dtype
    tolerance = 1e-2 if dtype == BF16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    if dtype == BF16:
        assert (got != want).float().mean() < 0.01  # rounding differences only
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))
    meta.query_start_loc = [0, 1, 4, 10, 13]  # 6 rows: more than c_decode_rows
    meta.seq_lens = [9, 37, 131, 3]
    TorchAttention(6, 2, c_decode=True).prepare(meta)
    assert not isinstance(meta.prepared[None], CDecodePlan)


@needs_ops
@pytest.mark.parametrize(("threads", "window"), [(1, None), (2, None), (2, 9), (4, None)])
def test_fp32_rows_of_a_sequence_give_the_bits_of_each_row_alone(threads, window):
    """A verifying step's rows read the cache together, in chunks of rows that depend on the
    threads: each row's output is the bits the row gives as a one-row decode at its position."""
    lens, rows, bs = [45], 7, 4
    *_, cache, meta = _decode_step(lens, bs, 1, 5, 64, True, 3, dtype=torch.float32)
    table = meta.block_tables
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(rows, h, 64, generator=gen) for h in (5, 1, 1))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scratch = torch.empty(threads, rows * 5 * lens[0])
    qsl = torch.tensor([0, rows], dtype=torch.int32)
    args = dict(window=window, query_start=qsl)
    together = cpu_ops.decode_attention(q, k, v, cache, table, seq_lens, bs, scratch, **args)
    for r in range(rows):
        pos = lens[0] - rows + r
        alone = cpu_ops.decode_attention(
            q[r : r + 1],
            k[r : r + 1],
            v[r : r + 1],
            cache,
            table,
            torch.tensor([pos + 1], dtype=torch.int32),
            bs,
            scratch,
            window=window,
        )
        assert torch.equal(alone[0], together[r]), r
    want = TorchAttention(5, 1, c_decode=False, windows=(window,))
    meta.query_start_loc, meta.num_decodes = [0, rows], 0  # one prefill chunk of 7 rows
    meta.slot_mapping = torch.tensor(
        [int(table[0, p // bs]) * bs + p % bs for p in range(lens[0] - rows, lens[0])]
    )
    want.prepare(meta)
    expected = want.forward(q, k, v, cache, meta, window, None)
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize(
    ("window", "softcap", "group", "dtype"),
    [
        (None, None, 3, torch.float32),
        (7, 5.0, 1, torch.float32),
        (None, None, 8, torch.float32),
        (None, None, 3, BF16),
        (7, 5.0, 1, BF16),
        (None, None, 8, BF16),
    ],
)
def test_rows_verifying_drafts_give_the_bits_of_plain_decodes(window, softcap, group, dtype):
    """A sequence's 5 rows in one step (its token and 4 drafts) against the same tokens decoded
    one step each: identical outputs, so drafting never moves a greedy token."""
    gen = torch.Generator().manual_seed(group)
    kv_heads, dim, bs, length, rows = 2, 64, 4, 43, 5
    table = torch.randperm(16, generator=gen)[:12].to(torch.int32)[None]
    cache = random_kv_cache(16, kv_heads, bs, dim, gen, dtype)
    q = torch.randn(rows, kv_heads * group, dim, generator=gen).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    scratch = torch.empty(2, rows * group * length)
    caches = [tuple(c.clone() for c in cache) for _ in range(2)]
    together = cpu_ops.decode_attention(
        q,
        k,
        v,
        caches[0],
        table,
        torch.tensor([length], dtype=torch.int32),
        bs,
        scratch,
        window=window,
        softcap=softcap,
        query_start=torch.tensor([0, rows], dtype=torch.int32),
    )
    alone = [
        cpu_ops.decode_attention(
            q[r : r + 1],
            k[r : r + 1],
            v[r : r + 1],
            caches[1],
            table,
            torch.tensor([length - rows + 1 + r], dtype=torch.int32),
            bs,
            scratch,
            window=window,
            softcap=softcap,
        )
        for r in range(rows)
    ]
    assert torch.equal(together, torch.cat(alone))
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))


@needs_ops
@pytest.mark.parametrize(
    ("lens", "rows", "kv_heads", "group", "dim", "window", "softcap", "threads"),
    [
        ([37, 5, 130], [1, 1, 1], 3, 3, 64, None, None, 2),
        ([45, 9], [5, 3], 2, 4, 80, 9, None, 2),  # drafts; 80 dims: a 16-dim value tile
        ([300, 17], [1, 2], 2, 1, 128, None, 5.0, 1),
        ([61], [4], 1, 8, 64, None, None, 4),
    ],
)
def test_fp16_caches_give_the_bits_of_fp32_caches_holding_their_values(
    lens, rows, kv_heads, group, dim, window, softcap, threads
):
    """fp32 decode attention over fp16 caches: the new k/v are written rounded to nearest even
    (torch's `.half()`), and every output is the bits of the same step over fp32 caches that
    hold the same values (fp16 values convert exactly as they are read)."""
    bs = 4
    *_, cache, meta = _decode_step(lens, bs, kv_heads, group, dim, True, 5, dtype=torch.float32)
    tables = meta.block_tables_cpu
    gen = torch.Generator().manual_seed(7)
    total = sum(rows)
    q = torch.randn(total, kv_heads * group, dim, generator=gen) * 3
    k, v = (torch.randn(total, kv_heads, dim, generator=gen) * 3 for _ in range(2))
    half = tuple(c.half() for c in cache)
    wide = tuple(c.float() for c in half)
    args = (
        torch.from_numpy(np.ascontiguousarray(tables)),
        torch.tensor(lens, dtype=torch.int32),
        bs,
        torch.empty(threads, max(rows) * group * max(lens)),
    )
    starts = torch.tensor([0, *np.cumsum(rows)], dtype=torch.int32)
    kw = dict(window=window, softcap=softcap, query_start=starts)
    got = cpu_ops.decode_attention(q, k, v, half, *args, **kw)
    want = cpu_ops.decode_attention(q, k.half().float(), v.half().float(), wide, *args, **kw)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert all(torch.equal(h.float(), w) for h, w in zip(half, wide, strict=True))
    slots = [
        int(tables[i, p // bs]) * bs + p % bs
        for i, n in enumerate(lens)
        for p in range(n - rows[i], n)
    ]
    assert torch.equal(head_major(half[0])[:, slots], k.half().transpose(0, 1))  # written rows


@needs_ops
def test_bf16_rows_of_a_sequence_merge_the_shared_prefix_row_by_row():
    """Drafts under a cascade: each row takes the shared prefix's result at its own position
    (`prefix_pos` is by row) and gives the bits it gives as a one-row decode; the plan places
    every row of a member sequence, and -1 for the others' rows."""
    lens, rows, bs, group, dim = [30, 26, 19], [3, 2, 1], 4, 2, 64
    *_, cache, meta = _decode_step(lens, bs, 2, group, dim, True, 4, shared_blocks=3, sharing=2)
    tables = meta.block_tables_cpu
    qsl = [0, *np.cumsum(rows).tolist()]
    meta.query_start_loc, meta.num_decodes, meta.c_decode_rows = qsl, 1, 5
    meta.slot_mapping = torch.tensor(
        [
            int(tables[i, p // bs]) * bs + p % bs
            for i, n in enumerate(lens)
            for p in range(n - rows[i], n)
        ]
    )
    TorchAttention(2 * group, 2, c_decode=True, c_prefix=True).prepare(meta)
    plan = meta.prepared[None]
    assert isinstance(plan, CDecodePlan) and len(plan.shared.blocks) == 3
    assert plan.shared.rows.tolist() == [0, 1, 2, 3, 4]
    assert plan.prefix_pos.tolist() == [0, 1, 2, 3, 4, -1]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(qsl[-1], h, dim, generator=gen).to(BF16) for h in (2 * group, 2, 2))
    p_out = torch.randn(2, 5 * group, dim, generator=gen)
    p_lse = torch.randn(2, 5 * group, generator=gen)
    args = (plan.block_tables, plan.seq_lens, bs, torch.empty(2, 3 * group * max(lens)))
    prefix = (plan.prefix_pos, 3 * bs, p_out, p_lse)
    starts = torch.tensor(qsl, dtype=torch.int32)
    together = cpu_ops.decode_attention(q, k, v, cache, *args, prefix, query_start=starts)
    unmerged = cpu_ops.decode_attention(q, k, v, cache, *args, query_start=starts)
    assert not torch.equal(together[:5], unmerged[:5]) and torch.equal(together[5], unmerged[5])
    for t in range(qsl[-1]):
        s = int(np.searchsorted(qsl, t, side="right")) - 1
        alone = cpu_ops.decode_attention(
            q[t : t + 1],
            k[t : t + 1],
            v[t : t + 1],
            cache,
            plan.block_tables[s : s + 1],
            torch.tensor([lens[s] - (qsl[s + 1] - 1 - t)], dtype=torch.int32),
            bs,
            args[3],
            (plan.prefix_pos[t : t + 1], 3 * bs, p_out, p_lse),
        )
        assert torch.equal(alone[0], together[t]), t


@needs_ops
def test_decode_attention_takes_every_step_of_decodes_only():
    """Any number of sequences and keys; a shared prefix attended once only where the prefix
    kernel runs (bf16's: fp32's kernel rereads it for each sequence, each row's bits as alone);
    a step with a prefill chunk only where the runner lets its rows in (fp32's: any)."""
    for lens in ([5000, 4000], [10] * 40):
        *_, meta = _decode_step(lens, 16, 3, 3, 64, True, 0)
        TorchAttention(9, 3, c_decode=True).prepare(meta)
        assert isinstance(meta.prepared[None], CDecodePlan) and meta.prepared[None].shared is None
    for c_prefix in (False, True):
        *_, meta = _decode_step([20, 30], 4, 3, 3, 64, True, 0, shared_blocks=2)
        TorchAttention(9, 3, c_decode=True, c_prefix=c_prefix).prepare(meta)
        assert isinstance(meta.prepared[None], CDecodePlan)
        assert (meta.prepared[None].shared is not None) == c_prefix
    *_, meta = _decode_step([20, 30], 4, 3, 3, 64, True, 0)
    meta.num_decodes = 1  # the second sequence is a 1-token prefill chunk
    TorchAttention(9, 3, c_decode=True).prepare(meta)
    assert not isinstance(meta.prepared[None], CDecodePlan)
    meta.c_decode_rows = sys.maxsize
    TorchAttention(9, 3, c_decode=True).prepare(meta)
    assert isinstance(meta.prepared[None], CDecodePlan)


@needs_ops
@pytest.mark.parametrize(("rows", "n"), [(32, 49152), (1, 49152), (3, 7), (5, 16), (4, 17)])
@pytest.mark.parametrize("kind", ["normal", "ties", "nan", "all -inf"])
def test_argmax_gives_torchs_index(rows, n, kind):
    """The sampler's greedy pick: torch.argmax's index, the first among equal values and the
    first NaN where a row has one, over whole 16-lane vectors, a tail, and a row stride."""
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n + 3, generator=gen)[:, :n]  # rows 3 floats apart from their ends
    if kind == "ties":
        x = torch.randint(0, 3, (rows, n), generator=gen).float()
    elif kind == "nan":
        x[:, n // 2] = float("nan")
        x[0, n - 1] = float("nan")
    elif kind == "all -inf":
        x = torch.full((rows, n), float("-inf"))
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))


@needs_ops
@pytest.mark.parametrize("c_prefix", [False, True])
def test_a_steps_decodes_give_the_same_bits_beside_a_prefill(c_prefix):
    """A step's decodes run the C decode kernel whether or not the step also prefills a prompt
    (beside a prefill they had run the torch path, gathering their keys in fp32): each decode's
    output is the same bits as in a step of decodes only."""
    if c_prefix and not cpu.has_bf16_kernels():
        pytest.skip("no AVX512-BF16")
    lens, bs, kv_heads, group, dim, new = [90, 141, 300], 4, 2, 3, 64, 7
    q, k, v, cache, meta = _decode_step(lens, bs, kv_heads, group, dim, True, 0)
    tables = meta.block_tables_cpu
    free = sorted(set(range(cache[0].shape[0])) - set(tables.flatten().tolist()))[:2]
    width = tables.shape[1]
    mixed_tables = np.vstack([tables, [free + [0] * (width - 2)]]).astype(np.int32)
    gen = torch.Generator().manual_seed(1)
    q_new = torch.randn(new, kv_heads * group, dim, generator=gen).to(BF16)
    k_new, v_new = (torch.randn(new, kv_heads, dim, generator=gen).to(BF16) for _ in range(2))
    slots = [free[p // bs] * bs + p % bs for p in range(new)]
    mixed = AttentionMetadata(
        num_decodes=len(lens),
        query_start_loc=[0, 1, 2, 3, 3 + new],
        seq_lens=[*lens, new],
        block_tables=torch.from_numpy(mixed_tables),
        slot_mapping=torch.cat([meta.slot_mapping, torch.tensor(slots)]),
        block_size=bs,
        block_tables_cpu=mixed_tables,
    )
    together = [torch.cat(t) for t in zip((q, k, v), (q_new, k_new, v_new), strict=True)]
    outs = []
    for step, rows in ((meta, (q, k, v)), (mixed, together)):
        backend = TorchAttention(kv_heads * group, kv_heads, c_decode=True, c_prefix=c_prefix)
        backend.prepare(step)
        outs.append(backend.forward(*rows, tuple(c.clone() for c in cache), step))
    assert torch.equal(outs[1][: len(lens)], outs[0])
    assert isinstance(mixed.prepared[None], TorchPlan) and mixed.prepared[None].c_decodes


@needs_ops
def test_store_kv_writes_what_index_copy_writes():
    """A prefill chunk's k/v (views into qkv rows, as the model passes them) land in the
    block-major caches at their slots exactly as two `index_copy_` calls put them in the same
    caches' head-major rows."""
    gen = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim = 37, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim, generator=gen).to(BF16)
    k = qkv[:, 9 * dim : (9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (9 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(200, generator=gen)[:tokens]
    got = random_kv_cache(50, kv_heads, 4, dim, gen)
    want = tuple(head_major(c) for c in got)
    cpu_ops.store_kv(k, v, got, slots)
    want[0].index_copy_(1, slots, k.transpose(0, 1))
    want[1].index_copy_(1, slots, v.transpose(0, 1))
    assert all(torch.equal(head_major(a), b) for a, b in zip(got, want, strict=True))


@needs_ops
def test_store_kv_skips_negative_slots():
    """A slot < 0 is padding (`AttentionMetadata.slot_mapping`): nothing is written for it, also
    not just before the cache, which here is a view into a larger tensor whose first block is a
    guard."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, dim, slots_total = 2, 16, 12
    k, v = (torch.randn(3, kv_heads, dim, generator=gen).to(BF16) for _ in range(2))
    whole = random_kv_cache(slots_total // 4 + 1, kv_heads, 4, dim, gen)
    before = [w.clone() for w in whole]
    cache = tuple(w[1:] for w in whole)  # slot -1 would land in the guard block
    cpu_ops.store_kv(k, v, cache, torch.tensor([5, -1, 7]))
    for w, b, new in zip(whole, before, (k, v), strict=True):
        assert torch.equal(w[0], b[0])  # the guard
        rows, old = head_major(w[1:]), head_major(b[1:])
        assert torch.equal(rows[:, 5], new[0]) and torch.equal(rows[:, 7], new[2])
        untouched = [i for i in range(slots_total) if i not in (5, 7)]
        assert torch.equal(rows[:, untouched], old[:, untouched])


@needs_ops
def test_the_c_kernels_refuse_tensors_they_would_misread():
    """Raw pointers go to C: a wrong dtype, layout or size raises, naming what is wrong, before
    the kernel runs."""
    q, k, v, cache, meta = _decode_step([9, 5], 4, 3, 3, 64, True, 0)
    tables = torch.from_numpy(np.ascontiguousarray(meta.block_tables_cpu))
    lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    scratch = torch.empty(2, 3 * 9)
    good = (q, k, v, cache, tables, lens, 4, scratch)
    cpu_ops.decode_attention(*good)
    fp16_cache = tuple(c.half() for c in cache)
    fp32_cache = tuple(c.float() for c in cache)
    for args, match in [
        ((q, k, v, fp16_cache, *good[4:]), "bfloat16 queries cannot read a torch.float16"),
        ((q, k, v, fp32_cache, *good[4:]), "bfloat16 queries cannot read a torch.float32"),
        ((q.float(), *good[1:]), "float32 queries cannot read a torch.bfloat16"),
        ((q.float(), k, v, fp16_cache, *good[4:]), "k must be torch.float32"),
        ((q, k, v, tuple(c.double() for c in cache), *good[4:]), "bf16, fp16 or fp32"),
        ((q, k, v, cache, tables.long(), *good[5:]), "block_tables must be torch.int32"),
        ((q, k, v, cache, tables, lens[:1], *good[6:]), "seq_lens must have shape"),
        ((q, k, v, (cache[0], cache[1][:-1]), *good[4:]), "one shape"),
        ((q, k, v, cache, tables, lens, 8, scratch), "block_size must be the cache's, 4"),
        ((q, k, v, tuple(c.transpose(0, 1) for c in cache), *good[4:]), "contiguous"),
    ]:
        with pytest.raises(ValueError, match=match):
            cpu_ops.decode_attention(*args)
    with pytest.raises(ValueError, match="slots must be < "):
        cpu_ops.store_kv(k, v, cache, torch.tensor([0, cache[0].shape[0] * 4]))
    with pytest.raises(ValueError, match="blocks must be block ids"):
        cpu_ops.pack_prefix(cache, torch.tensor([0, -1]), 4)
    with pytest.raises(ValueError, match="pack_prefix reads bf16"):
        cpu_ops.pack_prefix(fp32_cache, torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="takes no shared prefix"):
        prefix = (torch.zeros(2, dtype=torch.int32), 4, torch.empty(3, 6, 64), torch.empty(3, 6))
        cpu_ops.decode_attention(q.float(), k.float(), v.float(), fp32_cache, *good[4:], prefix)


needs_prefix_attention = pytest.mark.skipif(
    not cpu.has_bf16_kernels(), reason="no AVX512-BF16 (or no C compiler)"
)


def _cascade(backend, q, k, v, cache, meta) -> torch.Tensor:
    backend.prepare(meta)
    assert meta.prepared[None].shared is not None
    return backend.forward(q, k, v, cache, meta)


@needs_prefix_attention
@pytest.mark.parametrize(
    ("lens", "dim", "group", "sharing", "c_decode"),
    [
        ([40, 37, 61], 64, 3, None, False),
        ([90] * 5, 128, 2, None, False),
        ([40, 37, 61], 64, 3, None, True),
        ([90, 45, 33, 70], 128, 2, 3, True),  # the last sequence is not in the prefix
    ],
)
def test_prefix_attention_gives_the_torch_cascade_and_keeps_its_packing(
    lens, dim, group, sharing, c_decode
):
    """A step of decodes sharing their first 8 blocks, the tails in torch or (`c_decode`) in
    the C decode kernel, which merges the prefix's result: the torch backend's output within
    bf16 rounding (the probabilities enter PV in bf16), and the next step over the same prefix
    reuses the packed copy."""
    outs = []
    for c_prefix in (True, False):
        backend = TorchAttention(2 * group, 2, c_decode=c_decode and c_prefix, c_prefix=c_prefix)
        step = _decode_step(lens, 4, 2, group, dim, True, 0, shared_blocks=8, sharing=sharing)
        outs.append(_cascade(backend, *step))
        assert isinstance(step[-1].prepared[None], CDecodePlan) == (c_decode and c_prefix)
        copies = dict(backend.prefix_kv)
        again = _cascade(backend, *step)  # the same step again: same k/v, and the kept copy
        assert all(backend.prefix_kv[key] is kv for key, kv in copies.items())
        assert torch.equal(again, outs[-1])
        (kept,) = copies.values()
        assert kept[0].dtype == (BF16 if c_prefix else torch.float32)  # packed, or fp32
    got, want = outs
    assert got.dtype == want.dtype == BF16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert (got.float() - want.float()).abs().mean() < 2e-3


@needs_prefix_attention
@pytest.mark.parametrize("kv_heads", [1, 2, 3])
def test_prefix_attention_over_padded_keys_and_rows(kv_heads):
    """Prefix lengths off the kernel's 32-key tiles, row counts off its 4- and 16-row tiles (AMX),
    and head sizes off its 64-dim passes; kv heads that the threads divide evenly (each takes its
    own) or do not (each takes the next task left)."""
    gen = torch.Generator().manual_seed(1)
    for length, rows, dim in ((4, 1, 64), (36, 7, 64), (100, 13, 64), (300, 37, 96), (68, 20, 256)):
        k_cache, v_cache = random_kv_cache(80, kv_heads, 4, dim, gen)
        blocks = torch.randperm(80, generator=gen)[: length // 4].int()
        q = torch.randn(kv_heads, rows, dim, generator=gen).to(BF16)
        packed = cpu_ops.pack_prefix((k_cache, v_cache), blocks, 4)
        out, lse = cpu_ops.prefix_attention(q, packed, length)
        slots = (blocks.long()[:, None] * 4 + torch.arange(4)).reshape(-1)
        keys, values = (head_major(c)[:, slots].float() for c in (k_cache, v_cache))
        scores = q.float() @ keys.transpose(1, 2) / dim**0.5
        torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, scores.softmax(-1) @ values, atol=1e-2, rtol=1e-2)


@needs_prefix_attention
@pytest.mark.parametrize(
    ("tokens", "context", "group", "window", "softcap", "kv_heads"),
    [
        (1, 0, 3, None, None, 2),
        (7, 0, 3, None, None, 1),
        (13, 22, 2, None, None, 2),
        (50, 30, 3, 16, None, 3),
        (9, 5, 4, None, 1.5, 2),
    ],
)
def test_prefill_attention_writes_prefix_attentions_values_token_major(
    tokens, context, group, window, softcap, kv_heads
):
    """The token-major prefill kernel against `prefix_attention` (causal) over the same packed
    keys, its rows regrouped by kv head and its fp32 output cast: the same bf16 values, for
    chunks with and without cached context, off the 4-row tiles, windowed and soft-capped, with
    kv heads the threads divide evenly or not."""
    gen = torch.Generator().manual_seed(tokens)
    dim, length = 64, context + tokens
    k_cache, v_cache = random_kv_cache(64, kv_heads, 4, dim, gen)
    blocks = torch.randperm(64, generator=gen)[: -(-length // 4)].int()
    packed = cpu_ops.pack_prefix((k_cache, v_cache), blocks, 4, length)
    # q as the model passes it: a view into wider rows (qkv), each token's heads side by side
    rows = torch.randn(tokens, (kv_heads * group + 2) * dim, generator=gen).to(BF16)
    q = rows[:, : kv_heads * group * dim].view(tokens, kv_heads * group, dim)
    out = torch.full((tokens, kv_heads * group, dim), float("nan"), dtype=BF16)
    cpu_ops.prefill_attention(q, packed, length, context, out, window, softcap)
    by_head = q.reshape(tokens, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    causal = (group, context, window or 0)
    want, _ = cpu_ops.prefix_attention(by_head, packed, length, causal, softcap)
    want = want.view(kv_heads, tokens, group, dim).permute(1, 0, 2, 3).reshape(out.shape)
    assert torch.equal(out, want.to(BF16))


@needs_prefix_attention
@pytest.mark.parametrize("kv_heads", [1, 2, 3])
def test_prefix_and_prefill_attention_give_the_same_bits_on_any_thread_count(kv_heads):
    """Threads that divide the kv heads evenly each run their own heads' row tiles, others take
    the next tile left; `pack_prefix`'s threads share its 32-token chunks: every tile and chunk is
    computed once whichever way, so one, two and three threads give the same bits (a tile or
    chunk skipped or run twice would leave or change rows)."""
    gen = torch.Generator().manual_seed(kv_heads)
    dim, context, tokens, group = 64, 40, 30, 3
    k_cache, v_cache = random_kv_cache(80, kv_heads, 4, dim, gen)
    blocks = torch.randperm(80, generator=gen)[:18].int()
    q = torch.randn(kv_heads, 41, dim, generator=gen).to(BF16)
    q_chunk = torch.randn(tokens, kv_heads * group, dim, generator=gen).to(BF16)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            packed = cpu_ops.pack_prefix((k_cache, v_cache), blocks, 4, context + tokens)
            out = torch.full((tokens, kv_heads * group, dim), float("nan"), dtype=BF16)
            cpu_ops.prefill_attention(q_chunk, packed, context + tokens, context, out)
            results.append((*packed, *cpu_ops.prefix_attention(q, packed, context), out))
    finally:
        torch.set_num_threads(before)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0], strict=True))
    assert not any(out.isnan().any() for *_, out in results)


def _ops_of(engine) -> tuple:
    layer = engine.runner.model.layers[0]
    return layer.input_layernorm.norm, layer.self_attn.rotary


@needs_ops
def test_bf16_engines_use_the_ops_and_match_torch_ops(tiny_model, one_thread):
    """Same log-probabilities (within bf16 noise) with and without them, for the prefill's
    token and a decode step's."""
    args = {"model": str(tiny_model), "dtype": "bfloat16", "num_kv_blocks": 64}
    fused, plain = LLM(**args), LLM(cpu_kernels=False, **args)
    assert _ops_of(fused.engine) == (cpu_ops.rms_norm, cpu_ops.rotary_embedding)
    assert _ops_of(plain.engine) == (cpu_ops.torch_rms_norm, cpu_ops.apply_rotary)
    assert fused.engine.runner.backend.c_decode and not plain.engine.runner.backend.c_decode
    assert fused.engine.sampler.argmax is cpu_ops.argmax  # greedy picks too, only with the ops
    assert plain.engine.sampler.argmax is not cpu_ops.argmax
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5)
    prompts = [[1, 5, 17, 923, 4, 88, 1024, 7, 3], [1, 400, 33, 2048]]
    for got, want in zip(
        fused.generate(prompts, params, use_tqdm=False),
        plain.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert got.outputs[0].token_ids[0] == want.outputs[0].token_ids[0]
        for got_lp, want_lp in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            shared = set(got_lp) & set(want_lp)
            assert len(shared) >= 4
            for token in shared:
                assert abs(got_lp[token].logprob - want_lp[token].logprob) < 0.1


def test_without_a_compiler_engines_keep_torch_ops(tiny_model, one_thread, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    cpu.load_library.cache_clear()
    try:
        assert not cpu.available()
        args = {"model": str(tiny_model), "dtype": "bfloat16", "num_kv_blocks": 16}
        with pytest.raises(ValueError, match="cpu_kernels=True"):
            LLM(cpu_kernels=True, **args)
        engine = LLM(**args).engine
        assert _ops_of(engine) == (cpu_ops.torch_rms_norm, cpu_ops.apply_rotary)
    finally:
        cpu.load_library.cache_clear()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds")
@pytest.mark.parametrize(
    ("arch", "needs"),
    [
        ("x86-64", set()),
        # AVX-512 without its bf16 dot products (Skylake-X, Ice Lake): the AVX-512 paths of the
        # elementwise ops build, the bf16 kernels do not
        ("skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    ],
)
def test_a_build_without_avx512_bf16_has_the_other_ops_but_not_prefix_attention(
    tmp_path, monkeypatch, arch, needs
):
    if not needs <= set(cpu_flags().split()):
        pytest.skip(f"this CPU cannot run a {arch} build")
    monkeypatch.setattr(library, "FLAGS", ["-O3", f"-march={arch}", "-shared", "-fPIC"])
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    cpu.load_library.cache_clear()
    try:
        assert cpu.available() and not cpu.has_bf16_kernels()
        x, weight = torch.randn(3, 64).to(BF16), torch.rand(64).to(BF16)
        got, want = cpu_ops.rms_norm(x, weight, 1e-6), cpu_ops.torch_rms_norm(x, weight, 1e-6)
        assert _bf16_ulps(got, want).max() <= 1
        logits = torch.randn(4, 1000)
        assert torch.equal(cpu_ops.argmax(logits), logits.argmax(dim=-1))
    finally:
        cpu.load_library.cache_clear()


@needs_ops
def test_fp32_engines_never_take_the_bf16_kernels(tmp_path, default_model_path, monkeypatch):
    """On a CPU with AVX512-BF16 an fp32 engine runs the C fp32 ops, not the bf16-only prefix
    and prefill attention (which would read its fp32 cache as bf16): stood in for here, on a
    head_dim those kernels take."""
    monkeypatch.setattr(cpu, "has_bf16_kernels", lambda: True)
    path = make_tiny_model(tmp_path, default_model_path, head_dim=64)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    backend = llm.engine.runner.backend
    assert backend.c_decode and not backend.c_prefix
    shared = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[*shared, 7], [*shared, 8]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_fp16_engines_refuse_cpu_kernels(tiny_model):
    with pytest.raises(ValueError, match="cpu_kernels=True needs a bfloat16 or float32 model"):
        LLM(model=str(tiny_model), dtype="float16", num_kv_blocks=16, cpu_kernels=True)
    with pytest.raises(ValueError, match="cpu_kernels"):
        LLM(model=str(tiny_model), cpu_kernels="yes")


AVX2_RUN = """
import json, sys
from paged_backend import LLM, SamplingParams, cpu
llm = LLM(dtype=sys.argv[1], num_kv_blocks=256)
params = SamplingParams(temperature=0, max_tokens=24)
outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print(json.dumps({
    "cpu": cpu.cpu_description(),
    "bf16_kernels": cpu.has_bf16_kernels(),
    "dtype": str(llm.engine.runner.dtype),
    "texts": [o.outputs[0].text for o in outs],
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 capability levels")
@pytest.mark.skipif(
    "avx512f" not in cpu_flags().split(),
    reason="no AVX-512 here: every test already runs as on such a CPU",
)
def test_capped_at_avx2_the_engine_runs_as_on_an_older_cpu(llm_fp32):
    """ATEN_CPU_CAPABILITY=avx2 stands this machine in for a CPU without AVX-512: torch's and
    our kernels take no AVX-512, the default dtype is fp32, and greedy text is the uncapped fp32
    engine's (RAG-style prompts sharing a prefix, so the prefix cache serves too)."""
    import json
    import os
    import subprocess
    import sys

    shared = "Retrieved: the Alm bridge was built in 1642 by the town's masons. "
    prompts = [shared + q for q in ("When was the bridge built?", "Who built the bridge?")]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    run = subprocess.run(
        [sys.executable, "-c", AVX2_RUN, "auto", json.dumps(prompts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    capped = json.loads(run.stdout.strip().splitlines()[-1])
    assert "capped by ATEN_CPU_CAPABILITY=avx2" in capped["cpu"] and "avx512" not in capped["cpu"]
    assert not capped["bf16_kernels"] and capped["dtype"] == "torch.float32"
    params = SamplingParams(temperature=0, max_tokens=24)
    assert capped["texts"] == [o.outputs[0].text for o in llm_fp32.generate(prompts, params)]


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        low, high = (int(end, 16) for end in block.split()[0].split("-"))
        if low <= address < high:
            return {m[1]: m[2] for m in re.finditer(r"^(\w+):\s+(\S+)", block, re.MULTILINE)}
    raise AssertionError(f"no mapping holds {address:#x}")


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_the_kv_cache_lies_on_huge_pages():
    """64 MiB of cache, zeroed, in a mapping the kernel backs with 2 MiB pages (`THPeligible`:
    the madvise took). Whether it finds free 2 MiB pages at that moment depends on the machine's
    fragmentation, so the pages themselves are not asserted; a fresh mapping without the advice
    is not eligible where huge pages are on request only (a fresh one: malloc may hand a plain
    tensor memory whose mapping an earlier test advised)."""
    cache = zeros_on_huge_pages((32, 1024, 1024), torch.bfloat16)
    assert not cache.any()
    fields = _mapping_of(cache.data_ptr() + (32 << 20))
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible")
    assert fields["THPeligible"] == "1"
    if "[madvise]" in THP.read_text():
        plain = torch.frombuffer(
            mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
        )
        assert _mapping_of(plain.data_ptr() + (32 << 20))["THPeligible"] == "0"


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_the_kv_cache_is_advised_onto_huge_pages_only_when_asked():
    """Without the advice a first touch commits a 4 KiB page, not 2 MiB: a cache of many regions
    (a layer's K or V) that holds a few tokens stays small until the runner
    advises huge pages (`ModelRunner.huge_pages_from_blocks`)."""
    cache = zeros_on_huge_pages((8, 1 << 20), torch.float32, advise=False)  # 8 regions, 4 MiB each
    cache[:, 0] = 1.0
    assert resident_bytes([cache])[1] <= 8 * (64 << 10)
    fields = _mapping_of(cache.data_ptr())
    if "THPeligible" in fields:
        assert fields["THPeligible"] == ("1" if "[always]" in THP.read_text() else "0")
    assert advise_huge_pages([cache[2:5]])
    if "THPeligible" in fields:
        assert _mapping_of(cache[3].data_ptr())["THPeligible"] == "1"
    assert huge_page_tokens(8, 64, torch.bfloat16) == 2048


def test_the_runner_advises_huge_pages_once_its_distinct_blocks_reach_the_threshold(
    tiny_model, monkeypatch
):
    """`ModelRunner.huge_pages_from_blocks` counts the blocks the step's tables name, a shared
    prefix's once: four requests over a cached 10-block prefix name 44 blocks but hold 14, under a
    threshold of 16; two more distinct prompts take the cache past it, and it is advised once."""
    advised = []
    monkeypatch.setattr(model_runner, "advise_huge_pages", lambda t: advised.append(len(t)))
    llm = LLM(model=str(tiny_model), num_kv_blocks=64, block_size=4)
    runner = llm.engine.runner
    runner.huge_pages_from_blocks = 16
    params = SamplingParams(max_tokens=1, temperature=0)
    prefix = list(range(100, 140))  # 10 blocks
    llm.generate([[*prefix, 7]], params, use_tqdm=False)  # cached for the next four
    llm.generate([[*prefix, i] for i in range(8, 12)], params, use_tqdm=False)
    assert not advised and runner.huge_pages_from_blocks == 16
    distinct = [list(range(200 + 40 * i, 240 + 40 * i)) for i in range(2)]
    llm.generate([[*prefix, 12], *distinct], params, use_tqdm=False)
    assert advised == [2 * len(runner.kv_caches)] and runner.huge_pages_from_blocks is None
    llm.generate(distinct, params, use_tqdm=False)
    assert len(advised) == 1


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc")
def test_weights_move_onto_huge_pages_in_place_and_leave_their_file_pages(tmp_path):
    """`move_to_huge_pages_`: every storage once into one region (a view keeps its place in
    its base, a parameter stays a parameter, values and dtypes as they were), and the pages of
    a file mapping the process read them from leave its resident set (re-read from the file
    if touched again)."""
    base = torch.randn(512, 1024)
    view = base[100:200, 8:]
    reshaped = torch.randn(64, 4, 1024).reshape(256, 1024)  # its `_base` holds the storage too
    weight = nn.Parameter(torch.randn(300, 700).to(torch.bfloat16), requires_grad=False)
    path = tmp_path / "blocks.bin"
    expected = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    expected.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    blocks = torch.from_numpy(mapped[4096:])
    before = [t.clone() for t in (base, view, weight, blocks, reshaped)]
    assert int(_mapping_of(blocks.data_ptr())["Rss"]) >= 8000  # kB: read in by the clone
    moved = move_to_huge_pages_([base, view, weight, blocks, reshaped])
    assert moved >= base.nbytes + weight.nbytes + blocks.nbytes + reshaped.nbytes
    both = (base, view, weight, blocks, reshaped, reshaped._base)  # the old storage: freed
    assert len({t.untyped_storage().data_ptr() for t in both}) == 1
    assert view.data_ptr() - base.data_ptr() == (100 * 1024 + 8) * 4
    assert isinstance(weight, nn.Parameter) and weight.dtype == torch.bfloat16
    for tensor, old in zip((base, view, weight, blocks, reshaped), before, strict=True):
        assert torch.equal(tensor, old)
    assert int(_mapping_of(mapped.ctypes.data)["Rss"]) <= 8  # kB: at most its first page
    assert np.array_equal(mapped, expected)  # the file's bytes, read again
    if THP.exists() and "[never]" not in THP.read_text():
        fields = _mapping_of(base.data_ptr())
        assert fields.get("THPeligible", "1") == "1"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc")
def test_a_weight_in_a_file_leaves_its_pages_as_each_part_is_copied(tmp_path, monkeypatch):
    """A file-backed storage is copied a part at a time, each part's pages dropped once copied:
    the largest weight (a 262,144-token embedding, ~140 MB) is never held twice while loading."""
    from paged_backend.cpu import memory

    monkeypatch.setattr(memory, "_COPY_BYTES", 1 << 20)
    path = tmp_path / "blocks.bin"
    expected = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    expected.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    blocks = torch.from_numpy(mapped)
    copy = blocks.clone()  # reads every page in
    resident_kb = []
    drop = memory._drop_pages
    monkeypatch.setattr(
        memory,
        "_drop_pages",
        lambda address, size: (
            resident_kb.append(int(_mapping_of(mapped.ctypes.data)["Rss"])) or drop(address, size)
        ),
    )
    move_to_huge_pages_([blocks])
    assert len(resident_kb) == 9  # 8 parts, then the whole range (pages across two parts)
    assert resident_kb == sorted(resident_kb, reverse=True)
    for part, kb in enumerate(resident_kb[:8]):  # the parts before it left (a kernel may map
        assert kb <= (9 - part) * 1024 + 8  # the file in 2 MiB folios, which leave whole)
    assert torch.equal(blocks, copy)


def _rss_mib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())[1]) >> 10


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc")
def test_the_kv_cache_commits_memory_as_it_is_used():
    """Allocating the cache writes nothing: its pages are committed at their first touch, and
    read as zeros until written."""
    before = _rss_mib()
    cache = zeros_on_huge_pages((2, 4, 32 << 20), torch.bfloat16)  # 512 MiB
    assert _rss_mib() - before < 64
    cache[0, 0, : 16 << 20] = 1.0  # 32 MiB written
    grown = _rss_mib() - before
    assert 32 <= grown < 96
    assert not cache[1].any() and cache.dtype == torch.bfloat16 and cache.is_contiguous()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc")
def test_freed_heap_memory_goes_back_to_the_system():
    """What a load frees between what it keeps (here 200 MiB of 4 KiB buffers, every tenth
    kept) stays resident until `release_freed_heap` (glibc) hands its pages back."""
    buffers = [bytearray(4096) for _ in range(51200)]
    kept = buffers[::10]
    del buffers
    before = _rss_mib()
    release_freed_heap()
    assert before - _rss_mib() > 100
    assert len(kept) == 5120


def test_the_library_is_called_by_the_c_parameter_names():
    """Each exported C function's parameters are read from its definition, and a call must name
    each of them: a missing, misspelt or extra name raises before C runs."""
    protos = library.prototypes(
        next(p for p in library.SOURCES if p.name == "cpu_ops.c").read_text()
    )
    _, params = protos["act_and_mul_bf16"]
    assert [name for name, _ in params] == ["x", "out", "rows", "dim", "gelu", "threads"]
    assert protos["has_bf16_kernels"][1] == ()
    if not cpu.available():
        pytest.skip("no C compiler")
    lib = cpu.load_library()
    x = torch.randn(2, 32).to(BF16)
    out = torch.empty(2, 16, dtype=BF16)
    args = dict(x=x.data_ptr(), out=out.data_ptr(), rows=2, dim=16, gelu=0, threads=1)
    for bad in ({**args, "extra": 1}, {k: v for k, v in args.items() if k != "dim"}):
        with pytest.raises(TypeError, match="act_and_mul_bf16"):
            lib.act_and_mul_bf16(**bad)
    lib.act_and_mul_bf16(**dict(reversed(args.items())))  # any order of names
    assert torch.equal(out, cpu_ops.torch_silu_and_mul(x))
