"""Speculative decoding (ngram drafts, verified by the sampler's own rule): greedy and seeded
outputs are token for token those of plain decoding, whatever else runs in the step (prefill,
preemption, cache hits, penalties, grammars, logprobs); unseeded sampling keeps the model's
distribution (rejection sampling); rejected drafts leave no block held and no block findable."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import OracleProposer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_backend import LLM, AsyncEngine, SamplingParams, cpu
from paged_backend.attention.planner import CDecodePlan
from paged_backend.config import DISABLE_BY_BATCH_SIZE, EngineConfig, SpeculativeConfig
from paged_backend.engine import LLMEngine
from paged_backend.ngram_proposer import NgramProposer
from paged_backend.request import Request
from paged_backend.sampler import Sampler
from paged_backend.scheduler import SchedulerOutput
from paged_backend.spec_decode import verify
from paged_backend.structured_output import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PASSAGE = (
    "The municipal archive of Lindenfeld was founded in 1873 to preserve the records of the "
    "town council, the parish registers and the guild books. Its reading room is open to "
    "researchers on weekdays, and its maps cover the river valley from the sixteenth century on."
)
REPEATING = [5, 6, 7, 8, 9] * 6  # drafts from its first step on


# ---- the proposer and the acceptance rule ------------------------------------------------------
def test_the_proposer_drafts_what_followed_the_most_recent_match():
    proposer = NgramProposer(3, 2, 3)
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 10) == [5, 6, 1]
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]
    # Only what exists after the match: the suffix itself is never its own match.
    assert proposer.propose([7, 1, 2, 8, 1, 2], 4) == [8, 1, 2]


def test_the_proposer_prefers_the_longest_suffix_and_respects_lookup_min():
    # The 3-token suffix [1, 2, 3] occurs once (followed by 4); [2, 3] later (followed by 5).
    assert NgramProposer(1, 2, 3).propose([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 5) == [4]
    assert NgramProposer(1, 2, 2).propose([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 5) == [5]
    assert NgramProposer(2, 3, 4).propose([2, 3, 5, 1, 9, 3], 5) == []  # 1-gram only
    assert NgramProposer(2, 1, 4).propose([2, 3, 5, 1, 9, 3], 5) == [5, 1]
    assert NgramProposer(2, 1, 4).propose([1, 2, 3], 5) == []
    assert NgramProposer(2, 1, 4).propose([1, 1, 1], 0) == []


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement_then_the_models_token():
    """Rows: the token after the known ones, then one after each draft. Here the model's argmax
    at row i is `targets[i]`."""
    sampler = Sampler(8, [0], seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=10)

    def run(drafts: list[int], targets: list[int]) -> list[int]:
        logits = torch.nn.functional.one_hot(torch.tensor(targets), 8).float()
        request = Request("r", [1, 2], greedy)
        tokens, _ = verify(sampler, logits, [request], {request: drafts} if drafts else {})
        return tokens[0]

    assert run([4, 5, 6], [4, 5, 7, 3]) == [4, 5, 7]
    assert run([4, 5, 6], [4, 5, 6, 3]) == [4, 5, 6, 3]  # all + the bonus token
    assert run([4, 5, 6], [1, 5, 6, 3]) == [1]
    assert run([], [3]) == [3]


def test_rejection_sampling_keeps_the_models_distribution():
    """Unseeded sampling at temperature 1 on a 6-token vocabulary, 30,000 sequences drafting
    [d0, d1]: the first token is distributed as the model's first row, the second (present only
    after d0 was kept) as its second row, the third as its third. A rule that kept a draft more
    often than p(d) (or drew the replacement from p again) fails by hundreds of sigmas."""
    n, vocab, drafts = 30_000, 6, [2, 4]
    rows = torch.tensor([[0.5, 1.0, 1.5, -1.0, 0.0, 0.2], [1.0, 0.0, 0.3, 0.3, 1.2, -2.0]])
    rows = torch.cat([rows, torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])])
    probs = torch.softmax(rows, dim=-1)
    params = SamplingParams(temperature=1.0, max_tokens=10)
    requests = [Request(str(i), [1], params) for i in range(n)]
    torch.manual_seed(0)
    tokens, _ = verify(
        Sampler(vocab, [], seed=1), rows.repeat(n, 1), requests, {r: drafts for r in requests}
    )
    for i in range(3):
        seen = [t[i] for t in tokens if len(t) > i]
        counts = torch.bincount(torch.tensor(seen), minlength=vocab).double()
        expected = probs[i].double() * len(seen)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 25.7, (i, counts, expected)  # chi-square, 5 d.o.f., p = 1e-4
    # How often each draft is kept: p(d0), then p(d1) after d0.
    kept = sum(len(t) > 1 for t in tokens) / n
    assert abs(kept - probs[0, 2]) < 4 * (probs[0, 2] * (1 - probs[0, 2]) / n) ** 0.5


# ---- the engine argument -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, r"\['method'\] must be 'ngram'"),
        ({"method": "ngram"}, r"\['num_speculative_tokens'\] must be an int \[1, 32\], got None"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            r"\['prompt_lookup_min'\] must be an int >= 1, got 0",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            r"\['prompt_lookup_max'\] must be an int >= 4, got 3",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, r"unknown keys \['k'\]"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            r"\['disable_by_batch_size'\] must be an int >= 1, got 0",
        ),
        ("ngram:4", "speculative_config must be None or a dict, got str"),
    ],
)
def test_bad_speculative_config_raises_at_the_boundary(tiny_model, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_model), speculative_config=spec)
    with pytest.raises(ValueError, match=match):
        AsyncEngine.from_model(str(tiny_model), speculative_config=spec)


def test_lookup_bounds_default_as_vllms():
    def config(**kw):
        return EngineConfig(
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, **kw}
        )

    assert config().speculative_config == SpeculativeConfig(3, 5, 5)
    assert config(prompt_lookup_max=4).speculative_config == SpeculativeConfig(3, 4, 4)
    assert config(prompt_lookup_min=2).speculative_config == SpeculativeConfig(3, 2, 2)


# ---- who drafts --------------------------------------------------------------------------------
def _references(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {p[0]: p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def tiny_plain(tiny_model, one_thread):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)


RIVALS = {11: 30.0, 12: 29.0, 13: 28.0}
SAMPLED_CASES = [
    dict(temperature=0.8, seed=1),
    dict(temperature=1.0, seed=7, top_k=5, top_p=0.9, min_p=0.05),
    dict(temperature=0, logprobs=2),
    dict(temperature=0.9, seed=2, logprobs=0),
    # min_tokens bans the stop token, which the bias makes the argmax from then on
    dict(temperature=0, min_tokens=9, stop_token_ids=[200], logit_bias={200: 30.0}),
    # penalties on tokens the bias makes the likeliest: which one wins depends on every token
    # before the row (the tiny random model's own logits never repeat a token)
    dict(temperature=0, repetition_penalty=1.5, logit_bias=RIVALS),
    dict(temperature=0, frequency_penalty=2.0, logit_bias=RIVALS),
    dict(temperature=0.7, seed=5, presence_penalty=2.0, frequency_penalty=1.0, logit_bias=RIVALS),
    dict(temperature=0, logit_bias={5: 1.0, 9: -2.0}),
    dict(temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}")),
    dict(temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(json_object=True)),
]


@pytest.mark.parametrize(
    "params", SAMPLED_CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items())
)
def test_every_request_drafts_and_keeps_its_plain_output(tiny_model, tiny_plain, params):
    """Seeded sampling, top-k/p and min-p, logprobs, min_tokens, penalties, logit bias and
    grammars all draft, and give plain decoding's tokens (and logprobs): each row is sampled as
    plain decoding samples the token after the drafts before it, with one draw of the request's
    generator per token gained. Drafts are the request's own plain output, wrong from a random
    point on, so that every acceptance length happens."""
    sampling = SamplingParams(**{"max_tokens": 20, **params})
    prompt = [301, *REPEATING]
    want = tiny_plain.generate([prompt], sampling, use_tqdm=False)[0].outputs[0]
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64, speculative_config=SPEC)
    references = {prompt[0]: prompt + want.token_ids}
    for seed in range(3):
        llm.engine.scheduler.proposer = OracleProposer(references, 4, seed)
        got = llm.generate([prompt], sampling, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        if params.get("logprobs") is not None:
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                assert g.keys() == w.keys()
                for t in g:
                    assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4)
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_drafts_the_grammar_rejects_are_cut_before_verification(tiny_model):
    """A regex of lowercase letters: drafts past the first token it forbids are never run."""
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64, speculative_config=SPEC)
    engine = llm.engine
    letters = engine.tokenize("abc", add_special_tokens=False)
    digit = engine.tokenize("7", add_special_tokens=False)
    proposed = [*letters, *digit, *letters]
    engine.scheduler.proposer.propose = lambda ids, n: proposed[:n]
    sampling = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
    )
    run = engine.runner.execute
    verified = []
    engine.runner.execute = lambda s, t, d: verified.extend(d.values()) or run(s, t, d)
    llm.generate([REPEATING], sampling, use_tqdm=False)
    assert verified
    assert all(drafts == letters[: len(drafts)] for drafts in verified)


def test_steps_with_more_sequences_than_disable_by_batch_size_do_not_draft(tiny_model):
    """Six requests: while more than three run, no step drafts; as they finish, steps draft."""
    spec = {**SPEC, "disable_by_batch_size": 3}
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=128, speculative_config=spec)
    scheduler = llm.engine.scheduler
    running_when_asked = []
    scheduler.proposer.propose = lambda ids, n: (
        running_when_asked.append(len(scheduler.running)) or [5, 6][:n]
    )
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(6)
    ]
    llm.generate([[300 + i, *REPEATING] for i in range(6)], params, use_tqdm=False)
    assert running_when_asked and max(running_when_asked) <= 3
    assert llm.stats()["max_batch_size"] == 6
    assert llm.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_per_step_rule_defaults_to_the_one_measured_for_the_dtype(tiny_model, dtype):
    """bf16 steps price extra rows higher than fp32 ones: each takes its own default, and a
    configured `disable_by_batch_size` wins over it."""
    args = dict(model=str(tiny_model), dtype=dtype, num_kv_blocks=16)
    llm = LLM(**args, speculative_config=SPEC)
    assert llm.engine.scheduler.max_drafting_seqs == DISABLE_BY_BATCH_SIZE[getattr(torch, dtype)]
    llm = LLM(**args, speculative_config={**SPEC, "disable_by_batch_size": 7})
    assert llm.engine.scheduler.max_drafting_seqs == 7
    assert LLM(**args).engine.scheduler.max_drafting_seqs == 0


# ---- outputs identical to plain decoding -------------------------------------------------------
def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_stops_and_max_tokens_cut_the_accepted_run(tiny_model, tiny_plain, one_thread):
    """A stop string, a stop token or max_tokens inside an accepted run ends the output there,
    as in plain decoding: accepted drafts after it are discarded."""
    prompt = [300, *REPEATING]
    base = tiny_plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    mid = base.token_ids[len(base.token_ids) // 2]
    text = base.text[len(base.text) // 2 :][:4]
    cases = [
        *(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 7, 13)),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[mid], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[text], ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=24,
            stop=[text],
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
    ]
    spec = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256, speculative_config=SPEC)
    spec.engine.scheduler.proposer = OracleProposer(_references(tiny_plain, [prompt], 24), 6, 0)
    want = tiny_plain.generate([prompt] * len(cases), cases, use_tqdm=False)
    got = spec.generate([prompt] * len(cases), cases, use_tqdm=False)
    for params, w, g in zip(cases, want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        fields = ("token_ids", "text", "finish_reason", "stop_reason")
        assert [getattr(g, f) for f in fields] == [getattr(w, f) for f in fields], params
    stats = spec.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_preemption_with_drafts_gives_plain_output(tiny_model, tiny_plain, one_thread):
    prompts = [[300 + i, *REPEATING[i:], *[40 + i] * 3] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = LLM(
        model=str(tiny_model),
        dtype="float32",
        block_size=16,
        num_kv_blocks=14,
        speculative_config=SPEC,
    )
    tight.engine.scheduler.proposer = OracleProposer(_references(tiny_plain, prompts, 40), 5, 1)
    expected = tiny_plain.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_num_accepted_tokens"] > 0
    assert _tokens(got) == _tokens(expected)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(b.ref_cnt == 0 for b in tight.engine.kv.pool.blocks)


@pytest.fixture(scope="module")
def real_engines():
    """fp32, where greedy outputs do not depend on the batch's shape."""
    args = dict(dtype="float32", num_kv_blocks=1024)
    return LLM(**args), LLM(**args, speculative_config=SPEC)


def _chat(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return llm.engine.tokenize(llm.engine.apply_chat_template(messages), add_special_tokens=False)


def test_greedy_outputs_are_identical_on_the_default_model(real_engines):
    """A batch mixing drafting requests (greedy) and plain ones (seeded sampling, logprobs):
    every request's tokens are those without drafting; the quoting prompt accepts drafts."""
    plain, spec = real_engines
    prompts = [
        _chat(plain, f"Repeat this text exactly:\n{PASSAGE}"),
        _chat(plain, "Write a short poem about the sea."),
        _chat(plain, f"{PASSAGE}\nWhen was the archive founded?"),
        _chat(plain, "List the days of the week."),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=24, logprobs=1),
    ]
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] > 0.3
    assert stats["spec_mean_acceptance_length"] > 1.5
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # Prefix-cache hits: the same prompts again, and one that continues the quote's answer.
    again = [*prompts[:2], prompts[0] + got[0].outputs[0].token_ids[:17]]
    hits = spec.generate(again, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    want = plain.generate(again, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert _tokens(hits) == _tokens(want)
    assert spec.stats()["prefix_cache_hits"] > 0
    stats = spec.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


# ---- random schedules --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def schedule_engines(tiny_model, one_thread):
    """The plain engine as the reference; drafting ones with a small budget and few blocks."""
    return {
        k: LLMEngine(
            model=str(tiny_model),
            dtype="float32",
            block_size=4,
            num_kv_blocks=16,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            speculative_config={**SPEC, "num_speculative_tokens": k},
        )
        for k in (1, 3, 6)
    }


def _check_step(engine: LLMEngine, out: SchedulerOutput) -> None:
    """A step stays within its token budget and drafts leave room for the model's own token
    within max_tokens."""
    assert out.num_tokens <= engine.config.max_num_batched_tokens
    for request, drafts in out.drafts.items():
        assert len(request.output_token_ids) + len(drafts) < request.max_tokens


def _check_blocks(engine: LLMEngine) -> None:
    """No running request holds a block past its known tokens (rejected drafts' blocks are
    given back), and the free queue holds exactly the unreferenced blocks."""
    kv = engine.kv
    for request in engine.scheduler.running:
        assert len(kv.block_tables[request.request_id]) <= kv.blocks_needed(request.num_tokens)
    assert kv.pool.num_free == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)


def _run(engine: LLMEngine, requests: list) -> dict[int, list[int]]:
    outputs, step = {}, 0
    schedule = engine.scheduler.schedule
    while len(outputs) < len(requests):
        for ids, max_tokens, at in requests:
            if at == step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(None, params, str(ids[0]), prompt_token_ids=ids)
        engine.scheduler.schedule = lambda: _checked(engine, schedule())
        try:
            for out in engine.step():
                if out.finished:
                    outputs[int(out.request_id)] = out.outputs[0].token_ids
        finally:
            del engine.scheduler.schedule
        _check_blocks(engine)
        step += 1
    return outputs


def _checked(engine: LLMEngine, out: SchedulerOutput) -> SchedulerOutput:
    _check_step(engine, out)
    return out


@st.composite
def schedules(draw):
    requests = []
    for i in range(draw(st.integers(1, 5))):
        ids = [100 + i, *draw(st.lists(st.integers(3, 9), min_size=0, max_size=30))]
        requests.append((ids, draw(st.integers(1, 20)), draw(st.integers(0, 6))))
    return requests, draw(st.sampled_from((1, 3, 6))), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_random_schedules_give_plain_outputs(schedule_engines, tiny_plain, schedule):
    """Arrivals at random steps, drafts right up to a random point, a small token budget (drafts
    compete with prefills) and a cache short enough to preempt: every request's tokens are those
    of plain decoding, and every block is free at the end."""
    requests, k, seed = schedule
    engine = schedule_engines[k]
    references = _references(tiny_plain, [ids for ids, _, _ in requests], 20)
    engine.scheduler.proposer = OracleProposer(references, k, seed)
    got = _run(engine, requests)
    for ids, max_tokens, _ in requests:
        assert got[ids[0]] == references[ids[0]][len(ids) :][:max_tokens]
    assert engine.kv.pool.num_free == engine.kv.num_blocks


# ---- kernels: a forward without drafts runs as it does without speculative decoding ----------
@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 C kernels")
def test_bf16_forwards_without_drafts_run_the_plain_engines_kernels(tiny_model):
    """bf16's C decode kernel gives other bits than the prefill path for a short chunk, so it
    takes several rows of a sequence only where they verify drafts: a prompt whose cache hits
    leave a few rows to prefill runs the plain engine's plan, while the verifying steps run in
    the C decode kernel; the tokens are the plain engine's."""
    plans, seen = {}, []
    for name, spec in (("plain", None), ("ngram", SPEC)):
        llm = LLM(  # the C GEMM at every step (oneDNN's bits depend on the rows)
            model=str(tiny_model),
            dtype="bfloat16",
            num_kv_blocks=64,
            cpu_gemm_max_rows=64,
            speculative_config=spec,
        )
        if spec:  # drafts every decode step (rejected: the tiny model's babble never repeats)
            llm.engine.scheduler.proposer.propose = lambda ids, room: [5, 6, 7][:room]
        backend = llm.engine.runner.backend
        prepare = backend.prepare

        def record(meta, prepare=prepare):
            prepare(meta)
            rows = max(b - a for a, b in itertools.pairwise(meta.query_start_loc))
            seen.append((rows, isinstance(meta.prepared[None], CDecodePlan)))

        backend.prepare = record
        llm.generate([REPEATING[:24]], GREEDY, use_tqdm=False)
        first = len(seen)
        outs = llm.generate([[*REPEATING[:24], 11, 12, 13]], GREEDY, use_tqdm=False)
        plans[name] = (seen[first], outs[0].outputs[0].token_ids)
    (rows, c_decode), _ = plans["plain"]
    assert 1 < rows < 1 + SPEC["num_speculative_tokens"] and not c_decode  # the cache-hit tail
    assert plans["ngram"] == plans["plain"]
    assert any(r > 1 and c for r, c in seen)  # the drafting engine's verifying steps
