"""`SamplingParams.prompt_logprobs`: every prompt token's logprob under the tokens before it, as
the model gives them whatever way the prompt's rows are computed (in one forward, in chunks, cut
into several forwards, after a preemption, past prefix-cache hits), against Hugging Face."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import QUOTED, assert_all_blocks_free

from paged_backend import LLM, AsyncEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a lighthouse at the edge of the world, there lived a keeper who "
    "counted the ships that passed and wrote each one's name in a book of blue leather.",
]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)


def hf_logprobs(model_path):
    """Each prompt's logprobs [tokens, vocab] from Hugging Face's forward over the whole prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def reference(tiny_model):
    return hf_logprobs(tiny_model)


def assert_prompt_logprobs(out, reference, k: int) -> None:
    """`out.prompt_logprobs` holds, for each token after the first, its logprob and rank under
    the reference (up to ties within rounding), and the reference's k most likely tokens there
    with theirs."""
    ids = out.prompt_token_ids
    ref = reference(ids)
    assert len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for t in range(1, len(ids)):
        row, token, entries = ref[t - 1], ids[t], out.prompt_logprobs[t]
        rank = int((row > row[token]).sum()) + 1
        # a token deep in the tail shares its value with others within rounding
        near = int((row > row[token] - 1e-4).sum()) - int((row > row[token] + 1e-4).sum())
        assert abs(entries[token].rank - rank) <= near
        assert entries[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert len(entries) == (max(k, 1) if rank <= k or k == 0 else k + 1)
        for r, (value, top) in enumerate(zip(*row.topk(k), strict=True), start=1):
            assert entries[int(top)].rank == r
            assert entries[int(top)].logprob == pytest.approx(float(value), abs=1e-4)
            assert entries[int(top)].decoded_token is not None


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_are_the_models_with_ranks(llm, reference, k):
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert_prompt_logprobs(out, reference, k)
    assert_all_blocks_free(llm.engine)


def test_requests_without_them_get_none(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_a_one_token_prompt_has_only_the_first_none(llm):
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": [42]}, params, use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    assert len(out.outputs[0].token_ids) == 2


def test_chunked_and_cut_prefills_give_the_models(tiny_model, reference):
    """A prompt run 8 tokens a step, each step cut into forwards of 3 tokens (the later pieces
    read the earlier's K/V): every row still gives its token's logprob, once, in order."""
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=8)
    llm.engine.runner.forward_tokens = 3
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert_prompt_logprobs(out, reference, 2)
    assert_all_blocks_free(llm.engine)


def test_cached_prefixes_are_computed_again_for_them(tiny_model, reference):
    """A prompt whose blocks are all cached still runs every row for its prompt logprobs (no
    hit counted); requests without them keep hitting the cache, its blocks included."""
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)
    plain = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(PROMPTS[2], plain, use_tqdm=False)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    again = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_prompt_logprobs(again, reference, 1)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    third = llm.generate(PROMPTS[2], plain, use_tqdm=False)[0]
    assert third.num_cached_tokens > 0


def test_preempted_prefills_take_each_once(tiny_model, reference):
    """Too few blocks for every request: prefills in chunks are preempted and run again (past
    their cache hits only as far as their prompt logprobs were taken), and each request's list
    still has one entry a token."""
    llm = LLM(
        model=str(tiny_model),
        dtype="float32",
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert_prompt_logprobs(out, reference, 1)
    assert_all_blocks_free(llm.engine)


def test_n_sequences_give_the_prompts_once(llm, reference):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert_prompt_logprobs(out, reference, 2)


def test_the_first_streamed_output_carries_them(tiny_model, reference):
    engine = AsyncEngine.from_model(str(tiny_model), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)

    async def stream():
        return [out async for out in engine.generate(PROMPTS[0], params)]

    try:
        outputs = asyncio.run(stream())
    finally:
        engine.shutdown()
    assert outputs[-1].finished
    for out in outputs:
        assert_prompt_logprobs(out, reference, 1)


@pytest.mark.parametrize("quantization", [None, "none"])
def test_the_default_models_heads_give_them(quantization):
    """The default model's GGUF file served as blocks (its head quantized too) and dequantized
    to bf16: prompt logprobs are those of the same rows scored in one forward (`logits_of`)."""
    from conftest import logits_of

    from paged_backend.default_model import default_model_file

    model = str(default_model_file())
    llm = LLM(model=model, quantization=quantization, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    scorer = LLM(model=model, quantization=quantization, num_kv_blocks=64)
    ids = out.prompt_token_ids
    ref = torch.log_softmax(logits_of(scorer, ids)[:, : len(scorer.get_tokenizer())], dim=-1)
    for t in range(1, len(ids)):
        entries = out.prompt_logprobs[t]
        assert entries[ids[t]].logprob == pytest.approx(ref[t - 1, ids[t]].item(), abs=0.02)
        for token in (token for token, lp in entries.items() if lp.rank == 1):  # bf16 ties
            assert ref[t - 1, token].item() == pytest.approx(ref[t - 1].max().item(), abs=0.02)


def test_drafting_engines_give_them_too(quoting_model):
    """With n-gram drafting (a model that quotes its prompt, so drafts are accepted), a request's
    prompt rows still run in its prefill, and its tokens stay those of plain decoding."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(model=str(quoting_model), dtype="float32", num_kv_blocks=256, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    plain = LLM(model=str(quoting_model), dtype="float32", num_kv_blocks=256)
    prompts = ["Please repeat: " + QUOTED, "Say it again. " + QUOTED]
    reference = hf_logprobs(quoting_model)
    for out, alone in zip(
        llm.generate(prompts, params, use_tqdm=False),
        plain.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert_prompt_logprobs(out, reference, 1)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm.engine)
