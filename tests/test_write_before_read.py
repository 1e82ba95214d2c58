"""A block is findable in the prefix cache as soon as its tokens are scheduled, so a request may
read, in the step that writes it, a slot that another request of the same step writes. Every
attention path must write the step's K/V for all rows before any row reads: here on the C decode
kernel with the threads split so that the writer runs after the reader, on the cascade (a shared
prefix attended before the decode kernel runs), and end to end through the engine, where the
outputs must not depend on the thread count or on the step in which a request is admitted."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from paged_backend import cpu_ops
from paged_backend.attention import AttentionMetadata
from paged_backend.torch_attention import CDecodePlan, TorchAttention

needs_ops = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
BF16 = torch.bfloat16
BS, KV_HEADS, GROUP, DIM = 4, 3, 3, 64


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _reader_before_writer(long: int = 400, seed: int = 0):
    """A decode step of four sequences [W, X1, X2, V]. V's new token fills block `shared`, which W
    (a request admitted on a cache hit of that block) reads in the same step. X1 and X2 are long,
    so that two threads split the work as (W, X1 | X2, V): V's write comes after a long pair on
    the other thread, and on one thread after W's read. The cache holds stale values at V's slot.
    Returns (q, k, v, cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    w_len, v_len = 2 * BS + 1, 2 * BS  # V fills its second block; W reads it and writes a third
    x_blocks = -(-long // BS)
    num_blocks = 3 + 2 * x_blocks + 1
    shared = [0, 1]
    tables = np.full((4, max(x_blocks, 3)), -1, dtype=np.int32)
    tables[0, :3] = [*shared, 2]
    tables[1, :x_blocks] = np.arange(3, 3 + x_blocks)
    tables[2, :x_blocks] = np.arange(3 + x_blocks, 3 + 2 * x_blocks)
    tables[3, :2] = shared
    lens = [w_len, long, long, v_len]
    slots = [int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)]
    cache = tuple(
        torch.randn(KV_HEADS, num_blocks * BS, DIM, generator=gen).to(BF16) for _ in range(2)
    )
    heads = KV_HEADS * GROUP
    qkv = torch.randn(4, (heads + 2 * KV_HEADS) * DIM, generator=gen).to(BF16)
    q, k, v = qkv.split([heads * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    q, k, v = q.view(4, heads, DIM), k.view(4, -1, DIM), v.view(4, -1, DIM)
    meta = AttentionMetadata(
        num_decodes=4,
        query_start_loc=list(range(5)),
        seq_lens=lens,
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.tensor(slots),
        block_size=BS,
        block_tables_cpu=tables,
    )
    return q, k, v, cache, meta


def _c_decode(q, k, v, cache, meta) -> torch.Tensor:
    backend = TorchAttention(KV_HEADS * GROUP, KV_HEADS, c_decode=True)
    backend.prepare(meta)
    assert isinstance(meta.prepared[None], CDecodePlan)
    return backend.forward(q, k, v, cache, meta)


@needs_ops
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_decode_kernel_writes_every_rows_kv_before_any_row_reads(threads):
    """W's output must be what it is when V's K/V were in the cache before the step, bit for bit,
    whichever thread writes V's slot and when."""
    q, k, v, cache, meta = _reader_before_writer()
    ready = tuple(c.clone() for c in cache)  # the same cache with every new K/V already in
    cpu_ops.store_kv(k, v, ready, meta.slot_mapping)
    with torch_threads(threads):
        want = _c_decode(q, k, v, ready, meta)
        got = _c_decode(q, k, v, cache, meta)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(cache, ready, strict=True))


@needs_ops
def test_the_c_decode_kernel_gives_the_same_bits_on_one_and_two_threads():
    q, k, v, cache, meta = _reader_before_writer(long=200, seed=1)
    outs = []
    for threads in (1, 2):
        with torch_threads(threads):
            outs.append(_c_decode(q, k, v, tuple(c.clone() for c in cache), meta))
    assert torch.equal(*outs)


def _cascade_over_a_block_written_now(seed: int = 0):
    """A decode step of [W1, W2, V]: W1 and W2 were admitted on cache hits of blocks 0-2 and
    share them; block 2 is V's, whose token fills it in this step (V's first blocks are private
    copies of 0 and 1: V was computed beside their owner, before either was cached). A cascade
    over blocks 0-2 would read block 2 before the decode kernel writes V's slot."""
    gen = torch.Generator().manual_seed(seed)
    tables = np.array([[0, 1, 2, 3], [0, 1, 2, 4], [5, 6, 2, -1]], dtype=np.int32)
    lens = [3 * BS + 1, 3 * BS + 1, 3 * BS]
    slots = [int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)]
    cache = tuple(torch.randn(KV_HEADS, 7 * BS, DIM, generator=gen).to(BF16) for _ in range(2))
    heads = KV_HEADS * GROUP
    q = torch.randn(3, heads, DIM, generator=gen).to(BF16)
    k, v = (torch.randn(3, KV_HEADS, DIM, generator=gen).to(BF16) for _ in range(2))
    meta = AttentionMetadata(
        num_decodes=3,
        query_start_loc=list(range(4)),
        seq_lens=lens,
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.tensor(slots),
        block_size=BS,
        block_tables_cpu=tables,
    )
    return q, k, v, cache, meta


@pytest.mark.parametrize(
    ("c_decode", "c_prefix"),
    [
        (False, False),
        pytest.param(True, False, marks=needs_ops),
        pytest.param(True, True, marks=needs_ops),
    ],
)
def test_no_cascade_reads_a_block_written_in_the_same_step(c_decode, c_prefix):
    if c_prefix and not cpu_ops.has_bf16_kernels():
        pytest.skip("no AVX512-BF16")
    q, k, v, cache, meta = _cascade_over_a_block_written_now()
    ready = tuple(c.clone() for c in cache)
    ready[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    ready[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    outs = []
    for kv in (ready, cache):
        backend = TorchAttention(KV_HEADS * GROUP, KV_HEADS, c_decode=c_decode, c_prefix=c_prefix)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, kv, meta))
    assert torch.equal(outs[1], outs[0])
