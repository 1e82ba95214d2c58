"""What the engine does on a GGUF file's own blocks (the default model's Q4_1 file) beyond
test_gguf_models' batching and prefix caching: preemption, structured output and both adapters
(Ray replicas of the file: tests/test_distributed.py)."""

from __future__ import annotations

import json

import pytest
from conftest import PERSON_SCHEMA, assert_all_blocks_free, token_agreement

from paged_backend import LLM, SamplingParams, StructuredOutputsParams, cpu
from paged_backend.default_model import default_model_file

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

ARGS = {"dtype": "float32"}
FRUITS = [f"Write a list of {n} fruits, one per line:" for n in range(3, 9)]
LONG = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def file() -> str:
    return str(default_model_file())


@pytest.fixture(scope="module")
def roomy(file):
    return LLM(model=file, num_kv_blocks=512, **ARGS)


def test_preempted_requests_finish_with_the_tokens_of_a_roomy_cache(file, roomy):
    """Six requests of ~60 tokens in a cache of 40 blocks (160 tokens): some are preempted and
    recomputed on the quantized linears. A recomputed position's activations may differ in a
    last bit and round to another int8 level, so a near-tie may flip late: nearly all tokens
    agree, the first ones all, and every block comes back."""
    tight = LLM(model=file, num_kv_blocks=40, max_num_seqs=8, **ARGS)
    got = [o.outputs[0].token_ids for o in tight.generate(FRUITS, LONG, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in roomy.generate(FRUITS, LONG, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert [len(ids) for ids in got] == [48] * len(FRUITS)
    assert [ids[:4] for ids in got] == [ids[:4] for ids in want]
    assert token_agreement(got, want) >= 0.9
    assert_all_blocks_free(tight.engine)


def test_structured_output_follows_its_schema_on_quantized_weights(roomy):
    params = SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA)
    )
    prompts = ["Describe a person as JSON:", "A customer record in JSON:"]
    for out in roomy.generate(prompts, params, use_tqdm=False):
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"name", "age", "tags"}
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
        assert all(isinstance(tag, str) for tag in value["tags"])
    assert_all_blocks_free(roomy.engine)


def test_both_adapters_serve_the_file(file):
    """LangChain's chat model and LlamaIndex's LLM on the file: the engine's tokens for the
    same chat, whole and streamed. Each engine computes every prompt whole (no prefix caching):
    the int8 activations of the file's blocks turn the last-bit differences of a prefix hit's
    attention path (the prompt's last rows over cached keys) into other int8 levels, so a
    repeated chat may flip a near-tie (a 2-core AVX2 EPYC in fp32 did at its sixth token), as
    llama.cpp's tokens move with its batch sizes."""
    from llama_index.core.llms import ChatMessage

    from langchain_paged import ChatPaged
    from llama_index.llms.paged import PagedLLM

    args = {**ARGS, "enable_prefix_caching": False}
    messages = [{"role": "user", "content": "Name three rivers."}]
    want = LLM(model=file, **args).chat(
        messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    text = want[0].outputs[0].text
    assert text

    chat = ChatPaged(model=file, temperature=0, max_tokens=12, **args)
    assert chat.invoke("Name three rivers.").content == text
    assert "".join(c.content for c in chat.stream("Name three rivers.")) == text

    llm = PagedLLM(model=file, temperature=0, max_tokens=12, engine_args=args)
    reply = llm.chat([ChatMessage(role="user", content="Name three rivers.")])
    assert reply.message.content == text
