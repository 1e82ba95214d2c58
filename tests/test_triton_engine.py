"""The whole engine on the Triton backend (interpreter on CPU) gives the torch backend's tokens."""

from __future__ import annotations

import pytest
from conftest import longrope, make_tiny_model

from paged_backend import LLM, SamplingParams, cpu

pytest.importorskip("triton")


def prompt_scores(out) -> list[float | None]:
    """Each prompt token's logprob (None for the first)."""
    pairs = zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
    return [None if lps is None else lps[token].logprob for token, lps in pairs]


@pytest.mark.parametrize("c_linears", [{}, {"cpu_gemm_max_rows": 64}], ids=["plain", "c-linears"])
def test_triton_backend_engine_matches_torch(tiny_model, c_linears):
    """Also with the C linears on (on CPU, where they build): their fused decode step, which runs
    on the torch backend's plans, steps aside for the Triton backend."""
    prompts = ["Hello there, how are", "A B C D E F G H I J K L M N O P Q R S", "x"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    runs, scores = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=str(tiny_model),
            dtype="float32",
            attention_backend=backend,
            num_kv_blocks=32,
            max_num_batched_tokens=16,
            **c_linears,
        )  # chunked prefill: mixed steps
        assert llm.engine.runner.backend.name == backend
        if c_linears and cpu.available():  # the fused step is there to step aside
            assert llm.engine.runner.model.fused_decode is not None
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[backend] = [o.outputs[0].token_ids for o in outputs]
        scores[backend] = [prompt_scores(o) for o in outputs]  # their rows come in chunks
    assert runs["triton"] == runs["torch"]
    for triton, torch_ in zip(scores["triton"], scores["torch"], strict=True):
        assert triton[0] is None and triton[1:] == pytest.approx(torch_[1:], abs=1e-4)


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "pad_token_id": 0, **longrope(12)}),
    ],
    ids=["llama", "phi4-mini"],
)
def test_fused_kernels_give_the_torch_ops_logits(
    tmp_path, default_model_path, architecture, overrides
):
    """RMSNorm, rotary and SiLU-and-mul as Triton kernels (what a GPU runs) match torch ops, on
    whole heads and on Phi-4-mini's partial rotary."""
    import torch

    from paged_backend.attention import AttentionMetadata
    from paged_backend.attention.torch_backend import TorchAttention
    from paged_backend.model_loader import load_safetensors
    from paged_backend.models import LlamaForCausalLM
    from paged_backend.models.config import ModelConfig

    tiny_model = make_tiny_model(tmp_path, default_model_path, architecture, **overrides)
    config = ModelConfig.from_dir(tiny_model)
    tokens = torch.tensor([5, 17, 923, 4, 88, 1024, 7, 3])
    logits = []
    for ops in ("torch", "triton"):
        model = LlamaForCausalLM(config, 64, ops=ops)
        load_safetensors(model, tiny_model, model.checkpoint_name_map)
        backend = TorchAttention(config.num_heads, config.num_kv_heads)
        caches = backend.allocate_kv_cache(
            config.num_layers,
            2,
            16,
            config.num_kv_heads,
            config.head_dim,
            torch.float32,
            torch.device("cpu"),
        )
        meta = AttentionMetadata(
            0, [0, 8], [8], torch.tensor([[1]], dtype=torch.int32), torch.arange(16, 24), 16
        )
        backend.prepare(meta)
        with torch.inference_mode():
            hidden = model(tokens, torch.arange(8), caches, backend, meta, torch.arange(8))
            logits.append(model.logits(hidden))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
