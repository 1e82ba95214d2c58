"""What the engine does on a GGUF file's own blocks (the default model's Q4_1 file) beyond
test_gguf_models' batching and prefix caching: preemption, structured output and both adapters
(Ray replicas of the file: tests/test_distributed.py)."""

from __future__ import annotations

import json

import pytest
from conftest import PERSON_SCHEMA, assert_all_blocks_free

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
    recomputed on the quantized linears, whose rows (and attention's, in fp32) have the bits
    they have alone: the tokens of a roomy cache, and every block comes back."""
    tight = LLM(model=file, num_kv_blocks=40, max_num_seqs=8, **ARGS)
    got = [o.outputs[0].token_ids for o in tight.generate(FRUITS, LONG, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in roomy.generate(FRUITS, LONG, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want and [len(ids) for ids in got] == [48] * len(FRUITS)
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
    same chat, whole and streamed (a repeated chat from the prefix cache: its rows keep their
    bits, tests/test_gguf_models.py)."""
    from llama_index.core.llms import ChatMessage

    from langchain_paged import ChatPaged
    from llama_index.llms.paged import PagedLLM

    messages = [{"role": "user", "content": "Name three rivers."}]
    want = LLM(model=file, **ARGS).chat(
        messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    text = want[0].outputs[0].text
    assert text

    chat = ChatPaged(model=file, temperature=0, max_tokens=12, **ARGS)
    assert chat.invoke("Name three rivers.").content == text
    assert "".join(c.content for c in chat.stream("Name three rivers.")) == text

    llm = PagedLLM(model=file, temperature=0, max_tokens=12, engine_args=ARGS)
    reply = llm.chat([ChatMessage(role="user", content="Name three rivers.")])
    assert reply.message.content == text
