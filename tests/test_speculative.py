"""Speculative decoding (ngram drafts, greedy verification): outputs are token for token those of
plain decoding, whatever else runs in the step (sampling, prefill, preemption, cache hits);
rejected drafts leave no block held and no block findable; who does not draft, and why."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_backend import LLM, AsyncEngine, SamplingParams
from paged_backend.config import EngineConfig, SpeculativeConfig
from paged_backend.engine import LLMEngine
from paged_backend.ngram_proposer import NgramProposer
from paged_backend.request import Request
from paged_backend.scheduler import SchedulerOutput
from paged_backend.spec_decode import accept_greedy, why_no_drafts
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


def test_accept_greedy_keeps_drafts_up_to_the_first_disagreement_then_the_models_token():
    assert accept_greedy([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]
    assert accept_greedy([4, 5, 6], [4, 5, 6, 8]) == [4, 5, 6, 8]  # all + the bonus token
    assert accept_greedy([4, 5, 6], [9, 5, 6, 8]) == [9]
    assert accept_greedy([], [3]) == [3]


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
class OracleProposer:
    """Drafts the plain engine's own continuation of each prompt (told apart by its first token),
    wrong from a random point on: every acceptance length happens, and a stop or max_tokens
    falls inside accepted runs."""

    def __init__(self, references: dict[int, list[int]], k: int, seed: int) -> None:
        self.references = references  # first prompt token -> prompt + plain output
        self.k = k
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        truth = self.references[token_ids[0]][len(token_ids) :]
        num = min(self.k, max_drafts)
        right = self.rng.randint(0, num)
        wrong = [self.rng.randint(3, 9) for _ in range(num - right)]
        return (truth[:right] + wrong)[:num]


def _references(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {p[0]: p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def tiny_plain(tiny_model, one_thread):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (dict(temperature=0.8, seed=1), "temperature > 0"),
        (dict(logprobs=2), "logprobs"),
        (dict(min_tokens=12), "min_tokens not reached"),
        (dict(repetition_penalty=1.2), "penalties"),
        (dict(logit_bias={5: 1.0}), "logit_bias"),
        (dict(structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}")), "structured"),
    ],
)
def test_these_requests_do_not_draft(tiny_model, params, reason):
    """Drafted rows are argmax rows and nothing else: a request whose sampler does more than the
    argmax decodes plainly. Each reason is in `spec_decode.why_no_drafts`, which the scheduler
    asks before it asks the proposer."""
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64, speculative_config=SPEC)
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 12, **params})
    request = Request("r", REPEATING, sampling, grammar=llm.engine._new_grammar(sampling))
    assert reason in why_no_drafts(request)
    asked = []
    llm.engine.scheduler.proposer.propose = lambda ids, n: asked.append(ids) or []
    llm.generate([REPEATING], sampling, use_tqdm=False)
    assert not asked
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([REPEATING], greedy, use_tqdm=False)
    assert asked


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
