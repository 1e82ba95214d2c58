"""The torch attention backend against dense per-sequence attention, including batches whose
sequences share cached prefix blocks (the cascade path), mixed decode/prefill steps, sliding
windows and soft-capped scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import head_major, random_kv_cache

from paged_backend import cpu
from paged_backend.attention import AttentionMetadata
from paged_backend.attention.torch_backend import TorchAttention, _attend, _attend_matmul, _merge

KVH, GROUP, D = 3, 3, 32


def dense_reference(
    q, keys, values, context: int, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """q [n, H, D] at positions context.., keys/values [seq_len, KVH, D]; fp32. With a
    `window`, as transformers' sliding-window mask: key > query - window; with a `softcap`, as
    its eager attention: scores -> tanh(scores / softcap) * softcap."""
    n, seq_len = q.shape[0], keys.shape[0]
    q, keys, values = q.float(), keys.float(), values.float()
    k = keys.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    v = values.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos, q_pos = torch.arange(seq_len)[None, :], torch.arange(context, context + n)[:, None]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def run_and_check(
    backend, cache, seqs, tables, bs, gen, tol=(1e-5, 1e-4), window=None, softcap=None
):
    """One step of `seqs` ((context, new tokens), decodes first) over block `tables`: forward,
    then compare every sequence with dense attention over what the cache holds after it, within
    `tol` (atol, rtol). q/k/v take the cache's dtype and head dim.

    With a `window`, the backend's tables point the blocks wholly before a sequence's first
    visible key at the cache's last block, filled with NaN, as the engine leaves freed blocks in
    the table: reading one would spread NaN. A `softcap` goes to the backend and the reference
    alike."""
    k_cache, v_cache = cache
    total, dim, dtype = sum(new for _, new in seqs), k_cache.shape[-1], k_cache.dtype
    q = torch.randn(total, KVH * GROUP, dim, generator=gen).to(dtype)
    k = torch.randn(total, KVH, dim, generator=gen).to(dtype)
    v = torch.randn(total, KVH, dim, generator=gen).to(dtype)
    qsl, slots = [0], []
    for (context, new), table in zip(seqs, tables, strict=True):
        qsl.append(qsl[-1] + new)
        slots += [table[p // bs] * bs + p % bs for p in range(context, context + new)]
    width = max(map(len, tables))
    seen = tables
    if window is not None:
        poison = k_cache.shape[0] - 1
        for c in cache:
            c[poison] = float("nan")
        seen = []
        for (context, _), table in zip(seqs, tables, strict=True):
            dead = max(context - window + 1, 0) // bs
            seen.append([poison] * dead + table[dead:])
    padded = np.array([t + [0] * (width - len(t)) for t in seen], dtype=np.int32)
    meta = AttentionMetadata(
        num_decodes=sum(1 for _, new in seqs if new == 1),
        query_start_loc=qsl,
        seq_lens=[c + n for c, n in seqs],
        block_tables=torch.from_numpy(padded),
        slot_mapping=torch.tensor(slots),
        block_size=bs,
        block_tables_cpu=padded,
    )
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, window, softcap)
    for i, ((context, new), table) in enumerate(zip(seqs, tables, strict=True)):
        token_slots = [table[p // bs] * bs + p % bs for p in range(context + new)]
        keys = head_major(k_cache)[:, token_slots].transpose(0, 1)
        values = head_major(v_cache)[:, token_slots].transpose(0, 1)
        want = dense_reference(q[qsl[i] : qsl[i + 1]], keys, values, context, window, softcap)
        got = out[qsl[i] : qsl[i + 1]].float()
        torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])
    return meta


def random_step(seed: int, shared_blocks: int, bs: int, num_blocks: int, decodes_only=False):
    """A step's sequences ((context, new tokens), decodes first, as the engine orders them),
    those with enough context sharing their first `shared_blocks`, and their block tables."""
    rng = np.random.default_rng(seed)
    seqs = [(int(rng.integers(shared_blocks * bs + 1, 150)), 1) for _ in range(rng.integers(1, 5))]
    if not decodes_only:
        seqs += [
            (int(rng.integers(shared_blocks * bs, 150)), int(rng.integers(2, 40)))
            for _ in range(rng.integers(1, 4))
        ]
        seqs.append((0, int(rng.integers(2, 30))))  # a fresh prefill with no context
    free = list(rng.permutation(np.arange(shared_blocks, num_blocks)))
    tables = []
    for context, new in seqs:
        n = -(-(context + new) // bs)
        shares = context > 0 and context >= shared_blocks * bs
        prefix = list(range(shared_blocks)) if shares else []
        tables.append(prefix + [int(free.pop()) for _ in range(n - len(prefix))])
    return seqs, tables


def random_cache(gen, num_blocks: int, bs: int, dim: int, dtype=torch.float32):
    return random_kv_cache(num_blocks, KVH, bs, dim, gen, dtype)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shared_blocks", [0, 3, 7])
@pytest.mark.parametrize("bs", [4, 16])
def test_torch_backend_matches_dense(seed, shared_blocks, bs):
    seqs, tables = random_step(seed, shared_blocks, bs, 200)
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(gen, 200, bs, D)
    meta = run_and_check(TorchAttention(KVH * GROUP, KVH), cache, seqs, tables, bs, gen)
    if shared_blocks >= 2 and sum(c >= shared_blocks * bs > 0 for c, _ in seqs) >= 2:
        assert meta.prepared[None].shared is not None  # the cascade path is what is under test


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shared_blocks", [0, 5])
@pytest.mark.parametrize("decodes_only", [False, True])
def test_c_kernels_match_dense(seed, shared_blocks, decodes_only):
    """bf16 caches through the C kernels: causal prefill chunks (with and without context), the
    shared prefix, and decode steps merging it, within bf16 rounding of dense attention."""
    seqs, tables = random_step(seed, shared_blocks, 4, 300, decodes_only)
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(gen, 300, 4, 64, torch.bfloat16)
    backend = TorchAttention(KVH * GROUP, KVH, c_decode=True, c_prefix=True)
    meta = run_and_check(backend, cache, seqs, tables, 4, gen, tol=(2e-2, 2e-2))
    assert (type(meta.prepared[None]).__name__ == "CDecodePlan") == decodes_only


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [5, 13, 64])
@pytest.mark.parametrize("kernels", ["torch", "c"])
def test_sliding_window_layers_see_their_window_only(seed, window, kernels):
    """A backend serving global and windowed layers: the windowed plan attends each query to its
    last `window` keys (decodes, chunks with context, fresh prefills longer than the window),
    never reads the blocks before them, and the global layers keep their cascade."""
    if kernels == "c" and not cpu.has_bf16_kernels():
        pytest.skip("no AVX512-BF16 C kernels")
    bs, num_blocks = 4, 300
    gen = torch.Generator().manual_seed(seed)
    c = kernels == "c"
    backend = TorchAttention(KVH * GROUP, KVH, c, c, windows=(None, window))
    dtype, dim, tol = (torch.bfloat16, 64, (2e-2, 2e-2)) if c else (torch.float32, D, (1e-5, 1e-4))
    for decodes_only in (False, True):
        seqs, tables = random_step(seed, 3, bs, num_blocks - 1, decodes_only)
        cache = random_cache(gen, num_blocks, bs, dim, dtype)
        run_and_check(backend, cache, seqs, tables, bs, gen, tol)  # a global layer
        run_and_check(backend, cache, seqs, tables, bs, gen, tol, window)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kernels", ["torch", "c"])
def test_soft_capped_scores_match_dense(seed, kernels):
    """A cap of 1.5 on scores of spread ~3 (so that it changes the output) through every path:
    the torch plans (fresh prefills, chunks after context, decodes, the cascade over a shared
    prefix) or the C kernels (causal prefix attention, decode steps with and without the shared
    prefix); global and windowed layers."""
    if kernels == "c" and not cpu.has_bf16_kernels():
        pytest.skip("no AVX512-BF16 C kernels")
    bs, num_blocks, window, softcap = 4, 300, 9, 1.5
    c = kernels == "c"
    backend = TorchAttention(KVH * GROUP, KVH, c, c, windows=(None, window))
    dtype, dim, tol = (torch.bfloat16, 64, (2e-2, 2e-2)) if c else (torch.float32, D, (1e-5, 1e-4))
    gen = torch.Generator().manual_seed(seed)
    for decodes_only in (False, True):
        seqs, tables = random_step(seed, 5, bs, num_blocks - 1, decodes_only)
        cache = tuple(3 * t for t in random_cache(gen, num_blocks, bs, dim, dtype))
        for layer_window in (None, window):
            meta = run_and_check(
                *(backend, cache, seqs, tables, bs, gen, tol, layer_window, softcap)
            )
        if decodes_only:
            assert (type(meta.prepared[None]).__name__ == "CDecodePlan") == c
        assert meta.prepared[None].shared is not None  # the cascade is under test too
    q, keys = 3 * torch.randn(4, KVH * GROUP, D), 3 * torch.randn(40, KVH, D)
    capped = dense_reference(q, keys, keys, 36, softcap=softcap)
    assert (capped - dense_reference(q, keys, keys, 36)).abs().max() > 0.1  # the cap matters


@pytest.mark.parametrize("masked", [False, True])
def test_flash_and_matmul_partial_attention_agree_and_merge_to_the_whole(masked):
    """`_attend` (torch's CPU flash kernel) and `_attend_matmul` (other devices) give the same
    output and log-sum-exp, and merging the results over two halves of the keys gives the
    result over all of them, as cascade attention relies on."""
    torch.manual_seed(int(masked))
    q, k, v = torch.randn(2, KVH, 5, D), torch.randn(2, KVH, 40, D), torch.randn(2, KVH, 40, D)
    mask = None
    if masked:  # each batch row sees a different number of keys in each half
        allowed = torch.arange(40)[None, :] % 20 < torch.tensor([[7], [20]])
        mask = torch.zeros(2, 1, 1, 40).masked_fill_(~allowed[:, None, None], float("-inf"))
    whole, whole_lse = _attend(q, k, v, mask, D**-0.5)
    for attend in (_attend, _attend_matmul):
        halves = [
            attend(q, k[:, :, s], v[:, :, s], None if mask is None else mask[..., s], D**-0.5)
            for s in (slice(0, 20), slice(20, 40))
        ]
        torch.testing.assert_close(_merge(*halves[0], *halves[1]), whole)
        full, lse = attend(q, k, v, mask, D**-0.5)
        torch.testing.assert_close(full, whole)
        torch.testing.assert_close(lse, whole_lse)


def test_shared_prefix_copies_are_reused_until_a_step_writes_into_their_blocks():
    """Decode steps over the same shared blocks reuse the prefix's fp32 K/V. When those blocks
    are freed and a new prompt is prefilled into them while two more requests share them in the
    same step (in-batch prefix sharing), the copies go and the cascade reads the new contents."""
    bs, num_blocks = 4, 16
    gen = torch.Generator().manual_seed(0)
    cache = random_cache(gen, num_blocks, bs, D)
    backend = TorchAttention(KVH * GROUP, KVH)
    decodes = [(17, 1), (18, 1)], [[0, 1, 2, 5, 6], [0, 1, 2, 7, 8]]  # sharing blocks 0-2
    run_and_check(backend, cache, *decodes, bs, gen)
    copies = dict(backend.prefix_kv)
    assert copies  # kept for the next step
    run_and_check(backend, cache, *decodes, bs, gen)
    assert all(backend.prefix_kv[key] is kv for key, kv in copies.items())  # and reused
    # One request writes a new 12-token prompt into blocks 0-2; two others hit them in-step.
    seqs = [(0, 14), (12, 3), (12, 2)]
    meta = run_and_check(
        backend, cache, seqs, [[0, 1, 2, 9], [0, 1, 2, 10], [0, 1, 2, 11]], bs, gen
    )
    assert meta.prepared[None].shared is not None
    assert all(backend.prefix_kv.get(key) is not kv for key, kv in copies.items())
