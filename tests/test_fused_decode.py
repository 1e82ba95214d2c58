"""The fused decode step (`paged_backend.attention.fused_decode`): steps of decodes only run
every layer in one C call and give the same bits as the modules (tokens and log-probabilities),
with global and sliding-window layers, q/k norms (Qwen3, Gemma 3), Gemma's sandwich norms, GeGLU,
soft-caps and local rope tables, in bf16 (AVX512-BF16, or GGUF blocks on any CPU) and fp32 (any
CPU with a compiler); other steps, and models it does not fit, run the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import longrope, make_tiny_model

from paged_backend import LLM, SamplingParams, cpu
from paged_backend.attention import FusedDecode
from paged_backend.attention.fused_decode import QUANT_MAX_ROWS as FUSED_QUANT_MAX_ROWS
from paged_backend.config import EngineConfig
from paged_backend.cpu import kernel_choice, quant
from paged_backend.cpu.quant import QuantLinear
from paged_backend.default_model import default_model_file
from paged_backend.gguf.random_checkpoint import write_checkpoint
from paged_backend.gguf.weights import exact_f32_blocks
from paged_backend.model_loader import converted_from, gguf_source

pytestmark = pytest.mark.usefixtures("one_thread")
needs_bf16 = pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
needs_ops = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
BF16, FP32 = pytest.param("bfloat16", marks=needs_bf16), pytest.param("float32", marks=needs_ops)
PROMPTS = [[1, 5, 17, 923, 4, 88, 1024, 7, 3], [1, 400, 33, 2048], [1, 9, 9, 9, 12, 14]]


def generate_counting(
    llm: LLM, monkeypatch, max_tokens: list[int], prompts: list[list[int]] = PROMPTS
) -> tuple[list, list[tuple[int, bool]]]:
    """The outputs (token ids and log-probabilities) of `prompts`, each to its `max_tokens`, and
    each fused step's (rows, whether it had a shared prefix)."""
    fused = []
    real = FusedDecode.__call__

    def counting(self, x, rope, local, kv_caches, plan, *args):
        fused.append((x.shape[0], plan.shared is not None))
        return real(self, x, rope, local, kv_caches, plan, *args)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    params = [
        SamplingParams(temperature=0, ignore_eos=True, logprobs=5, max_tokens=n) for n in max_tokens
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(FusedDecode, "__call__", real)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], fused


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("MistralForCausalLM", {"sliding_window": 6}),
        # Phi-4-mini: a partial rotary, and LongRoPE tables past the original length (16).
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "pad_token_id": 0, **longrope(12)}),
        ("Qwen2ForCausalLM", {}),  # q/k/v biases
        ("Qwen3ForCausalLM", {}),  # q/k norms
        # GeGLU, sandwich norms, soft-capped scores and logits, a query scale, windows
        (
            "Gemma2ForCausalLM",
            {"sliding_window": 6, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.0},
        ),
        # q/k norms (offsets from 1), local rope tables for the sliding layers
        (
            "Gemma3ForCausalLM",
            {
                "sliding_window": 6,
                "sliding_window_pattern": 2,
                "rope_local_base_freq": 100.0,
                "num_key_value_heads": 1,
            },
        ),
    ],
    ids=["llama", "mistral-window", "phi4-mini", "qwen2-biases", "qwen3", "gemma2", "gemma3"],
)
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [
        pytest.param("bfloat16", "auto", marks=needs_bf16, id="bf16"),
        pytest.param("float32", "auto", marks=needs_ops, id="fp32"),
        pytest.param("float32", "float16", marks=needs_ops, id="fp32-fp16-cache"),
    ],
)
def test_fused_steps_give_the_modules_bits(
    tmp_path, default_model_path, monkeypatch, architecture, overrides, dtype, kv_cache_dtype
):
    path = make_tiny_model(
        tmp_path, default_model_path, architecture, vector_noise=0.3, **overrides
    )
    llm = LLM(
        model=str(path),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,
        cpu_gemm_max_rows=64,
    )
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    fused, steps = generate_counting(llm, monkeypatch, [20, 12, 16])
    # bf16 prefills run the modules; fp32's attention kernel also takes chunks of up to 33 rows
    # a sequence, so these short prompts' first step (19 rows) runs fused too
    fused_rows = {1, 2, 3} if dtype == "bfloat16" else {1, 2, 3, sum(map(len, PROMPTS))}
    assert steps and {rows for rows, _ in steps} == fused_rows
    model.fused_decode = None
    plain, none = generate_counting(llm, monkeypatch, [20, 12, 16])
    assert not none
    assert fused == plain


@needs_bf16
def test_a_shared_prefix_runs_fused_with_the_modules_bits(
    tmp_path, default_model_path, monkeypatch
):
    """RAG-shaped prompts: their shared prefix is attended once (the cascade) inside the fused
    step, with the backend's kept packed copy, and gives the modules' bits."""
    path = make_tiny_model(tmp_path, default_model_path, head_dim=64)  # the C prefix kernel's
    shared = list(range(100, 140))
    prompts = [[*shared, 7, 8 + i, 9] for i in range(4)]
    outputs = []
    for fuse in (True, False):  # two engines: the prefix cache shares the prefix's blocks
        llm = LLM(model=str(path), dtype="bfloat16", cpu_gemm_max_rows=64)
        if not fuse:
            llm.engine.runner.model.fused_decode = None
        out, steps = generate_counting(llm, monkeypatch, [12, 16, 20, 24], prompts)
        assert any(cascade for _, cascade in steps) == fuse
        outputs.append(out)
    assert outputs[0] == outputs[1]


class ReplayProposer:
    """Drafts the continuation a plain run gave (`outputs`: prompt + tokens, found by prefix),
    its last draft wrong: each drafting step accepts some drafts and rejects one."""

    def __init__(self, outputs: list[list[int]]) -> None:
        self.outputs = outputs

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        for full in self.outputs:
            if full[: len(token_ids)] == token_ids:
                truth = full[len(token_ids) :][: min(4, max_drafts)]
                return [*truth[:-1], 3] if truth else []
        return []


@pytest.mark.parametrize(
    ("dtype", "gguf"),
    [
        pytest.param("bfloat16", False, marks=needs_bf16, id="bf16"),
        pytest.param("float32", False, marks=needs_ops, id="fp32"),
        pytest.param("bfloat16", True, marks=needs_ops, id="bf16-q4_k_m"),
        pytest.param("float32", True, marks=needs_ops, id="fp32-q4_k_m"),
    ],
)
def test_steps_verifying_drafts_run_fused_with_the_modules_bits(
    tmp_path, default_model_path, monkeypatch, dtype, gguf
):
    """Each sequence's token and its drafts (up to 5 rows a sequence; beside a shared prefix,
    which bf16's fused step attends by cascade where the prefix kernel builds): fused, with the
    unfused engine's bits, which are plain decoding's tokens; over float weights and GGUF
    blocks."""
    if gguf:
        path = write_checkpoint("tiny", tmp_path, ("q4_k_m",))[0]
    else:
        path = make_tiny_model(tmp_path, default_model_path, head_dim=64)  # the prefix kernel's
    shared = list(range(100, 140))
    prompts = [[*shared, 7, 8 + i, 9] for i in range(3)] + PROMPTS[:1]
    max_tokens = [12, 16, 20, 40]
    args = dict(model=str(path), dtype=dtype, cpu_gemm_max_rows=64)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    plain, _ = generate_counting(LLM(**args), monkeypatch, max_tokens, prompts)
    replay = ReplayProposer([p + tokens for p, (tokens, _) in zip(prompts, plain, strict=True)])
    outputs = []
    for fuse in (True, False):  # two engines: the prefix cache shares the prefix's blocks
        llm = LLM(**args, speculative_config=spec)
        llm.engine.scheduler.proposer = replay
        if not fuse:
            llm.engine.runner.model.fused_decode = None
        out, steps = generate_counting(llm, monkeypatch, max_tokens, prompts)
        drafting = [rows for rows, _ in steps if rows > 4]  # more rows than sequences
        assert bool(drafting) == fuse
        if dtype == "bfloat16" and fuse and cpu.has_bf16_kernels() and not gguf:
            assert any(cascade for rows, cascade in steps if rows > 4)
        assert llm.stats()["spec_num_accepted_tokens"] > 0
        outputs.append(out)
    assert outputs[0] == outputs[1]
    assert [tokens for tokens, _ in outputs[0]] == [tokens for tokens, _ in plain]


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_steps_beyond_the_gemm_rows_run_the_modules(tiny_model, monkeypatch, dtype):
    llm = LLM(model=str(tiny_model), dtype=dtype, cpu_gemm_max_rows=2)
    _, steps = generate_counting(llm, monkeypatch, [4, 8, 12])
    assert {rows for rows, _ in steps} == {2, 1}  # three sequences at first, then fused
    assert llm.engine.runner.model.fused_decode.max_rows == 2


@needs_ops
def test_fp32_steps_of_any_size_run_fused_where_the_c_linear_serves_every_step(
    tiny_model, monkeypatch, f32_linears_every_step
):
    """Where the C fp32 linear serves every step (`kernel_choice`: torch not clearly faster at
    a prefill's 256 rows; forced here), steps past 64 rows run fused too, a prompt's included,
    with the modules' bits."""
    llm = LLM(model=str(tiny_model), dtype="float32", enable_prefix_caching=False)
    prompts = [[1, 5 + i, 17, 923, 4 + i] for i in range(70)]
    fused, steps = generate_counting(llm, monkeypatch, [3] * 70, prompts)
    assert {rows for rows, _ in steps} == {350, 70}  # the prompts, then their decodes
    llm.engine.runner.model.fused_decode = None
    plain, none = generate_counting(llm, monkeypatch, [3] * 70, prompts)
    assert not none and fused == plain


@needs_bf16
def test_bf16_steps_past_the_int8_rows_dequantize_in_one_call_with_the_modules_bits(
    tmp_path, monkeypatch
):
    """A bf16 model's quantized linears take the int8 product up to the rows timing gives it
    (here `cpu_gemm_max_rows`: 2); steps of more rows run the weights dequantized to bf16
    (`quant_gemm_bf16`): the prefills in the modules, decode steps of 3 rows in the one-call
    step too, with the modules' bits, which are not the int8 product's."""
    path = write_checkpoint("tiny", tmp_path, ("q4_k_m",))[0]
    args = dict(model=str(path), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    llm = LLM(**args, cpu_gemm_max_rows=2)
    rows, real = [], quant.quant_gemm_bf16
    monkeypatch.setattr(quant, "quant_gemm_bf16", lambda x, *a: rows.append(len(x)) or real(x, *a))
    fused, steps = generate_counting(llm, monkeypatch, [4, 8, 12])
    assert {n for n, _ in steps} == {3, 2, 1}
    assert llm.engine.runner.model.fused_decode.max_rows == FUSED_QUANT_MAX_ROWS
    assert set(llm.stats()["cpu_int8_max_rows"].values()) == {2}
    in_modules, rows[:] = rows.count(3), []  # 3-row fused steps: their head's product alone
    llm.engine.runner.model.fused_decode = None
    plain, none = generate_counting(llm, monkeypatch, [4, 8, 12])
    assert not none and fused == plain and rows.count(3) > in_modules > 0
    int8, _ = generate_counting(LLM(**args, cpu_gemm_max_rows=3), monkeypatch, [4, 8, 12])
    assert int8 != fused


@needs_bf16
def test_quantized_decode_steps_of_a_default_batch_run_fused_with_the_modules_bits(
    tmp_path, monkeypatch
):
    """A batch of more than 64 requests (up to the default max_num_seqs) decodes in the one-call
    step through quantized linears too (dequantized to bf16, past their int8 rows), with the
    bits the modules give; a batch past the step's rows decodes through the modules."""
    assert EngineConfig.max_num_seqs <= FUSED_QUANT_MAX_ROWS  # the default batch runs fused
    path = write_checkpoint("tiny", tmp_path, ("q4_k_m",))[0]
    most = FUSED_QUANT_MAX_ROWS + 2
    llm = LLM(model=str(path), dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=most)
    assert llm.engine.runner.model.fused_decode.max_rows == FUSED_QUANT_MAX_ROWS
    for count in (100, most):
        prompts = [[1, 5 + i, 17, 923, 4 + i] for i in range(count)]
        fused, steps = generate_counting(llm, monkeypatch, [3] * count, prompts)
        assert {rows for rows, _ in steps} == ({100} if count == 100 else set())
        model = llm.engine.runner.model
        kept, model.fused_decode = model.fused_decode, None
        plain, none = generate_counting(llm, monkeypatch, [3] * count, prompts)
        model.fused_decode = kept
        assert not none and fused == plain


@pytest.mark.parametrize(
    ("architecture", "engine_args", "dtype"),
    [
        *[
            pytest.param(arch, args, dtype, marks=needs_bf16 if dtype == "bfloat16" else needs_ops)
            for arch, args in [
                ("LlamaForCausalLM", {"cpu_kernels": False}),  # torch ops
                ("Gemma3ForCausalLM", {"cpu_kernels": False}),
                ("LlamaForCausalLM", {"cpu_gemm_max_rows": 0}),  # torch / oneDNN linears only
            ]
            for dtype in ("bfloat16", "float32")
        ],
    ],
)
def test_models_it_does_not_fit_run_the_modules(
    tmp_path, default_model_path, architecture, engine_args, dtype
):
    path = make_tiny_model(tmp_path, default_model_path, architecture)
    llm = LLM(model=str(path), dtype=dtype, num_kv_blocks=32, **engine_args)
    assert llm.engine.runner.model.fused_decode is None


@needs_ops
def test_fp32_steps_with_a_shared_prefix_run_the_modules(tmp_path, default_model_path, monkeypatch):
    """fp32 has no C prefix kernel: RAG-shaped steps take the torch cascade (the modules), the
    others run fused, and the tokens are the unfused engine's."""
    path = make_tiny_model(tmp_path, default_model_path)
    shared = list(range(100, 140))
    prompts = [[*shared, 7, 8 + i, 9] for i in range(3)] + [[5, 6, 7]]
    outputs = []
    for fuse in (True, False):
        llm = LLM(model=str(path), dtype="float32", cpu_gemm_max_rows=64)
        if not fuse:
            llm.engine.runner.model.fused_decode = None
        out, steps = generate_counting(llm, monkeypatch, [6, 8, 10, 30], prompts)
        assert not any(cascade for _, cascade in steps)
        assert bool(steps) == fuse  # once the others end, the last sequence runs fused
        outputs.append(out)
    assert outputs[0] == outputs[1]


@needs_ops
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ("tiny", "float32"),
        ("tiny-qwen2", "float32"),
        ("default", "float32"),
        ("tiny", "bfloat16"),
        ("default", "bfloat16"),
        ("tiny-qwen2", "bfloat16"),  # biases added to rounded products
        ("tiny-gemma3", "float32"),
        ("tiny-gemma3", "bfloat16"),
        ("tiny-qwen3", "bfloat16"),
        ("tiny-phi3", "float32"),  # fused qkv and gate/up tensors
        ("tiny-phi3", "bfloat16"),
        ("int8", "float32"),
        ("int8", "bfloat16"),
        ("int8-rows", "bfloat16"),  # rotated, 256 and 512 inputs: Q8_256 of one scale a row
    ],
)
def test_gguf_blocks_run_fused_with_the_modules_bits(
    tmp_path, default_model_path, monkeypatch, shape, dtype
):
    """Steps over a GGUF file's blocks (Q4_K and Q6_K parts of one projection, Qwen2's biases;
    Gemma 3's and Qwen3's layers; the default model's Q4_1; `quantization="int8"`'s Q8_0 of a
    model with an untied head, and its Q8_256 of one scale a row, whose activations have one a
    row) run in one call with the modules' bits: fp32's, and bf16's (a bf16 CPU's dtype; any
    build, as no C GEMM copy is needed)."""
    args = {}
    widths = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    if shape == "default":
        path = default_model_file()
    elif shape.startswith("int8"):
        overrides = widths if shape == "int8-rows" else {}
        path = make_tiny_model(tmp_path, default_model_path, **overrides)
        args = {"quantization": "int8"}
    else:
        path = write_checkpoint(shape, tmp_path, ("q4_k_m",))[0]
    llm = LLM(model=str(path), dtype=dtype, enable_prefix_caching=False, num_kv_blocks=64, **args)
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    if shape == "int8-rows":
        assert all(p.weights[0].row_scales for p in (model.layers[0].mlp.down_proj, model.cpu_head))
    fused, steps = generate_counting(llm, monkeypatch, [20, 12, 16])
    assert steps
    model.fused_decode = None
    plain, none = generate_counting(llm, monkeypatch, [20, 12, 16])
    assert not none and fused == plain


@needs_ops
@pytest.mark.parametrize("source", ["default", "tiny-q4_0"])
def test_fp32_models_from_gguf_files_read_their_blocks_with_the_same_outputs(
    source, tmp_path, monkeypatch
):
    """An fp32 model dequantized from a GGUF file (the embedded default model, converted by
    transformers and checked at the start; a file run with quantization="none", dequantized by
    us) reads its small steps' weights from the file's blocks (0.6 bytes a weight for Q4_0 /
    Q4_1, 1.06 for the default model's Q8_0 head, instead of 4): decode steps, single or
    batched, give the same tokens and log-probabilities as the engine that reads fp32 weights.
    A weight whose values differ from its blocks keeps its fp32 reads."""
    args = dict(dtype="float32", cpu_gemm_max_rows=64, num_kv_blocks=256)
    if source != "default":
        path = write_checkpoint("tiny", tmp_path, ("q4_0",))[0]
        args.update(model=str(path), quantization="none")
    prompts = [list(range(200, 230)), [1, 400, 33, 2048], list(range(900, 990))]
    outputs = []
    for rows in (8, 0):  # (timed at a start: here fixed, a busy machine's timing varies)
        monkeypatch.setattr(
            kernel_choice, "f32_block_max_rows", lambda k, r=rows: dict.fromkeys(k, r)
        )
        llm = LLM(**args)
        model = llm.engine.runner.model
        linears = [lin for layer in model.layers for lin in FusedDecode._linears(layer)]
        assert {lin.block_rows for lin in linears} == {rows}
        assert model.fused_decode.block_rows == rows
        got, fused = generate_counting(llm, monkeypatch, [24, 16, 20], prompts)
        assert fused
        outputs.append(got)
    assert outputs[0] == outputs[1]
    gguf = gguf_source(llm.engine.model_path) or converted_from(llm.engine.model_path)
    down = model.layers[1].mlp.down_proj
    down.weight.data[32, 5] += 1e-3  # a checked row
    table = exact_f32_blocks(model, Path(gguf["gguf"]), gguf["architecture"], gguf["tensors"])
    assert "layers.0.mlp.down_proj" in table and "layers.1.mlp.down_proj" not in table
