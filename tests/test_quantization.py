"""Weight copies for small decode steps (`paged_backend.quantization`): int8 weights are within
half a step of the originals, small steps read the copy and larger ones the original weights,
the engine picks the fp16 copy by default for bf16 models only, and engines with either copy
follow the reference model's greedy text."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paged_backend import LLM, SamplingParams
from paged_backend.quantization import MAX_TOKENS, DecodeLinear, quantize_int8


def test_int8_weights_are_within_half_a_step_per_channel():
    weight = torch.randn(96, 64) * torch.logspace(-3, 1, 96)[:, None]  # very different rows
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    error = (weight - q.float() * scales[:, None]).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("kind", ["fp16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_steps_read_the_copy_and_large_steps_the_original_weights(kind, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    layer = DecodeLinear(linear, kind)
    small = torch.randn(MAX_TOKENS[kind], 64, dtype=dtype)
    large = torch.randn(MAX_TOKENS[kind] + 1, 64, dtype=dtype)
    copy = layer.copy.weight.float()
    if kind == "int8":
        copy = copy * layer.copy.scales.float()[:, None]
    expected = F.linear(small.float(), copy, linear.bias.float())
    assert layer(small).dtype == dtype
    torch.testing.assert_close(layer(small).float(), expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(layer(large), linear(large))


def test_bf16_weights_survive_the_fp16_copy_exactly():
    weight = (torch.randn(32, 64) * 0.05).to(torch.bfloat16)
    copy = DecodeLinear(nn.Linear(64, 32, bias=False).to(torch.bfloat16), "fp16")
    copy.copy.weight = weight.to(torch.float16)
    assert torch.equal(copy.copy.weight.to(torch.bfloat16), weight)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine_args", "kind", "reference_args"),
    [
        ({"dtype": "bfloat16"}, "fp16", {"dtype": "bfloat16", "fp16_decode_weights": False}),
        ({"dtype": "float32", "quantization": "int8"}, "int8", None),
    ],
)
def test_engines_with_a_copy_follow_the_reference_greedy_text(
    llm_fp32, engine_args, kind, reference_args
):
    """The copy moves logits a little: the fp16 copy against the same bf16 model without it,
    int8 against the fp32 reference. On these prompts greedy decoding keeps the reference text
    for its first tokens, and most of it overall."""
    llm = LLM(num_kv_blocks=64, **engine_args)
    reference = llm_fp32 if reference_args is None else LLM(num_kv_blocks=64, **reference_args)
    head = llm.engine.runner.model.head_copy
    assert head is not None and (head.scales is None) == (kind == "fp16")
    prompts = [
        llm.engine.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Write a story about a dragon.", "What is the capital of France?")
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in prompts:  # one at a time: every decode step reads the copy
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        want = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got[:8] == want[:8]
        assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(want) // 2


def test_fp32_engines_keep_no_copy_unless_asked(llm_fp32):
    assert llm_fp32.engine.runner.model.head_copy is None
