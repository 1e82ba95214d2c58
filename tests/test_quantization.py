"""Weight-only int8 for small decode steps: the quantized weights are within half a step of the
originals, small steps take the int8 kernel and larger ones the original weights, and a
quantized engine follows the reference model's greedy text."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paged_backend import LLM, SamplingParams
from paged_backend.quantization import INT8_MAX_TOKENS, Int8Linear, quantize_int8


def test_int8_weights_are_within_half_a_step_per_channel():
    weight = torch.randn(96, 64) * torch.logspace(-3, 1, 96)[:, None]  # very different rows
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    error = (weight - q.float() * scales[:, None]).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_steps_use_int8_and_large_steps_the_original_weights(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    quantized = Int8Linear(linear)
    small = torch.randn(INT8_MAX_TOKENS, 64, dtype=dtype)
    large = torch.randn(INT8_MAX_TOKENS + 1, 64, dtype=dtype)
    dequantized = quantized.q.float() * quantized.scales.float()[:, None]
    expected = F.linear(small.float(), dequantized, linear.bias.float())
    torch.testing.assert_close(quantized(small).float(), expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(quantized(large), linear(large))


@pytest.mark.slow
def test_quantized_engine_follows_the_reference_greedy_text(llm_fp32):
    """Per-channel int8 moves logits a little; on these prompts greedy decoding keeps the
    reference text for its first tokens, and most of them overall."""
    llm = LLM(dtype="float32", quantization="int8", num_kv_blocks=64)
    prompts = [
        llm.engine.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Write a story about a dragon.", "What is the capital of France?")
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in prompts:  # one at a time: every decode step takes the int8 path
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        want = llm_fp32.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got[:8] == want[:8]
        assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(want) // 2
