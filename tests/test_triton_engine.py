"""The whole engine on the Triton backend (interpreter on CPU) gives the torch backend's tokens."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams

pytest.importorskip("triton")


def test_triton_backend_engine_matches_torch(tiny_model):
    prompts = ["Hello there, how are", "A B C D E F G H I J K L M N O P Q R S", "x"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_model), dtype="float32", attention_backend=backend,
                  num_kv_blocks=32, max_num_batched_tokens=16)  # chunked prefill: mixed steps
        assert llm.engine.runner.backend.name == backend
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
    assert runs["triton"] == runs["torch"]
