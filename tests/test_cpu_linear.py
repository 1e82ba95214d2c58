"""CPU linears of bf16 models (`paged_backend.cpu.linear`): packed weights are bit-identical to
`F.linear` at every step size; the bf16 copy for `cpu_ops.gemm` serves 1-4 row steps with exact
products; the fp16 copy serves 1-2 row steps only and holds the bf16 values exactly; the int4
copy holds a Q4 grid and serves 1-4 row steps; all are used only where they work; and an engine
with packed weights gives exactly the outputs of the same engine without them, one with int4
the same greedy text on these prompts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model
from torch import nn

from paged_backend import LLM, EngineConfig, SamplingParams, cpu
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.linear import (
    EVERY_STEP,
    FP16_MAX_ROWS,
    INT4_MAX_ROWS,
    CpuLinear,
    can_pack,
    can_quantize_int4,
    prefill_count,
    quantize_int4,
    replace_linears_,
)
from paged_backend.default_model import default_model_file

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU), reason="no oneDNN bf16 on this CPU"
)


def _linear(bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(96, 160, bias=bias).to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weights_are_bit_identical_to_f_linear(rows, bias):
    linear = _linear(bias, rows)
    packed = CpuLinear(linear.weight, linear.bias, pack=True, fp16_copy=False)
    x = torch.randn(rows, 192, dtype=torch.bfloat16)[:, ::2]  # strided rows, as sliced inputs are
    with torch.inference_mode():  # as the engine runs (with autograd, biased F.linear differs)
        out, want = packed(x), F.linear(x, linear.weight, linear.bias)
    assert packed.weight is None  # the packed copy replaces the plain weight
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    assert torch.equal(out, want)


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_packing)])
def test_the_fp16_copy_serves_small_steps_only(pack):
    linear = _linear(bias=True)
    layer = CpuLinear(linear.weight, linear.bias, pack=pack, fp16_copy=True)
    assert torch.equal(layer.fp16.to(torch.bfloat16), linear.weight)  # the same values
    small = torch.randn(FP16_MAX_ROWS, 96, dtype=torch.bfloat16)
    large = torch.randn(FP16_MAX_ROWS + 1, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        exact = F.linear(small.float(), linear.weight.float())
        fp32 = layer(small, out_dtype=torch.float32)
        assert fp32.dtype == torch.float32
        # fp16 products, fp32 sums: within fp16 rounding of the exact result, before the bias.
        torch.testing.assert_close(fp32 - linear.bias.float(), exact, rtol=2e-3, atol=2e-3)
        assert layer(small).dtype == torch.bfloat16
        assert torch.equal(layer(large), F.linear(large, linear.weight, linear.bias))


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_packing)])
def test_the_gemm_copy_serves_steps_of_up_to_64_rows(pack):
    linear = _linear(bias=True)
    layer = CpuLinear(
        linear.weight, linear.bias, pack=pack, fp16_copy=True, gemm_rows=cpu_ops.GEMM_MAX_ROWS
    )
    assert layer.gemm is not None and layer.fp16 is None  # in the fp16 copy's place
    with torch.inference_mode():
        for rows in range(1, cpu_ops.GEMM_MAX_ROWS + 1):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            exact = F.linear(x.float(), linear.weight.float(), linear.bias.float())
            # exact bf16 products, fp32 sums: fp32 rounding only, before the bias
            torch.testing.assert_close(layer(x, out_dtype=torch.float32), exact)
            got, want = layer(x), F.linear(x, linear.weight, linear.bias)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)  # a bf16 step at most
        # each row sums in the same order whatever the step's size: batching changes no bits
        assert torch.equal(layer(x[-1:]), got[-1:]) and torch.equal(layer(x[:3]), got[:3])
        large = torch.randn(cpu_ops.GEMM_MAX_ROWS + 1, 96, dtype=torch.bfloat16)
        assert torch.equal(layer(large), F.linear(large, linear.weight, linear.bias))
    odd = nn.Linear(96, 100).to(torch.bfloat16)  # 100 outputs: not whole blocks of 16
    layer = CpuLinear(odd.weight, None, pack=pack, fp16_copy=True, gemm_rows=8)
    assert layer.gemm is None and layer.fp16 is not None


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
@pytest.mark.parametrize("case", ["random", "tie", "nan"])
def test_the_gemm_copys_argmax_is_its_outputs_argmax_a_slice_at_a_time(case, monkeypatch):
    """`CpuLinear.argmax`: the argmax of its fp32 outputs' first `columns` (the first of equal
    maxima, the first NaN), from slices of 32 outputs whose bits are the whole product's, where
    the C GEMM serves the step; None where another copy does."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    bias = linear.bias.detach().float()
    with torch.no_grad():
        if case == "tie":  # outputs 40 and 130 equal, and the largest: the first wins
            linear.weight[130] = linear.weight[40]
            bias[40] = bias[130] = 1e6
        if case == "nan":  # NaN at 70 and 150, past the largest at 20: the first NaN wins
            bias[20], bias[70], bias[150] = 1e6, float("nan"), float("nan")
    layer = CpuLinear(linear.weight, bias, pack=False, fp16_copy=True, gemm_rows=8)
    for rows in (1, 3, 8):
        monkeypatch.setattr(cpu_ops, "ARGMAX_SLICE_BYTES", 4 * rows * 32)
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        outputs = layer(x, out_dtype=torch.float32)
        whole = cpu_ops.gemm(x, layer.gemm, torch.float32)
        for first in range(0, 160, 32):
            part = cpu_ops.gemm(x, layer.gemm[first // 16 : first // 16 + 2], torch.float32)
            assert torch.equal(part, whole[:, first : first + 32])
        for columns in (160, 150, 41):
            expected = outputs[:, :columns].argmax(dim=-1)
            assert torch.equal(layer.argmax(x, columns), expected)
        if case != "random":
            assert set(layer.argmax(x, 160).tolist()) == {40 if case == "tie" else 70}
    assert layer.argmax(torch.randn(9, 96, dtype=torch.bfloat16), 160) is None  # oneDNN's step
    with pytest.raises(ValueError, match="columns must lie in"):
        layer.argmax(x, 161)


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
def test_a_bf16_engines_greedy_rows_take_their_tokens_without_their_logits(monkeypatch):
    """Where the C GEMM serves the head's steps, a greedy batch takes its tokens from its slices
    and never holds the logits; the tokens are those of the whole logits."""
    llm = LLM(dtype="bfloat16", num_kv_blocks=64, cpu_gemm_max_rows=8)
    runner = llm.engine.runner
    assert runner.model.cpu_head.gemm_rows == 8
    whole: list[int] = []
    real = runner.logits
    monkeypatch.setattr(runner, "logits", lambda h: whole.append(len(h)) or real(h))
    prompts = ["The capital of France is", "def fibonacci(n):", "List three uses of copper:"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert whole == []
    monkeypatch.setattr(runner, "logits_argmax", lambda h, columns: None)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert whole


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
def test_a_gemm_copy_for_every_step_is_the_only_copy():
    """A weight whose C GEMM copy serves every step (`EVERY_STEP`, a large model's) keeps no
    plain or packed weight; steps of any size (past the 64 rows timed), strided inputs too,
    give its exact-product sums, each row the same bits alone or in the step."""
    linear = _linear(bias=True)
    layer = CpuLinear(linear.weight, linear.bias, pack=False, fp16_copy=True, gemm_rows=EVERY_STEP)
    assert layer.gemm is not None and layer.weight is None and layer.packed is None
    x = torch.randn(130, 192, dtype=torch.bfloat16)[:, ::2]
    with torch.inference_mode():
        exact = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        got = layer(x, out_dtype=torch.float32)
        torch.testing.assert_close(got, exact)
        assert torch.equal(layer(x[-1:], out_dtype=torch.float32), got[-1:])


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
def test_a_large_bf16_model_keeps_one_gemm_copy_and_its_fused_step(monkeypatch):
    """Past `FP16_COPY_MAX_BYTES` (here: any model) a bf16 model's linears and head keep only
    the C GEMM's copy, which serves every step, and the one-call decode step runs on it (a GGUF
    file read dequantized too); its greedy text is the packed engine's but for near ties.
    Asking for packing keeps oneDNN's."""
    from paged_backend import model_runner

    monkeypatch.setattr(model_runner, "FP16_COPY_MAX_BYTES", 0)
    args = {"dtype": "bfloat16", "num_kv_blocks": 96, "enable_prefix_caching": False}
    one_copy = LLM(**args)
    model = one_copy.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert linears and all(
        m.weight is None and m.packed is None and m.gemm_rows == EVERY_STEP for m in linears
    )
    assert model.fused_decode is not None
    dequantized = LLM(model=str(default_model_file()), quantization="none", **args)
    assert dequantized.engine.runner.model.cpu_head.gemm_rows == EVERY_STEP  # a GGUF read as bf16
    packed = LLM(pack_weights=True, fp16_decode_weights=False, **args)
    assert packed.engine.runner.model.cpu_head.packed is not None
    prompt = packed.engine.apply_chat_template([{"role": "user", "content": "Describe a river."}])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    got = one_copy.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    want = packed.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    _assert_same_text_but_for_ties(got, want)


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
@needs_packing
@pytest.mark.parametrize("gemm_rows", [0, 1, 8])
def test_steps_beyond_the_chosen_rows_run_onednn(gemm_rows):
    """`gemm_rows` (timed per machine by `kernel_choice`) splits the steps: the C GEMM up to
    it, oneDNN's packed weights, bit-identical to `F.linear`, above it."""
    linear = _linear(bias=False)
    layer = CpuLinear(linear.weight, None, pack=True, fp16_copy=True, gemm_rows=gemm_rows)
    assert (layer.gemm is None) == (gemm_rows == 0) and layer.fp16 is None
    with torch.inference_mode():
        for rows in (1, 2, 8, 9, 32):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            got = layer(x)
            if rows <= gemm_rows:
                assert torch.equal(got, cpu_ops.gemm(x, layer.gemm, torch.bfloat16))
            else:
                assert torch.equal(got, F.linear(x, linear.weight))


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
@needs_packing
def test_a_prefill_step_runs_the_kernel_that_won_its_timed_count(monkeypatch):
    """Past `gemm_rows` and the decode sizes timed for it, a step runs the C GEMM where it won
    the first timed prefill count its rows do not exceed (the last for more), else oneDNN; a
    shape that won only prefill counts still gets the C GEMM's copy."""
    linear = _linear(bias=False)
    layer = CpuLinear(
        linear.weight, None, pack=True, fp16_copy=True, gemm_rows=0, gemm_prefill=(128, 256, 2048)
    )
    assert layer.gemm is not None and layer.gemm_rows == 0
    ran = []
    gemm = cpu_ops.gemm
    monkeypatch.setattr(cpu_ops, "gemm", lambda *a: ran.append(a[0].shape[0]) or gemm(*a))
    with torch.inference_mode():
        for rows in (1, 64, 65, 256, 257, 1536, 1537, 2048, 2100):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            got = layer(x)
            if rows in (65, 256, 1537, 2048, 2100):
                assert ran[-1] == rows
                assert torch.equal(got, gemm(x, layer.gemm, torch.bfloat16))
            else:
                assert torch.equal(got, F.linear(x, linear.weight))
    assert ran == [65, 256, 1537, 2048, 2100]
    assert [prefill_count(r) for r in (1, 128, 129, 2048, 5000)] == [128, 128, 256, 2048, 2048]


@needs_packing
def test_replace_linears_reaches_every_linear_below_a_module():
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4)))
    model.to(torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        replace_linears_(model, pack=True, fp16_copy=False)
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, CpuLinear) for m in model.modules()) == 2
    assert torch.equal(got, want)


def test_only_bf16_cpu_weights_can_be_packed():
    assert not can_pack(torch.float32, CPU)
    assert not can_pack(torch.bfloat16, torch.device("cuda"))


def _q4_weight(n: int, k: int) -> torch.Tensor:
    """A weight on a GGUF Q4_1-style grid: q * d + m per group of 32 inputs, d and m fp16."""
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 puts the group's min and max on the ends
    d = (torch.rand(n, k // 32, 1) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, 1) * 0.05).half().float()
    return (q * d + m).view(n, k)


@pytest.mark.skipif(not can_quantize_int4(torch.ones(1, 32)), reason="no int4 CPU kernel")
def test_int4_copy_holds_a_q4_grid_and_serves_small_steps_only():
    torch.manual_seed(0)
    weight = _q4_weight(96, 128)
    packed, scales = quantize_int4(weight)
    assert scales.shape == (4, 96, 2) and scales.dtype == torch.bfloat16
    # The grid comes back exactly before the scales are rounded to bf16.
    groups = weight.view(96, 4, 32)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    q = torch.round((groups - low) / step)
    torch.testing.assert_close(q * step + low, groups, rtol=0, atol=1e-6)
    # What the kernel computes: (q - 8) * scale + zero, with the bf16 scales and zeros.
    s, z = scales[..., 0].float().t()[..., None], scales[..., 1].float().t()[..., None]
    held = ((q - 8) * s + z).view(96, 128)
    assert (held - weight).abs().max() <= 8 * 2**-8 * weight.abs().max()
    w16 = weight.to(torch.bfloat16)
    layer = CpuLinear(
        w16, None, pack=can_pack(torch.bfloat16, CPU), fp16_copy=True, int4=(packed, scales)
    )
    assert layer.fp16 is None  # int4 takes the small steps
    small = torch.randn(INT4_MAX_ROWS, 128, dtype=torch.bfloat16)
    large = torch.randn(INT4_MAX_ROWS + 1, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(
            layer(small).float(), small.float() @ held.t(), rtol=2e-2, atol=2e-2
        )
        assert torch.equal(layer(large), F.linear(large, w16))


def test_fp32_engines_keep_plain_weights_and_refuse_the_options(llm_fp32):
    assert llm_fp32.engine.runner.model.cpu_head is None
    for name, value in (
        ("pack_weights", True),
        ("fp16_decode_weights", True),
        ("quantization", "int4"),
    ):
        with pytest.raises(ValueError, match=name):
            LLM(dtype="float32", num_kv_blocks=8, **{name: value})
    for name, value in (
        ("pack_weights", 1.0),
        ("fp16_decode_weights", "yes"),
        ("quantization", "int3"),
    ):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: value})


@pytest.mark.slow
@needs_packing
def test_bf16_engines_pack_by_default_and_give_the_plain_engines_outputs():
    """Packed weights alone: the same tokens and logprobs, bit for bit, through mixed
    prefill/decode batches. With the default fp16 copy as well, one request at a time (every
    decode step reads the copy), greedy text stays the plain engine's up to a near tie.
    (No prefix caching: in bf16, a cached prefix's attention sums in another order, which can
    flip a near tie by itself.)"""
    args = {"dtype": "bfloat16", "num_kv_blocks": 96, "enable_prefix_caching": False}
    plain = LLM(pack_weights=False, fp16_decode_weights=False, **args)
    packed = LLM(fp16_decode_weights=False, **args)
    default = LLM(**args)
    head = default.engine.runner.model.cpu_head
    assert head.packed is not None
    chosen = default.engine.runner.gemm_rows  # None without the C kernels: the fp16 copy then
    assert head.fp16 is not None if chosen is None else head.gemm_rows in chosen.values()
    assert packed.engine.runner.model.cpu_head.fp16 is None
    assert packed.engine.runner.model.cpu_head.gemm is None
    assert plain.engine.runner.model.cpu_head is None
    prompts = [
        plain.engine.apply_chat_template([{"role": "user", "content": q}])
        for q in (
            "Write a story about a dragon.",
            "What is the capital of France?",
            "List three uses of copper.",
        )
    ]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    got = packed.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    for prompt in prompts:
        g = default.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        w = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        _assert_same_text_but_for_ties(g, w)


def _assert_same_text_but_for_ties(got, want, tie: float = 0.15) -> None:
    """Greedy texts agree, or first part where the reference's top two tokens are tied within
    bf16 logit rounding (0.125 apart at logit 20): there the fp32 logits of the fp16 copy can
    pick the other one, and the texts go separate ways after it."""
    for i, (g, w) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
        if g != w:
            ranked = want.logprobs[i]
            assert g in ranked, f"token {i}: {g} is not in the reference's top 2"
            assert abs(ranked[w].logprob - ranked[g].logprob) < tie, f"token {i} is no tie"
            return


@pytest.mark.slow
@pytest.mark.skipif(not can_quantize_int4(torch.ones(1, 32)), reason="no int4 CPU kernel")
def test_int4_engine_keeps_the_bf16_engines_greedy_text():
    """The default model comes from a Q4_1 GGUF file, so int4 holds its weights but for bf16
    scales: one request at a time (every decode step reads the int4 copy), greedy text is the
    bf16 engine's up to the first near tie (top two within 0.25 nats; the texts go separate
    ways after it)."""
    # bf16 named: the default dtype is fp32 on CPUs without AVX512-BF16, and int4 needs bf16.
    args = {"num_kv_blocks": 96, "enable_prefix_caching": False, "dtype": "bfloat16"}
    int4 = LLM(quantization="int4", **args)
    bf16 = LLM(**args)
    layer = int4.engine.runner.model.layers[0].mlp.down_proj
    assert layer.int4 is not None and layer.fp16 is None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    for question in ("Write a story about a dragon.", "Explain photosynthesis to a child."):
        prompt = int4.engine.apply_chat_template([{"role": "user", "content": question}])
        got = int4.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        want = bf16.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        _assert_same_text_but_for_ties(got, want, tie=0.25)


@pytest.mark.skipif(not can_quantize_int4(torch.ones(1, 32)), reason="no int4 CPU kernel")
def test_int4_engine_with_biases_and_an_untied_head(tmp_path, default_model_path):
    """A Qwen2-shaped model (qkv bias, untied head): every layer gets its int4 copy and keeps
    its bias; prefill steps (more than 4 tokens) never read the copy, so the first token is the
    plain bf16 engine's; decode steps read it and produce valid tokens."""
    path = make_tiny_model(tmp_path / "qwen2", default_model_path, "Qwen2ForCausalLM")
    args = {"model": str(path), "dtype": "bfloat16", "num_kv_blocks": 64}
    int4 = LLM(quantization="int4", **args)
    bf16 = LLM(**args)
    model = int4.engine.runner.model
    assert model.lm_head is None and model.cpu_head.int4 is None  # the head keeps fp16
    for layer in model.layers:
        assert layer.self_attn.qkv_proj.int4 is not None
        assert layer.self_attn.qkv_proj.bias is not None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The archive of Lindenfeld holds"
    got = int4.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    want = bf16.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got[0] == want[0] and len(got) == 6
    assert all(0 <= t < model.config.vocab_size for t in got)


def _alive_at_each_call(monkeypatch, owner, name: str, model: nn.Module) -> list[int]:
    """How many of `model`'s modules are still alive at each call of `owner.name` from now on
    (garbage collected first)."""
    import gc
    import weakref

    originals = [weakref.ref(m) for m in model]
    alive, real = [], getattr(owner, name)

    def counting(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in originals))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return alive


def test_each_replaced_linear_is_freed_before_the_next_is_copied(monkeypatch):
    """Replacing a model's linears never holds every original beside every copy (a load's
    peak): when a copy is made, the linears replaced before it are gone."""
    from paged_backend.cpu import linear as cpu_linear

    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4))).to(torch.bfloat16)
    real = cpu_linear.CpuLinear
    alive_at_copy = _alive_at_each_call(monkeypatch, cpu_linear, "CpuLinear", model)
    replace_linears_(model, pack=False, fp16_copy=True)
    assert alive_at_copy == [4, 3, 2, 1]
    assert all(isinstance(m, real) for m in model)


def test_each_int8_linear_is_freed_before_the_next_is_quantized(monkeypatch):
    """`quantization="int8"` replaces a model's linears one by one: when one is quantized, the
    linears replaced before it are gone (a list of the modules kept every original beside its
    blocks, the whole float model, until the end)."""
    from paged_backend.cpu.quant import QuantLinear
    from paged_backend.gguf import quantize as quantize_module

    # Q8_0 (64 inputs) and Q8_256 (256) linears
    model = nn.Sequential(*(nn.Linear(k, k, bias=False) for k in (64, 64, 256, 256)))
    alive_at_quantize = _alive_at_each_call(monkeypatch, quantize_module, "int8_weight", model)
    quantize_module.quantize_linears_int8_(model)
    assert alive_at_quantize == [4, 3, 2, 1]
    assert all(isinstance(m, QuantLinear) for m in model)
    formats = [m.weights[0].format.removesuffix("_VNNI") for m in model]
    assert formats == ["Q8_0", "Q8_0", "Q8_256", "Q8_256"]
