"""Rotated weights (`paged_backend.models.rotation`): the Hadamard op, a rotated model's outputs
unchanged, and int8 closer to the float model for it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import logits_of, make_tiny_model

from paged_backend import LLM, SamplingParams
from paged_backend.cpu import ops as cpu_ops
from paged_backend.models import rotation

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three uses of copper:"]
# Text none of the prompts above share, scored teacher-forced (~180 tokens)
PASSAGE = (
    "The municipal archive keeps council minutes, parish registers and guild books from the "
    "sixteenth century onwards. Its reading room opens on weekday mornings; researchers book a "
    "desk in advance and request at most ten boxes a visit. Fragile volumes are shown as "
    "photographs, and a conservator decides whether an original may be handled. In 1952 a flood "
    "reached the basement stores, and the bound newspapers that were dried afterwards still "
    "smell of river water. Volunteers index the registers name by name, so that families "
    "tracing their ancestors can search a database instead of turning every page by hand."
)


def hadamard_matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


@pytest.mark.parametrize("block", [1, 2, 32, 256])
def test_hadamard_rotates_each_block_of_a_row_by_the_normalized_hadamard_matrix(block):
    """fp32 rows: the blocks times H / sqrt(block) (sums in another order: fp32 rounding apart),
    twice the rows back; bf16 rows: the same values rounded once to bf16."""
    x = torch.randn(5, 2, 512)
    expected = (x.double().view(5, 2, -1, block) @ hadamard_matrix(block)).view_as(x)
    rotated = cpu_ops.hadamard_(x.clone(), block)
    torch.testing.assert_close(rotated, expected.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(cpu_ops.hadamard_(rotated, block), x, rtol=0, atol=1e-5)
    halves = x.bfloat16()
    expected = (halves.double().view(5, 2, -1, block) @ hadamard_matrix(block)).view_as(x)
    got = cpu_ops.hadamard_(halves.clone(), block).double()
    assert (got - expected).abs().le(expected.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("block", [1, 16, 64, 256])
def test_a_hadamard_down_the_columns_is_one_along_the_rows_of_the_transpose(block):
    """Scaled rows or columns first (each value k of a row times scale[k]; row r times scale[r]),
    and a width that is no multiple of 16 for the columns: bit for bit the rows' op."""
    x = torch.randn(512, 40)
    scale = torch.randn(512)
    for dtype in (torch.float32, torch.bfloat16):
        columns = cpu_ops.hadamard_columns_(x.to(dtype, copy=True), block, scale)
        rows = cpu_ops.hadamard_(x.T.contiguous().to(dtype), block, scale)
        assert torch.equal(columns, rows.T)
    expected = (
        ((x.double() * scale[:, None].double()).T.reshape(40, -1, block) @ hadamard_matrix(block))
        .reshape(40, 512)
        .T
    )
    torch.testing.assert_close(columns.double(), expected, rtol=0, atol=0.05)


@pytest.mark.parametrize("block", [0, 3, 48, 1024, 8192])
def test_hadamard_names_a_block_that_does_not_fit(block):
    with pytest.raises(ValueError, match="block must be a power of two"):
        cpu_ops.hadamard_(torch.randn(2, 512), block)
    with pytest.raises(ValueError, match="block must be a power of two"):
        cpu_ops.hadamard_columns_(torch.randn(1024, 2), block)


def test_hadamard_names_rows_it_cannot_rotate():
    with pytest.raises(ValueError, match=r"x must be contiguous fp32 or bf16, got torch.float16"):
        cpu_ops.hadamard_(torch.randn(2, 64).half(), 32)
    with pytest.raises(ValueError, match=r"got torch.float32, not contiguous"):
        cpu_ops.hadamard_columns_(torch.randn(64, 64).T, 32)
    with pytest.raises(
        ValueError, match=r"hadamard_columns_ takes a matrix, not shape \(2, 32, 4\)"
    ):
        cpu_ops.hadamard_columns_(torch.randn(2, 32, 4), 2)


def test_hadamard_names_a_scale_that_does_not_fit():
    with pytest.raises(ValueError, match="scale must be 512 fp32 values"):
        cpu_ops.hadamard_(torch.randn(2, 512), 32, torch.ones(256))
    with pytest.raises(ValueError, match="scale must be 64 fp32 values"):
        cpu_ops.hadamard_columns_(torch.randn(64, 8), 32, torch.ones(64, dtype=torch.float64))


def _generate(llm: LLM) -> list:
    llm.engine.kv.pool.reset_cache()  # K/V of the weights as they are now
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
        ("Qwen2ForCausalLM", dict(intermediate_size=512)),
        ("MistralForCausalLM", dict(head_dim=48)),  # value heads not rotated: not a power of 2
    ],
)
def test_a_rotated_model_gives_the_tokens_and_logprobs_it_gave(
    tmp_path, default_model_path, architecture, overrides
):
    """Norms folded in, the residual stream, value heads and down inputs rotated: the same
    greedy tokens and logprobs (to fp32 rounding) from prefill (the modules) and decode steps
    (the one-call C step, rebuilt for the rotated down inputs), a tied head still the table,
    biases of the linears reading and writing the stream kept right."""
    path = make_tiny_model(
        tmp_path, default_model_path, architecture, vector_noise=0.3, hidden_size=256, **overrides
    )
    # (steps of up to 8 rows on the C fp32 linear, so decode steps run the one-call C step)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, cpu_gemm_max_rows=8)
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    before = _generate(llm)
    assert rotation.rotate_(model)
    model.fuse_decode_()
    assert model.fused_decode is not None
    assert model.layers[0].mlp.down_hadamard == rotation.activation_block(
        model.config.intermediate_size
    )
    assert (model.lm_head is None) == model.config.tie_word_embeddings  # no second table
    assert (model.norm.weight == 1).all() and model.head_rotation is not None
    after = _generate(llm)
    for b, a in zip(before, after, strict=True):
        assert a.token_ids == b.token_ids
        for lb, la in zip(b.logprobs, a.logprobs, strict=True):
            assert lb.keys() == la.keys()
            for token in lb:
                assert la[token].logprob == pytest.approx(lb[token].logprob, abs=1e-3)


def test_gemma_is_left_as_it_is(tmp_path, default_model_path):
    """Norms of each sublayer's output do not commute with a rotation: no rotation."""
    path = make_tiny_model(tmp_path, default_model_path, "Gemma3ForCausalLM", vector_noise=0.3)
    model = LLM(model=str(path), dtype="float32", num_kv_blocks=64).engine.runner.model
    weights = [p.clone() for p in model.parameters()]
    assert not rotation.rotatable(model) and not rotation.rotate_(model)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_int8_of_the_rotated_model_comes_closer_to_the_float_model(monkeypatch):
    """quantization="int8" rotates the default model first: its logits on a passage lie closer
    to the fp32 model's (mean KL divergence) than those of int8 of the weights as they are.
    (Engines of its own: `logits_of` writes K/V into blocks the pool did not hand out.)"""
    fp32 = LLM(dtype="float32", num_kv_blocks=128)
    ids = fp32.engine.tokenizer.encode(PASSAGE)
    reference = torch.log_softmax(logits_of(fp32, ids), -1)

    def divergence() -> tuple[float, bool]:
        int8 = LLM(dtype="float32", quantization="int8", num_kv_blocks=128)
        model = int8.engine.runner.model
        rotated = model.layers[0].mlp.down_hadamard != 0
        ours = torch.log_softmax(logits_of(int8, ids), -1)
        kl = (reference.exp() * (reference - ours)).sum(-1).mean()
        return float(kl), rotated

    rotated, was_rotated = divergence()
    monkeypatch.setattr(rotation, "rotate_", lambda model: False)
    unrotated, was_not = divergence()
    assert was_rotated and not was_not
    assert rotated < 0.7 * unrotated
