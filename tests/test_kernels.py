"""Triton kernels against torch references.

Without CUDA they run on CPU in the Triton interpreter, which costs ~4 ms per (program x
inner iteration): shapes are small and tiles large. A CPU pass checks the arithmetic and the
indexing; `test_kernels_compile_for_gpu` checks that the kernels compile for a GPU.
"""

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# @triton.jit reads TRITON_INTERPRET when it decorates, and triton decorates its own library
# (tl.max, tl.sigmoid, ...) when first imported: it must be set before `import triton`.
TRITON_IMPORTED_EARLIER = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")
if DEVICE == "cpu" and TRITON_IMPORTED_EARLIER:
    pytest.skip(
        "triton was imported in this process before TRITON_INTERPRET=1 was set: run this file "
        "in its own pytest process or set the variable in conftest.py",
        allow_module_level=True,
    )

from paged_backend.attention import AttentionMetadata  # noqa: E402
from paged_backend.attention.torch_backend import TorchAttention  # noqa: E402
from paged_backend.attention.triton.attention import unified_attention  # noqa: E402
from paged_backend.attention.triton.backend import TritonAttention  # noqa: E402
from paged_backend.attention.triton.cache import reshape_and_cache  # noqa: E402
from paged_backend.attention.triton.fused import (  # noqa: E402
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class PagedBatch:
    """Sequences (context_len, query_len) with their K/V scattered over shuffled cache blocks.

    The context's K/V is already in the cache; the new tokens' K/V is in `k`, `v` with its
    slots in `slot_mapping`. Unused cache slots hold NaN, so reading one shows in the output.
    Built on CPU; the kernels' inputs then move to DEVICE, the unpaged `keys`/`values` stay.
    """

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        *,
        num_kv_heads: int,
        group: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """With a `window`, the table entries wholly before a sequence's first visible key
        point at the spare block (NaN), as the engine leaves freed blocks. A `softcap` caps the
        scores (Gemma 2); the queries are then 3x larger, so that it changes the output."""
        gen = torch.Generator().manual_seed(seed)
        self.window = window
        self.softcap = softcap
        kvh, d, bs = num_kv_heads, head_dim, block_size
        self.seqs = seqs
        blocks_per_seq = [-(-(c + q) // bs) for c, q in seqs]
        num_blocks = sum(blocks_per_seq) + 1
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
        self.k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype)
        self.v_cache = self.k_cache.clone()
        self.keys, self.values, slots = [], [], []
        for i, (context, query_len) in enumerate(seqs):
            table = order[: blocks_per_seq[i]]
            order = order[blocks_per_seq[i] :]
            self.block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            if window is not None:
                dead = max(context - window + 1, 0) // bs
                self.block_tables[i, :dead] = order[-1]  # the spare block, never written
            pos = torch.arange(context + query_len)
            seq_slots = torch.tensor(table)[pos // bs] * bs + pos % bs
            keys = torch.randn(context + query_len, kvh, d, generator=gen).to(dtype)
            values = torch.randn(context + query_len, kvh, d, generator=gen).to(dtype)
            self.k_cache.view(-1, kvh, d)[seq_slots[:context]] = keys[:context]
            self.v_cache.view(-1, kvh, d)[seq_slots[:context]] = values[:context]
            self.keys.append(keys)
            self.values.append(values)
            slots.append(seq_slots[context:])
        self.k = torch.cat([k[c:] for k, (c, _) in zip(self.keys, seqs, strict=True)])
        self.v = torch.cat([v[c:] for v, (c, _) in zip(self.values, seqs, strict=True)])
        self.slot_mapping = torch.cat(slots)
        num_tokens = self.k.shape[0]
        q_std = 1.0 if softcap is None else 3.0
        self.q = (q_std * torch.randn(num_tokens, kvh * group, d, generator=gen)).to(dtype)
        query_lens = [q for _, q in seqs]
        self.query_start_loc = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
        self.seq_lens = [c + q for c, q in seqs]
        for name in ("q", "k", "v", "k_cache", "v_cache", "block_tables", "slot_mapping"):
            setattr(self, name, getattr(self, name).to(DEVICE))

    def reference(self) -> torch.Tensor:
        """Dense causal attention per sequence in fp32, from the unpaged K/V."""
        outs = []
        group = self.q.shape[1] // self.keys[0].shape[1]
        for i, (context, query_len) in enumerate(self.seqs):
            start = self.query_start_loc[i]
            q = self.q[start : start + query_len].float().cpu().transpose(0, 1)
            k = self.keys[i].float().repeat_interleave(group, 1).transpose(0, 1)
            v = self.values[i].float().repeat_interleave(group, 1).transpose(0, 1)
            scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            k_pos = torch.arange(context + query_len)[None, :]
            q_pos = context + torch.arange(query_len)[:, None]
            visible = k_pos <= q_pos
            if self.window is not None:
                visible &= k_pos > q_pos - self.window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append((probs @ v).transpose(0, 1))
        return torch.cat(outs)

    def attend(self, *, max_query_len: int | None, tile_n: int) -> torch.Tensor:
        """Write the new K/V into the cache, then run unified_attention; the output on CPU."""
        reshape_and_cache(self.k, self.v, self.k_cache, self.v_cache, self.slot_mapping)
        out = unified_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            torch.empty_like(self.q),
            torch.tensor(self.query_start_loc, dtype=torch.int32, device=DEVICE),
            torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
            self.block_tables,
            self.q.shape[-1] ** -0.5,
            max_query_len=max_query_len,
            tile_n=tile_n,
            window=self.window,
            softcap=self.softcap,
        )
        return out.float().cpu()

    def metadata(self) -> AttentionMetadata:
        num_decodes = next((i for i, (_, q) in enumerate(self.seqs) if q > 1), len(self.seqs))
        return AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            block_size=self.k_cache.shape[1],
        )


def random_seqs(rng: random.Random) -> list[tuple[int, int]]:
    """A decode plus up to five prefill chunks, some with a cached prefix, in random order."""
    seqs = [(rng.randint(1, 300), 1)]
    for _ in range(rng.randint(0, 5)):
        context = rng.choice([0, rng.randint(1, 300)])
        seqs.append((context, rng.randint(1, 64)))
    rng.shuffle(seqs)
    return seqs


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "block_size", "head_dim", "dtype", "tile_n"),
    [
        (1, 2, 16, 64, torch.float32, 128),
        (3, 1, 32, 64, torch.float32, 128),
        (4, 2, 16, 64, torch.float16, 128),
        (8, 1, 32, 64, torch.float32, 64),
        (3, 2, 48, 64, torch.float16, 32),
        (4, 1, 32, 128, torch.float16, 128),
        (4, 1, 16, 64, torch.bfloat16, 128),
    ],
    ids=str,
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unified_attention(group, num_kv_heads, block_size, head_dim, dtype, tile_n, seed):
    rng = random.Random(seed * 1000 + group * 100 + block_size + head_dim)
    batch = PagedBatch(
        random_seqs(rng),
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    out = batch.attend(max_query_len=max(q for _, q in batch.seqs), tile_n=tile_n)
    torch.testing.assert_close(out, batch.reference(), atol=ATOL[dtype], rtol=1e-2)


@pytest.mark.parametrize(("window", "tile_n"), [(7, 32), (40, 32), (40, 16), (200, 64)])
def test_unified_attention_with_a_sliding_window(window, tile_n):
    """Each query sees its last `window` keys: decodes, prefills longer than the window and
    chunks after a long context; the freed blocks before the window (NaN here) are not read."""
    batch = PagedBatch(
        [(150, 1), (9, 1), (0, 50), (120, 30)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=window,
        window=window,
    )
    out = batch.attend(max_query_len=50, tile_n=tile_n)
    torch.testing.assert_close(out, batch.reference(), atol=ATOL[torch.float32], rtol=1e-2)


@pytest.mark.parametrize(("window", "dtype"), [(None, torch.float32), (40, torch.bfloat16)])
def test_unified_attention_with_a_softcap(window, dtype):
    """Scores capped at 2 (Gemma 2's attention soft-cap, smaller here so that it bites): decodes,
    prefills and chunks after context, with and without a window."""
    batch = PagedBatch(
        [(150, 1), (0, 50), (60, 30)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=5,
        window=window,
        softcap=2.0,
    )
    out = batch.attend(max_query_len=50, tile_n=32)
    want = batch.reference()
    torch.testing.assert_close(out, want, atol=ATOL[dtype], rtol=1e-2)
    batch.softcap = None
    assert (batch.reference() - want).abs().max() > 0.1  # the cap matters


def test_unified_attention_without_max_query_len():
    """Without the hint the query tiles are as large as possible; decodes still work."""
    batch = PagedBatch(
        [(40, 1), (0, 20), (17, 1)],
        num_kv_heads=1,
        group=3,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=3,
    )
    out = batch.attend(max_query_len=None, tile_n=64)
    torch.testing.assert_close(out, batch.reference(), atol=ATOL[torch.float32], rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshape_and_cache_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kvh, d = 4, 16, 3, 64
    k = torch.randn(40, kvh, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(40, kvh, d, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40].to(DEVICE)
    slots[::7] = -1
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    reshape_and_cache(k, v, k_cache, v_cache, slots)

    keep = slots >= 0
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k_ref.view(-1, kvh, d)[slots[keep]] = k[keep]
    v_ref.view(-1, kvh, d)[slots[keep]] = v[keep]
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize(
    ("seqs", "num_kv_heads", "group", "dtype"),
    [
        # Engine order: decodes, then prefill chunks (cached prefix or none).
        pytest.param([(30, 1), (100, 1), (0, 24), (37, 20)], 3, 3, torch.float32, id="mixed"),
        pytest.param([(5, 1), (70, 1), (16, 1)], 2, 4, torch.float16, id="decodes"),
        pytest.param([(0, 33), (50, 9)], 1, 8, torch.float32, id="prefills"),
    ],
)
def test_triton_backend_matches_torch_backend(seqs, num_kv_heads, group, dtype):
    head_dim = 64
    batch = PagedBatch(
        seqs,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        seed=7,
    )
    # q, k, v as the model makes them: views of one fused projection.
    num_heads = num_kv_heads * group
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)

    # TorchAttention multiplies masked-out V rows by 0: unused slots must not hold NaN.
    paged = torch.stack([batch.k_cache, batch.v_cache]).nan_to_num_(0.0)  # [2, NB, bs, kvh, d]
    # The torch backend keeps a block's kv heads side by side: [NB, kvh, bs, d].
    block_major = paged.transpose(2, 3).contiguous()
    outs = []
    for backend, cache in (
        (TorchAttention(num_heads, num_kv_heads), block_major),
        (TritonAttention(), paged),
    ):
        meta = batch.metadata()
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, (cache[0], cache[1]), meta))
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL[dtype], rtol=1e-2)
    assert torch.equal(block_major.transpose(2, 3), paged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(5, 576, generator=gen).to(DEVICE, dtype) if with_residual else None
    got = rms_norm(x, weight, 1e-5, residual)
    want = rms_norm_ref(x, weight, 1e-5, residual)
    tol = {"atol": ATOL[dtype], "rtol": 1e-2}
    if with_residual:
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
    else:
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("rotary_dim", [64, 48], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rotary_embedding(dtype, rotary_dim):
    """A partial rotary (Phi-4-mini) rotates each head's first `rotary_dim` dims only."""
    gen = torch.Generator().manual_seed(0)
    head_dim = 64
    inv_freq = 1.0 / 100000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    positions = torch.randint(0, 8192, (6,), generator=gen)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    x = torch.randn(6, 9, head_dim, generator=gen).to(DEVICE, dtype)
    out = rotary_embedding(x, cos, sin)
    torch.testing.assert_close(out, rotary_embedding_ref(x, cos, sin), atol=ATOL[dtype], rtol=1e-2)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * 1536, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(
        silu_and_mul(x),
        silu_and_mul_ref(x),
        atol=ATOL[dtype],
        rtol=1e-2,
    )


# Run without the interpreter: @triton.jit must build real kernels to compile them.
COMPILE_FOR_GPU = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from paged_backend.attention.triton import attention, cache, fused

def check(kernel, pointers, constexprs, floats=()):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name) or ("fp32" if name in floats else "i32")
    src = ASTSource(kernel, signature, constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

def attn(dtype, group, head_dim, block_size, block_m, dot_precision, softcap_log2=0.0):
    data = dict.fromkeys(["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"], dtype)
    ints = dict.fromkeys(["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"], "*i32")
    check(attention._unified_attention_kernel, data | ints, dict(
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim,
        BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=32, DOT_PRECISION=dot_precision,
        SOFTCAP_LOG2=softcap_log2,
    ), floats=("scale_log2",))

attn("*bf16", 3, 64, 16, 16, "tf32")  # decode tile of SmolLM2's GQA
attn("*fp16", 4, 128, 48, 64, "tf32")
attn("*fp32", 1, 64, 32, 64, "ieee")
attn("*bf16", 2, 256, 16, 16, "tf32", softcap_log2=50.0 * 1.4426950408889634)  # Gemma 2
bf16 = "*bf16"
check(cache._reshape_and_cache_kernel, dict.fromkeys(
    ["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"], bf16) | {"slot_mapping_ptr": "*i64"},
    dict(BLOCK_SIZE=16, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_T=32))
norm_ptrs = dict.fromkeys(
    ["x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "new_residual_ptr"], bf16)
check(fused._rms_norm_kernel, norm_ptrs, dict(HAS_RESIDUAL=True, BLOCK=1024), floats=("eps",))
check(fused._rms_norm_kernel, norm_ptrs, dict(
    residual_ptr=None, new_residual_ptr=None, HAS_RESIDUAL=False, BLOCK=1024), floats=("eps",))
check(fused._rotary_kernel, dict.fromkeys(["x_ptr", "cos_ptr", "sin_ptr", "out_ptr"], bf16),
      dict(HALF=32, BLOCK_H=16, BLOCK_HALF=32))
check(fused._silu_and_mul_kernel, dict.fromkeys(["x_ptr", "out_ptr"], bf16), dict(BLOCK=1024))
"""


def test_kernels_compile_for_gpu():
    """The interpreter does not prove that a kernel compiles for a GPU: compile to sm_90.

    Triton builds the cubin with its bundled ptxas, no GPU needed. (Triton 3.9 itself pads
    tl.dot below 16; the kernels keep every dot dimension >= 16 for older Triton versions.)
    """
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_GPU],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
