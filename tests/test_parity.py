"""Exact output against Hugging Face transformers on the real default model (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward

from paged_backend import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Write a haiku about the sea.",
    "Q: What is 17 times 23?\nA:",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the "
    "Caribbean. His voyages opened the way for European exploration and colonization of the "
    "Americas, which changed the history of both continents. Summarize this in one sentence:",
    "Translate to French: I would like a cup of coffee, please.",
    "List three colours:",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\nx = np.arange(10)\n# compute the mean of x\n",
]


def hf_greedy(hf_model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy decoding with its own KV cache, never stopping at EOS. The prompts
    run as one left-padded batch: in fp32 that gives the same tokens as one at a time."""
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    ids, mask = enc.input_ids, enc.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, past = [], None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out, past = hf_forward(hf_model, ids, past, attention_mask=mask, position_ids=positions)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(ids[:, 0])
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
    return torch.stack(tokens, dim=1).tolist()


def test_greedy_batch_matches_transformers(llm_fp32, hf_model):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm_fp32.generate(PROMPTS, params, use_tqdm=False)
    assert llm_fp32.stats()["max_batch_size"] >= len(PROMPTS)
    tok = llm_fp32.get_tokenizer()
    expected = hf_greedy(hf_model, tok, PROMPTS, 64)
    for prompt, out, want in zip(PROMPTS, outs, expected, strict=True):
        assert out.outputs[0].token_ids == want, prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == tok(prompt).input_ids


def test_logprobs_match_transformers(llm_fp32, hf_model):
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm_fp32.generate(prompts, params, use_tqdm=False)
    tok = llm_fp32.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        ids = tok(prompt).input_ids + completion.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[len(tok(prompt).input_ids) - 1 : -1]
        total = 0.0
        for step, (token, entries) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            assert entries[token].rank == 1  # greedy picks the top token
            assert entries[token].logprob == pytest.approx(ref[step, token].item(), abs=1e-3)
            top = ref[step].topk(3)
            for value, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                assert entries[t].logprob == pytest.approx(value, abs=1e-3)
            total += entries[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_token_id_prompts_and_chat(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8)
    by_text = llm_fp32.generate(PROMPTS[0], params, use_tqdm=False)[0]
    by_ids = llm_fp32.generate([tok(PROMPTS[0]).input_ids], params, use_tqdm=False)[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_ids.prompt is None

    conv = [{"role": "user", "content": "What is 2+2?"}]
    chat = llm_fp32.chat(conv, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    templated = tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=True)
    assert chat.prompt_token_ids == list(templated["input_ids"])
    raw = llm_fp32.generate(
        [chat.prompt_token_ids], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False
    )[0]
    assert chat.outputs[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert chat.outputs[0].text == raw.outputs[0].text
    assert "<|im_end|>" not in chat.outputs[0].text
