"""The fused decode step (`paged_backend.fused_decode`): steps of decodes only run every layer in
one C call and give the same bits as the modules (tokens and log-probabilities), with global and
sliding-window layers; other steps, and models it does not fit, run the modules."""

from __future__ import annotations

import pytest
from conftest import longrope, make_tiny_model

from paged_backend import LLM, SamplingParams, cpu_ops
from paged_backend.fused_decode import FusedDecode

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not cpu_ops.has_bf16_kernels(), reason="no AVX512-BF16 C kernels"),
]
PROMPTS = [[1, 5, 17, 923, 4, 88, 1024, 7, 3], [1, 400, 33, 2048], [1, 9, 9, 9, 12, 14]]


def generate_counting(llm: LLM, monkeypatch, max_tokens: list[int]) -> tuple[list, list[int]]:
    """The outputs (token ids and log-probabilities) of `PROMPTS`, each to its `max_tokens`, and
    the row counts of the fused steps."""
    fused_rows = []
    real = FusedDecode.__call__

    def counting(self, x, *args):
        fused_rows.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    params = [
        SamplingParams(temperature=0, ignore_eos=True, logprobs=5, max_tokens=n) for n in max_tokens
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(FusedDecode, "__call__", real)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], fused_rows


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("MistralForCausalLM", {"sliding_window": 6}),
        # Phi-4-mini: a partial rotary, and LongRoPE tables past the original length (16).
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "pad_token_id": 0, **longrope(12)}),
    ],
    ids=["llama", "mistral-window", "phi4-mini"],
)
def test_fused_steps_give_the_modules_bits(
    tmp_path, default_model_path, monkeypatch, architecture, overrides
):
    path = make_tiny_model(tmp_path, default_model_path, architecture, **overrides)
    llm = LLM(model=str(path), dtype="bfloat16", enable_prefix_caching=False, cpu_gemm_max_rows=64)
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    fused, rows = generate_counting(llm, monkeypatch, [20, 12, 16])
    assert rows and set(rows) <= {1, 2, 3}  # the decodes; every prefill ran the modules
    model.fused_decode = None
    plain, none = generate_counting(llm, monkeypatch, [20, 12, 16])
    assert not none
    assert fused == plain


def test_steps_beyond_the_gemm_rows_run_the_modules(tiny_model, monkeypatch):
    llm = LLM(model=str(tiny_model), dtype="bfloat16", cpu_gemm_max_rows=2)
    _, rows = generate_counting(llm, monkeypatch, [4, 8, 12])
    assert set(rows) == {2, 1}  # three sequences at first, fused once they are two
    assert llm.engine.runner.model.fused_decode.max_rows == 2


@pytest.mark.parametrize(
    ("architecture", "engine_args"),
    [
        ("Qwen2ForCausalLM", {}),  # q/k/v biases
        ("Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms
        ("LlamaForCausalLM", {"cpu_kernels": False}),  # torch ops
        ("LlamaForCausalLM", {"cpu_gemm_max_rows": 0}),  # oneDNN linears only
    ],
)
def test_models_it_does_not_fit_run_the_modules(
    tmp_path, default_model_path, architecture, engine_args
):
    config = {k: v for k, v in engine_args.items() if k == "head_dim"}
    path = make_tiny_model(tmp_path, default_model_path, architecture, **config)
    args = {k: v for k, v in engine_args.items() if k != "head_dim"}
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=32, **args)
    assert llm.engine.runner.model.fused_decode is None
