"""Faults inside a step, injected through the engine's test hook (`LLMEngine.fault_hook`): only
the requests doing the failed work fail, the others finish exactly as they would alone, no KV
block leaks, and the prefix cache of requests the fault did not touch survives."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
WARM = "A long shared system prompt that another tenant warmed up earlier, " * 3
VICTIM = "The victim's prompt is about rivers and bridges"
BYSTANDER = "The bystander's prompt is about bread and ovens"


@pytest.fixture(scope="module")
def llm(tiny_model, one_thread):
    return LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def alone(llm) -> dict[str, list[int]]:
    return {
        p: llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for p in (VICTIM, BYSTANDER, WARM)
    }


def _run(engine, prompts: dict[str, str]) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id=request_id)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _fail_once(stage: str, victim: str):
    fired = []

    def hook(where: str, request_ids: list[str]) -> None:
        if where == stage and victim in request_ids and not fired:
            fired.append(request_ids)
            raise RuntimeError(f"injected {stage} fault")

    return hook, fired


@pytest.mark.parametrize("stage", ["forward", "sample", "detokenize"])
def test_a_fault_fails_only_the_work_it_hit(llm, alone, stage):
    engine = llm.engine
    llm.generate(WARM, GREEDY, use_tqdm=False)  # another tenant's warm prefix
    engine.fault_hook, fired = _fail_once(stage, "victim")
    try:
        done = _run(engine, {"victim": VICTIM, "bystander": BYSTANDER})
    finally:
        engine.fault_hook = None
    assert fired, "the fault never fired"
    victim = done["victim"]
    assert victim.outputs[0].finish_reason == "error" and f"injected {stage}" in victim.error
    bystander = done["bystander"]
    if stage == "detokenize":  # a per-request fault: the bystander in the same step goes on
        assert bystander.error is None
        assert bystander.outputs[0].token_ids == alone[BYSTANDER]
    else:  # the whole forward failed: every request of that step fails with it
        assert "bystander" in fired[0] and bystander.error is not None
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    # The engine keeps serving, exactly, and the untouched tenant's prefix is still cached.
    again = _run(engine, {"again": BYSTANDER, "warm": WARM})
    assert again["again"].outputs[0].token_ids == alone[BYSTANDER]
    assert again["warm"].outputs[0].token_ids == alone[WARM]
    assert again["warm"].num_cached_tokens > len(engine.tokenize(WARM)) // 2


def test_outputs_are_snapshots(llm):
    """A RequestOutput handed out does not change as the engine goes on."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    engine.add_request(VICTIM, params, request_id="snap")
    first = next(o for o in engine.step() if o.request_id == "snap")
    held = (list(first.outputs[0].token_ids), len(first.outputs[0].logprobs))
    while engine.has_unfinished_requests():
        engine.step()
    assert (list(first.outputs[0].token_ids), len(first.outputs[0].logprobs)) == held
