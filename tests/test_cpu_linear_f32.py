"""The C fp32 linear for steps of few rows (`cpu_ops.linear_f32`): torch's values to fp32
rounding, a row's result independent of the other rows and of the thread count (so drafting,
batching and thread counts never move a greedy token), and an fp32 engine that serves its small
steps with it gives the torch-only engine's greedy tokens."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from paged_backend import LLM, SamplingParams, cpu
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.quant import EXACT_F32_FORMATS, dequantize, linear_blocks_f32, random_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C kernels did not build")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 96, 161])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13])  # every tile shape
@pytest.mark.parametrize("bias", [False, True])
def test_linear_f32_gives_torchs_values(n, rows, bias):
    torch.manual_seed(n * 100 + rows)
    k = 200
    wide = torch.randn(rows, k + 24)
    x = wide[:, 8 : 8 + k]  # rows k + 24 apart
    weight = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    # sums of 200 products of magnitude ~14: fp32 rounding in another order
    got = cpu_ops.linear_f32(x, weight, b)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


# each a tile shape of its own; then a prefill's rows in blocks whose activations a core's L2
# holds: 2 (57 + 56 rows) and 3 at 576 inputs, and blocks of 5 + 4 and 6 + 6 + 5 at 8,192
@pytest.mark.parametrize(
    ("rows", "k"),
    [
        (2, 576),
        (3, 576),
        (5, 576),
        (6, 576),
        (11, 576),
        (113, 576),
        (300, 576),
        (9, 8192),
        (17, 8192),
    ],
)
@pytest.mark.parametrize("weights", ["fp32", *EXACT_F32_FORMATS])
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(rows, k, weights):
    """For an fp32 weight and for GGUF blocks (`linear_blocks_f32`) alike."""
    torch.manual_seed(rows)
    x = torch.randn(rows, k)
    if weights == "fp32":
        linear = partial(cpu_ops.linear_f32, weight=torch.randn(250, k), bias=None)
    else:
        linear = partial(linear_blocks_f32, weights=[random_blocks(weights, 250, k, seed=rows)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [linear(x[i : i + 1]) for i in range(rows)]
        torch.set_num_threads(2)
        together = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), together)


@pytest.mark.parametrize("n", [1, 7, 161])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13])  # every tile shape
def test_fp16_weights_give_the_bits_of_their_fp32_values(n, rows):
    """A head kept in fp16 (`half_head_`) reads half the bytes and gives the same logits."""
    torch.manual_seed(n + rows)
    x = torch.randn(rows, 200)
    half = torch.randn(n, 200).half()
    half[0, :3] = torch.tensor([6e-8, -1e-5, 65504.0])  # subnormal, small, the largest
    assert torch.equal(cpu_ops.linear_f32(x, half, None), cpu_ops.linear_f32(x, half.float(), None))


def test_a_step_without_rows_gives_an_empty_result():
    assert cpu_ops.linear_f32(torch.empty(0, 16), torch.randn(5, 16), None).shape == (0, 5)


def test_linear_f32_fits_only_what_it_reads_right():
    assert cpu_ops.linear_f32_fits(torch.zeros(4, 16))
    assert not cpu_ops.linear_f32_fits(torch.zeros(4, 12))  # k not a multiple of 8
    assert not cpu_ops.linear_f32_fits(torch.zeros(16, 4).t())  # not contiguous
    assert not cpu_ops.linear_f32_fits(torch.zeros(4, 16, dtype=torch.bfloat16))
    assert cpu_ops.linear_f32_fits(torch.zeros(4, 16, dtype=torch.float16))


def test_fp32_engines_serve_small_steps_in_c_with_torchs_tokens(tiny_model, one_thread):
    """The choice shows in `stats()`; `cpu_kernels=False` keeps torch. Prompts of 1-40 tokens
    batched: prefills of many rows run torch's linear, decodes of few the C one."""
    c = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64, cpu_gemm_max_rows=8)
    plain = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64, cpu_kernels=False)
    assert set(c.stats()["cpu_gemm_max_rows"].values()) == {8}
    assert plain.stats()["cpu_gemm_max_rows"] == {}
    calls = []
    linear_f32 = cpu_ops.linear_f32
    cpu_ops.linear_f32 = lambda x, w, b: calls.append(x.shape[0]) or linear_f32(x, w, b)
    prompts = [[7 + i] * (1 + 13 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        got = c.generate(prompts, params, use_tqdm=False)
    finally:
        cpu_ops.linear_f32 = linear_f32
    assert calls and max(calls) <= 8
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_without_c_kernels_no_step_calls_the_c_linear(tiny_model, one_thread, monkeypatch):
    """`cpu_kernels=False` keeps every linear in torch, steps whose logits have no rows (a
    chunked prefill's first chunks) included: the C library may not even exist there."""

    def refuse(*args):
        raise AssertionError("linear_f32 called")

    monkeypatch.setattr(cpu_ops, "linear_f32", refuse)
    llm = LLM(
        model=str(tiny_model),
        dtype="float32",
        num_kv_blocks=64,
        cpu_kernels=False,
        max_num_batched_tokens=16,
    )
    out = llm.generate([[7] * 40], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("fmt", EXACT_F32_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13])  # every tile shape
def test_gguf_blocks_give_linear_f32s_bits_on_their_values(fmt, rows):
    """An fp32 model dequantized from a GGUF file reads its small steps' weights from the
    blocks (`linear_blocks_f32`): the outputs of the dequantized weight, bit for bit, for parts
    side by side (a fused qkv) and a bias."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 96 + 24)[:, 8:104]  # rows 120 apart
    parts = [random_blocks(fmt, 7, 96, seed=rows), random_blocks(fmt, 161, 96, seed=rows + 50)]
    bias = torch.randn(168)
    values = torch.cat([dequantize(part) for part in parts])
    assert torch.equal(linear_blocks_f32(x, parts, bias), cpu_ops.linear_f32(x, values, bias))
