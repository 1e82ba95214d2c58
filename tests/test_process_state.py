"""An engine embedded in an application leaves process-wide state alone: torch's thread count
is the engine's only while it works, and each engine exports its own Prometheus series."""

from __future__ import annotations

import pytest
import torch

from paged_backend import LLM, SamplingParams

GOOD = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture
def host_threads():
    """The host's own thread count: 3, which no engine below asks for."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


def test_num_threads_applies_only_while_the_engine_works(tiny_model, host_threads, monkeypatch):
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=16, num_threads=1)
    assert torch.get_num_threads() == host_threads
    runner = llm.engine.runner
    seen = []

    def execute(*args):
        seen.append(torch.get_num_threads())
        return real_execute(*args)

    real_execute = runner.execute
    monkeypatch.setattr(runner, "execute", execute)
    llm.generate(["a prompt"], GOOD, use_tqdm=False)
    assert seen and set(seen) == {1}  # every step ran on the engine's count
    assert torch.get_num_threads() == host_threads


def test_without_num_threads_the_hosts_count_is_used(tiny_model, host_threads):
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=16)
    assert llm.generate(["a prompt"], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    assert torch.get_num_threads() == host_threads


def test_two_engines_of_one_model_export_separate_series(tiny_model):
    prometheus_client = pytest.importorskip("prometheus_client")
    from paged_backend import AsyncEngine

    def sample(stat: str, engine: AsyncEngine) -> float | None:
        labels = {"model": engine.model_name, "engine": engine.engine.engine_id, "replica": ""}
        return prometheus_client.REGISTRY.get_sample_value(f"paged_backend_{stat}", labels)

    args = {"dtype": "float32", "max_model_len": 64}
    engines = [
        AsyncEngine.from_model(str(tiny_model), num_kv_blocks=blocks, **args) for blocks in (8, 12)
    ]
    try:
        ids = [e.engine.engine_id for e in engines]
        assert len(set(ids)) == 2
        list(engines[0].generate_stream("one engine", GOOD))
        stats = [e.stats() for e in engines]  # each exports its own
        assert [s["engine_id"] for s in stats] == ids
        assert [sample("kv_blocks_total", e) for e in engines] == [8, 12]
        assert [sample("num_generated_tokens", e) for e in engines] == [
            s["num_generated_tokens"] for s in stats
        ]
        assert stats[0]["num_generated_tokens"] > stats[1]["num_generated_tokens"] == 0
    finally:
        for engine in engines:
            engine.shutdown()
