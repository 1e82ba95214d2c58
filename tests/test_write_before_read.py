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
from conftest import random_kv_cache

from paged_backend import cpu
from paged_backend.attention import AttentionMetadata
from paged_backend.attention.planner import CDecodePlan
from paged_backend.attention.torch_backend import TorchAttention
from paged_backend.cpu import ops as cpu_ops

needs_ops = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
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


def _decode_step(tables: np.ndarray, lens: list[int], num_blocks: int, seed: int):
    """Random bf16 caches of `num_blocks` blocks, q/k/v for one decode token per sequence (views
    into fused qkv rows, as the model passes them) and the step's metadata, as (q, k, v, cache,
    meta)."""
    gen = torch.Generator().manual_seed(seed)
    s, heads = len(lens), KV_HEADS * GROUP
    slots = [int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)]
    cache = random_kv_cache(num_blocks, KV_HEADS, BS, DIM, gen)
    qkv = torch.randn(s, (heads + 2 * KV_HEADS) * DIM, generator=gen).to(BF16)
    q, k, v = qkv.split([heads * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    q, k, v = q.view(s, heads, DIM), k.view(s, -1, DIM), v.view(s, -1, DIM)
    meta = AttentionMetadata(
        num_decodes=s,
        query_start_loc=list(range(s + 1)),
        seq_lens=lens,
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.tensor(slots),
        block_size=BS,
        block_tables_cpu=tables,
    )
    return q, k, v, cache, meta


def _reader_before_writer(long: int = 400, seed: int = 0):
    """A decode step of four sequences [W, X1, X2, V]. V's new token fills block `shared`, which W
    (a request admitted on a cache hit of that block) reads in the same step. X1 and X2 are long,
    so that two threads split the work as (W, X1 | X2, V): V's write comes after a long pair on
    the other thread, and on one thread after W's read. The cache holds stale values at V's slot.
    Returns (q, k, v, cache, meta)."""
    w_len, v_len = 2 * BS + 1, 2 * BS  # V fills its second block; W reads it and writes a third
    x_blocks = -(-long // BS)
    shared = [0, 1]
    tables = np.full((4, max(x_blocks, 3)), -1, dtype=np.int32)
    tables[0, :3] = [*shared, 2]
    tables[1, :x_blocks] = np.arange(3, 3 + x_blocks)
    tables[2, :x_blocks] = np.arange(3 + x_blocks, 3 + 2 * x_blocks)
    tables[3, :2] = shared
    return _decode_step(tables, [w_len, long, long, v_len], 3 + 2 * x_blocks + 1, seed)


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
    tables = np.array([[0, 1, 2, 3], [0, 1, 2, 4], [5, 6, 2, -1]], dtype=np.int32)
    return _decode_step(tables, [3 * BS + 1, 3 * BS + 1, 3 * BS], 7, seed)


@pytest.mark.parametrize(
    ("c_decode", "c_prefix"),
    [
        (False, False),
        pytest.param(True, False, marks=needs_ops),
        pytest.param(True, True, marks=needs_ops),
    ],
)
def test_no_cascade_reads_a_block_written_in_the_same_step(c_decode, c_prefix):
    if c_prefix and not cpu.has_bf16_kernels():
        pytest.skip("no AVX512-BF16")
    q, k, v, cache, meta = _cascade_over_a_block_written_now()
    ready = tuple(c.clone() for c in cache)
    slots = meta.slot_mapping
    ready[0][slots // BS, :, slots % BS] = k
    ready[1][slots // BS, :, slots % BS] = v
    outs = []
    for kv in (ready, cache):
        backend = TorchAttention(KV_HEADS * GROUP, KV_HEADS, c_decode=c_decode, c_prefix=c_prefix)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, kv, meta))
    assert torch.equal(outs[1], outs[0])


# ---- end to end: random schedules through the engine ---------------------------------------
GREEDY_LOGPROBS = dict(temperature=0, ignore_eos=True, logprobs=1)
# path -> (architecture, engine arguments): the fused one-call decode step (Llama, every linear on
# the C GEMM); the C decode kernel under the modules (Qwen2: biases keep it out of the fused step);
# the torch reference (fp32). The C GEMM is forced up to 64 rows, so that no kernel choice
# depends on the thread count or the batch: every step computes the same bits either way.
PATHS = {
    "fused": ("LlamaForCausalLM", dict(dtype="bfloat16", cpu_gemm_max_rows=64)),
    "c-modules": ("Qwen2ForCausalLM", dict(dtype="bfloat16", cpu_gemm_max_rows=64)),
    "torch": ("LlamaForCausalLM", dict(dtype="float32")),
}


@pytest.fixture(scope="module", params=sorted(PATHS))
def path_engine(request, tmp_path_factory, default_model_path):
    from conftest import make_tiny_model

    from paged_backend.engine import LLMEngine

    arch, args = PATHS[request.param]
    if request.param != "torch" and not cpu.has_bf16_kernels():
        pytest.skip("no AVX512-BF16")
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), default_model_path, arch)
    engine = LLMEngine(
        model=str(path), block_size=BS, max_num_batched_tokens=64, max_num_seqs=16, **args
    )
    return request.param, engine


def _run(engine, schedule, delay: int) -> dict[str, tuple]:
    """Run `schedule` = (plain requests: (id, prompt ids, max_tokens, step to add at), followers:
    (id, leader id, extra ids, max_tokens)). A follower's prompt is its leader's tokens so far
    plus `extra`, added `delay` steps after the first step of decodes only in which the leader's
    next token fills a block (delay 0: admitted on a hit of the block being written in that same
    step). Returns each request's (prompt ids, token ids, logprobs)."""
    from paged_backend import SamplingParams

    plain, followers = schedule
    pending = list(followers)
    due: list[tuple[int, tuple]] = []
    outputs: dict[str, tuple] = {}
    step = 0
    while step < 400:
        for rid, ids, max_tokens, at in plain:
            if at == step:
                engine.add_request(
                    None,
                    SamplingParams(max_tokens=max_tokens, **GREEDY_LOGPROBS),
                    rid,
                    prompt_token_ids=ids,
                )
        running = engine.scheduler.running
        decodes_only = not engine.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in running
        )
        for f in list(pending):
            parent = engine.parents.get(f[1])
            leader = parent.children[0] if parent else None
            if leader in running and decodes_only and leader.num_tokens % BS == 0:
                pending.remove(f)
                due.append((step + delay, f, list(leader.all_token_ids)))
        for item in [d for d in due if d[0] == step]:
            due.remove(item)
            _, (rid, _, extra, max_tokens), tokens = item
            params = SamplingParams(max_tokens=max_tokens, **GREEDY_LOGPROBS)
            engine.add_request(None, params, rid, prompt_token_ids=tokens + extra)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                logprobs = [list(d.items()) for d in c.logprobs]
                outputs[out.request_id] = (out.prompt_token_ids, c.token_ids, logprobs)
        step += 1
        if not engine.has_unfinished_requests() and not due and step > max(p[3] for p in plain):
            break
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return outputs


def _reader_ahead_schedule(rng: np.random.Generator) -> tuple[list, list]:
    """The issue's case: running X1 (long), V (short), X2 (a little shorter than X1); W follows V.
    Two threads split the step's (sequence, kv head) pairs as (X1, V | X2, W), and the second
    thread, with fewer keys to read first, reaches W's read of V's block before the first one
    reaches V's write (unless all writes come first)."""
    x1, v, x2 = (rng.integers(3, 2000, n).tolist() for n in (200, 7, 170))
    plain = [("x1", x1, 24, 0), ("v", v, 24, 0), ("x2", x2, 24, 0)]
    return plain, [("w", "v", rng.integers(3, 2000, 1).tolist(), 6)]


def _random_schedule(rng: np.random.Generator) -> tuple[list, list]:
    if rng.random() < 0.5:
        return _reader_ahead_schedule(rng)
    plain, followers = [], []
    for i in range(int(rng.integers(2, 6))):
        length = int(rng.integers(2, 40))
        ids = rng.integers(3, 2000, length).tolist()
        plain.append((f"p{i}", ids, int(rng.integers(4, 16)), int(rng.integers(0, 4))))
    for j in range(int(rng.integers(1, 4))):
        leader = plain[int(rng.integers(0, len(plain)))][0]
        extra = rng.integers(3, 2000, int(rng.integers(1, 3))).tolist()
        followers.append((f"f{j}", leader, extra, int(rng.integers(2, 8))))
    return plain, followers


def test_outputs_do_not_depend_on_threads_or_the_step_of_admission(path_engine):
    """Random schedules, with followers admitted on a hit of the block their leader fills in
    that same step, or one step later: on one thread and two, every request's tokens and logprobs
    are the same bits (where the kernels do not choose by thread count: not torch's fp32 GEMMs).
    Admitted a step later, a follower gets the same tokens, its logprobs up to the rounding of
    another batch (a cascade over the shared prefix, or none)."""
    name, engine = path_engine
    for seed in range(5):
        schedule = _random_schedule(np.random.default_rng(seed))
        runs = {}
        for delay in (0, 1):
            for threads in (1, 2):
                with torch_threads(threads):
                    runs[threads, delay] = _run(engine, schedule, delay)
                engine.kv.pool.reset_cache()
            assert {r[0] for r in schedule[0]} <= runs[1, delay].keys()
            assert "v" not in runs[1, delay] or "w" in runs[1, delay]  # the case ran
            if name == "torch":  # torch's fp32 GEMMs split their sums by thread and batch
                _assert_close_runs(runs[2, delay], runs[1, delay], 1e-4)
            else:
                assert runs[2, delay] == runs[1, delay], f"{name}, seed {seed}, delay {delay}"
        _assert_close_runs(runs[1, 1], runs[1, 0], 1e-4 if name == "torch" else 0.05)


def _assert_close_runs(got: dict, want: dict, atol: float) -> None:
    """Same tokens and near logprobs for every request with the same prompt in both runs."""
    same = [rid for rid in want if rid in got and got[rid][0] == want[rid][0]]
    assert len(same) >= len(want) // 2
    for rid in same:
        assert got[rid][1] == want[rid][1], rid
        for a, b in zip(got[rid][2], want[rid][2], strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            np.testing.assert_allclose(
                [lp.logprob for _, lp in a], [lp.logprob for _, lp in b], atol=atol
            )
