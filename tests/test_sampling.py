"""Sampling parameters: validation, the Sampler's formulas, and their effect through the engine.

Engine tests use the tiny random model: what matters here is how the parameters act on whatever
logits come out, and references are computed in the test (transformers' logits for the tiny
model, plain-Python formulas for the Sampler).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import hf_forward

from paged_backend import LLM, AsyncEngine, SamplingParams
from paged_backend.request import Request
from paged_backend.sampler import (
    Sampler,
    _apply_top_k_top_p,
    _banned_by_words,
    _sorted_top_k_top_p,
)

EOS = 2
VOCAB = 49152
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time",
    "def main():",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(llm):
    """Greedy continuation (32 tokens) of every prompt: the baseline many tests derive from."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, outs, strict=True)}


def gen(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"seed": "42"}, "seed"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(16385))}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_out_of_range_field_is_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted():
    """The edges of every range are legal: validation must not be stricter than documented."""
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        logprobs=20,
        min_tokens=4,
        max_tokens=4,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        logit_bias={0: -100, VOCAB - 1: 100},
        stop=["x"],
        stop_token_ids=[0],
    )
    SamplingParams(top_p=1e-9, min_p=0.0, top_k=0, logprobs=0, max_tokens=None, prompt_logprobs=0)
    SamplingParams(prompt_logprobs=20)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ],
)
def test_token_ids_beyond_vocab_fail_before_any_work(llm, kwargs, field):
    """Ids the model cannot produce are rejected at generate, for the whole batch at once."""
    generated = llm.stats()["num_generated_tokens"]
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPTS[:2], [good, SamplingParams(max_tokens=2, **kwargs)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["num_generated_tokens"] == generated
    key = next(iter(kwargs))
    edge = {VOCAB - 1: 1.0} if key == "logit_bias" else [VOCAB - 1]
    assert gen(llm, PROMPTS[0], max_tokens=2, **{key: edge}).finish_reason is not None


# ---- the Sampler's formulas against plain-Python references ----------------------------------
def reference_adjust(row, prompt_ids, output_ids, p: SamplingParams, eos_ids) -> torch.Tensor:
    """vLLM's order: logit bias, min_tokens ban, repetition (prompt + output, divide positive
    logits, multiply negative ones), then frequency and presence (output only)."""
    row = row.clone()
    for t, bias in (p.logit_bias or {}).items():
        row[t] += bias
    if len(output_ids) < p.min_tokens:
        for t in [*p.stop_token_ids, *([] if p.ignore_eos else eos_ids)]:
            row[t] = -math.inf
    for t in set(prompt_ids) | set(output_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, count in Counter(output_ids).items():
        row[t] -= p.frequency_penalty * count + p.presence_penalty
    return row


def make_request(prompt_ids, output_ids=(), **params) -> Request:
    request = Request(f"r{id(prompt_ids)}", list(prompt_ids), SamplingParams(**params))
    for t in output_ids:
        request.append_output(t)
    return request


def test_penalties_bias_and_min_tokens_match_reference():
    vocab = 40
    rows = [
        ([1, 2, 3], [3, 4, 4], {"repetition_penalty": 1.7}),
        ([5], [6, 6, 6, 7], {"frequency_penalty": 0.8, "presence_penalty": -0.5}),
        ([8], [9], {"logit_bias": {9: 3.5, 10: -100}, "repetition_penalty": 0.8}),
        ([1, 2], [1], {}),  # nothing to adjust: must come out untouched
        ([1], [3, 4], {"min_tokens": 5, "stop_token_ids": [11], "presence_penalty": 1.0}),
        ([1], [3, 4], {"min_tokens": 2, "stop_token_ids": [11]}),  # min_tokens already reached
        ([1], [3], {"min_tokens": 3, "ignore_eos": True, "frequency_penalty": -1.5}),
    ]
    requests = [make_request(p, o, temperature=0, **kw) for p, o, kw in rows]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)) * 3
    original = logits.clone()
    sampler = Sampler(vocab, [0], seed=0)
    expected = torch.stack(
        [
            reference_adjust(logits[i], p, o, r.params, [0])
            for i, ((p, o, _), r) in enumerate(zip(rows, requests, strict=True))
        ]
    )
    torch.testing.assert_close(sampler._adjust(logits, requests), expected)
    assert sampler(logits, requests).token_ids == expected.argmax(-1).tolist()
    assert torch.equal(logits, original), "the caller's logits must not be modified"


def reference_probs(logits: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Temperature, then top-k, then top-p on the renormalized top-k (smallest prefix whose mass
    reaches top_p), then min-p relative to the most likely token."""
    weights = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda t: -weights[t])
    kept = order[: top_k if top_k > 0 else len(order)]
    total = sum(weights[t] for t in kept)
    nucleus, mass = [], 0.0
    for t in kept:
        if mass >= top_p:
            break
        nucleus.append(t)
        mass += weights[t] / total
    best = max(weights[t] for t in nucleus)
    final = [t for t in nucleus if weights[t] >= min_p * best]
    total = sum(weights[t] for t in final)
    return [weights[t] / total if t in final else 0.0 for t in range(len(logits))]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 3},
        {"top_p": 0.75},
        {"top_k": 3, "top_p": 0.7},  # top-p acts on the renormalized top-3: keeps only 2
        {"min_p": 0.3},
        {"temperature": 2.0, "top_k": 5, "min_p": 0.2},
    ],
)
def test_sampled_frequencies_follow_the_distribution(params):
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
    expected = reference_probs(logits, **params)
    num = 4000
    requests = [make_request([0], **params) for _ in range(num)]
    sampler = Sampler(len(logits), [0], seed=0)
    tokens = sampler(torch.tensor([logits] * num), requests).token_ids
    counts = Counter(tokens)
    for t, p in enumerate(expected):
        if p == 0:
            assert counts[t] == 0, f"token {t} is outside the allowed set"
        else:
            assert counts[t] / num == pytest.approx(p, abs=0.03), t


def test_top_k_and_top_p_among_candidates_keep_what_a_whole_sort_keeps():
    """Peaked rows (the nucleus among the best 256), flat ones (past them: sorted whole), a
    top-k above 256, a grammar's -inf, and rows with neither filter, in one batch."""
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(4, VOCAB, generator=gen) * 4
    flat = torch.randn(2, VOCAB, generator=gen) * 0.1
    masked = peaked[:1].clone()
    masked[0, torch.rand(VOCAB, generator=gen) < 0.99] = float("-inf")
    logits = torch.cat([peaked, flat, masked])
    top_k = [0, 5, 300, 0, 0, 40, 0]
    top_p = [0.9, 1.0, 0.8, 1.0, 0.95, 0.7, 0.99]
    fast = _apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(fast, _sorted_top_k_top_p(logits, top_k, top_p))
    assert torch.equal(fast[3], logits[3])
    kept = torch.isfinite(fast).sum(dim=1).tolist()
    assert kept[1] == 5 and kept[2] <= 300 and kept[4] > 256  # a flat nucleus: past 256


def test_unfiltered_row_keeps_its_whole_vocabulary_in_any_batch():
    """Batch independence: a top_p=1, top_k=0 row must not lose its tail (where an fp32 cumsum
    already reads 1.0) because a neighbour row asked for top-p/top-k filtering."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    out = _apply_top_k_top_p(torch.stack([row, row]), [0, 5], [1.0, 0.5])
    assert torch.equal(out[0], row)
    kept = torch.isfinite(out[1]).nonzero().flatten()
    assert set(kept.tolist()) <= set(row.topk(5).indices.tolist())


# ---- through the engine ----------------------------------------------------------------------
def test_seed_reproducible_whatever_else_is_batched(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=50, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True),
    ]
    outs = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert llm.stats()["max_batch_size"] >= 4
    assert outs[1].outputs[0].token_ids == alone
    for seed, same in ((1234, True), (4321, False)):
        again = llm.generate(PROMPTS[0], replace(seeded, seed=seed), use_tqdm=False)[0]
        assert (again.outputs[0].token_ids == alone) is same
    unseeded = [gen(llm, PROMPTS[0], max_tokens=16, ignore_eos=True).token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_degenerate_sampling_equals_greedy(llm, greedy, params):
    """Filters that leave one candidate make temperature-1 sampling pick the argmax."""
    sampled = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, **params)
    outs = llm.generate(PROMPTS, sampled, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == greedy[prompt].token_ids


def test_n_completions_share_the_prompt_blocks(llm):
    prompt = "Shared prefix for n completions: " + ", ".join(str(i) for i in range(30))
    num_prompt = len(llm.get_tokenizer()(prompt).input_ids)
    assert num_prompt > 33
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True)
    before = llm.stats()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    after = llm.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Children 1 and 2 find every full block of the prompt that child 0 computed.
    bs = llm.engine.config.block_size
    full_blocks = (num_prompt - 1) // bs
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 2 * bs * full_blocks
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == bs * full_blocks
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_token_id_ends_with_its_id(llm, greedy):
    tokens = greedy[PROMPTS[0]].token_ids
    k = next(i for i in range(3, len(tokens)) if tokens.index(tokens[i]) == i)
    out = gen(llm, PROMPTS[0], temperature=0, max_tokens=32, stop_token_ids=[tokens[k]])
    assert out.token_ids == tokens[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[k])
    assert out.text == llm.get_tokenizer().decode(tokens[:k])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, greedy, include):
    """A stop string taken from the middle of three tokens of the greedy output."""
    tok = llm.get_tokenizer()
    tokens = greedy[PROMPTS[1]].token_ids
    full = greedy[PROMPTS[1]].text
    offsets = [len(tok.decode(tokens[:i])) for i in range(len(tokens) + 1)]
    assert full == tok.decode(tokens)
    stop = full[offsets[4] + 1 : offsets[7] - 1]
    assert offsets[4] + 1 < offsets[5] and offsets[6] < offsets[7] - 1  # starts in 4, ends in 6
    idx = full.find(stop)
    num_tokens = next(j for j in range(len(tokens) + 1) if stop in tok.decode(tokens[:j]))

    params = SamplingParams(
        temperature=0,
        max_tokens=32,
        stop=["never appears \x00", stop],
        include_stop_str_in_output=include,
    )
    request_id = llm.engine.add_request(PROMPTS[1], params)
    streamed, final = "", None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == request_id:
                final = out.outputs[0]
                streamed += final.delta_text
                assert final.text == streamed
    expected = full[: idx + len(stop)] if include else full[:idx]
    assert final.text == expected
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.token_ids == tokens[:num_tokens]


@pytest.mark.parametrize("stop_by", ["eos", "stop_token_id"])
@pytest.mark.parametrize("min_tokens", [0, 4])
def test_min_tokens_holds_back_a_forced_stop(llm, stop_by, min_tokens):
    """A +100 bias makes the stop token the argmax; min_tokens must still hold it off."""
    stop_id = EOS if stop_by == "eos" else 777
    out = gen(
        llm,
        PROMPTS[0],
        temperature=0,
        max_tokens=10,
        min_tokens=min_tokens,
        logit_bias={stop_id: 100},
        stop_token_ids=[] if stop_by == "eos" else [stop_id],
    )
    assert len(out.token_ids) == min_tokens + 1
    assert out.token_ids[-1] == stop_id and stop_id not in out.token_ids[:-1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == (None if stop_by == "eos" else stop_id)


def test_ignore_eos_and_max_tokens(llm):
    out = gen(llm, PROMPTS[0], temperature=0, max_tokens=5, logit_bias={EOS: 100}, ignore_eos=True)
    assert out.token_ids == [EOS] * 5
    assert (out.finish_reason, out.stop_reason, out.text) == ("length", None, "")
    out = gen(llm, PROMPTS[2], temperature=1.0, max_tokens=7, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_forbids(llm, greedy, temperature):
    token = 12345
    out = gen(llm, PROMPTS[0], temperature=temperature, max_tokens=6, logit_bias={token: 100})
    assert out.token_ids == [token] * 6
    first = greedy[PROMPTS[0]].token_ids[0]
    out = gen(llm, PROMPTS[0], temperature=0, max_tokens=1, logit_bias={first: -100})
    assert out.token_ids != [first]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_keep_every_token_in_the_set(llm, greedy, temperature):
    """Only allowed tokens come out; a set holding every token the model picks changes nothing."""
    base = greedy[PROMPTS[1]].token_ids[:8]
    out = gen(llm, PROMPTS[1], temperature=0, max_tokens=8, allowed_token_ids=[*base, 7, 99])
    assert out.token_ids == base
    allowed = [t for t in range(1000, 1100) if t not in base]
    for seed in range(3):
        out = gen(
            llm,
            PROMPTS[1],
            temperature=temperature,
            seed=seed,
            max_tokens=8,
            allowed_token_ids=allowed,
        )
        assert set(out.token_ids) <= set(allowed)


def test_bad_words_never_end_in_the_output(llm, greedy):
    """A bad word's last token is banned where its other tokens end the output: the greedy
    output's own words are steered around, and no word's tokens appear in a row."""
    base = greedy[PROMPTS[0]].token_ids[:12]
    tokenizer = llm.get_tokenizer()
    words = [tokenizer.decode(base[:1]), tokenizer.decode(base[4:6])]
    out = gen(llm, PROMPTS[0], temperature=0, max_tokens=12, bad_words=words)
    sequences = llm.engine.bad_words_token_ids(words)
    assert [base[0]] in sequences  # the first word as the model wrote it
    assert out.token_ids[0] != base[0]
    for seq in sequences:
        n = len(seq)
        assert all(out.token_ids[i : i + n] != seq for i in range(len(out.token_ids)))


def test_banned_by_words_bans_only_a_words_end():
    words = [[5], [1, 2, 3], [9, 9]]
    assert _banned_by_words([], words) == [5]
    assert _banned_by_words([7, 1, 2], words) == [5, 3]
    assert _banned_by_words([1, 2, 4], words) == [5]
    assert _banned_by_words([9], words) == [5, 9]


def test_truncated_prompts_are_served_as_their_last_tokens(llm):
    """`truncate_prompt_tokens`: the prompt's last k tokens, as if given alone, at every entry;
    -1 keeps what max_model_len leaves after max_tokens, so a prompt too long for the model
    is served rather than refused."""
    ids = llm.engine.tokenize("word " * 40 + PROMPTS[1])
    plain = SamplingParams(temperature=0, max_tokens=6)
    expected = llm.generate([ids[-9:]], plain, use_tqdm=False)[0]
    cut = replace(plain, truncate_prompt_tokens=9)
    out = llm.generate([ids], cut, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-9:]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    engine = llm.engine
    request_id = engine.add_request(None, cut, prompt_token_ids=tuple(ids))
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.request_id == request_id and o.finished]
    assert done[0].outputs[0].token_ids == expected.outputs[0].token_ids
    async_engine = AsyncEngine(engine)  # borrows the idle engine; shut down below
    try:
        last = list(async_engine.generate_stream(ids, cut))[-1]
    finally:
        async_engine.shutdown()
    assert last.outputs[0].token_ids == expected.outputs[0].token_ids
    limit = engine.max_model_len
    too_long = ids * (limit // len(ids) + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], plain, use_tqdm=False)
    out = llm.generate([too_long], replace(plain, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == too_long[-(limit - 6) :] and len(out.outputs[0].token_ids) == 6


def hf_penalized_greedy(model, prompt_ids, params: SamplingParams, num: int) -> list[int]:
    """transformers' logits, our reference formula, argmax: an independent greedy loop."""
    ids, cache, out = torch.tensor([prompt_ids]), None, []
    with torch.no_grad():
        for _ in range(num):
            result, cache = hf_forward(model, ids, cache)
            row = reference_adjust(result.logits[0, -1].float(), prompt_ids, out, params, [EOS])
            out.append(int(row.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5}, {"presence_penalty": 2.0}],
)
def test_penalties_change_repetitive_greedy_output(llm, hf_tiny, penalty):
    """A +8 bias on the prompt's tokens makes the random model repeat them; each penalty must
    steer the engine's greedy output exactly as the reference formula does."""
    prompt = "1, 1, 1, 1, 1, 1,"
    prompt_ids = llm.get_tokenizer()(prompt).input_ids
    bias = dict.fromkeys(prompt_ids, 8.0)
    plain = gen(llm, prompt, temperature=0, max_tokens=16, logit_bias=bias).token_ids
    assert set(plain) <= set(prompt_ids)  # the bias alone makes it repeat the prompt
    params = SamplingParams(temperature=0, max_tokens=16, logit_bias=bias, **penalty)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out != plain
    assert out == hf_penalized_greedy(hf_tiny, prompt_ids, params, 16)


@pytest.mark.parametrize(("k", "temperature"), [(0, 1.0), (3, 1.0), (5, 0.0)])
def test_logprobs_are_the_models_with_ranks(llm, hf_tiny, k, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, logprobs=k)
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(out.prompt_token_ids) - 1 : -1]
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token, entries) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        rank = int((ref[step] > ref[step, token]).sum()) + 1
        assert entries[token].rank == rank
        assert entries[token].logprob == pytest.approx(ref[step, token].item(), abs=1e-4)
        assert len(entries) == (max(k, 1) if rank <= k or k == 0 else k + 1)
        top = ref[step].topk(k)
        for r, (value, t) in enumerate(zip(*top, strict=True), start=1):
            t = int(t)
            assert entries[t].rank == r
            assert entries[t].logprob == pytest.approx(float(value), abs=1e-4)
        if temperature == 0:
            assert rank == 1
    chosen = zip(completion.token_ids, completion.logprobs, strict=True)
    total = sum(entries[token].logprob for token, entries in chosen)
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
