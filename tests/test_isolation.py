"""Many users on one engine: block hashes are a SHA-256 chain, `cache_salt` keeps tenants'
prefix caches apart, and requests carry a deadline and retries on overload, in the engine and
in both adapters."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from llama_index.core.llms import ChatMessage

from langchain_paged import ChatPaged
from llama_index.llms.paged import PagedLLM
from paged_backend import LLM, EngineOverloadedError, SamplingParams
from paged_backend.adapters import Submitter
from paged_backend.block_pool import hash_block_tokens
from paged_backend.request import Request

SYSTEM = "You are the support assistant of a large company. Follow the policy. " * 4


def test_block_hashes_are_a_sha256_chain_with_tagged_extra_keys():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(first) == 32 and first == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    salted = hash_block_tokens(None, [1, 2, 3, 4], [("cache_salt", "tenant-a")])
    assert salted not in (first, hash_block_tokens(None, [1, 2, 3, 4], [("cache_salt", "b")]))
    # Counted tokens: moving a token between blocks changes the chain.
    assert hash_block_tokens(hash_block_tokens(None, [1, 2]), [3]) != hash_block_tokens(
        hash_block_tokens(None, [1]), [2, 3]
    )


def test_the_salt_separates_every_block_of_the_chain():
    tokens = list(range(40))
    plain = Request("a", tokens, SamplingParams()).update_block_hashes(4)
    salted = Request("b", tokens, SamplingParams(cache_salt="t")).update_block_hashes(4)
    assert len(plain) == len(salted) == 10
    assert not set(plain) & set(salted)


@pytest.mark.parametrize("salt", ["", 7, b"bytes"])
def test_bad_salt_names_the_field(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)


@pytest.fixture(scope="module")
def engine_args(tiny_model) -> dict:
    return {"model": str(tiny_model), "dtype": "float32", "num_kv_blocks": 256}


def test_tenants_with_different_salts_share_nothing(engine_args, one_thread):
    llm = LLM(**engine_args)

    def cached(salt: str | None, question: str) -> int:
        params = SamplingParams(temperature=0, max_tokens=2, cache_salt=salt)
        return llm.generate(SYSTEM + question, params, use_tqdm=False)[0].num_cached_tokens

    assert cached("tenant-a", "Where is my order?") == 0
    assert cached("tenant-b", "Where is my order?") == 0  # same text, other tenant
    assert cached(None, "Where is my order?") == 0  # unsalted requests see no salted block
    assert cached("tenant-a", "Can I return it?") > 40  # each tenant hits its own cache
    assert cached("tenant-b", "Can I return it?") > 40
    assert cached(None, "Can I return it?") > 40


def test_langchain_salt_from_the_constructor_and_per_call(engine_args, one_thread):
    chat = ChatPaged(**engine_args, temperature=0, max_tokens=2, cache_salt="tenant-a")
    messages = [SystemMessage(SYSTEM), HumanMessage("Where is my order?")]

    def cache_read(runnable) -> int:
        return runnable.invoke(messages).usage_metadata["input_token_details"]["cache_read"]

    assert cache_read(chat) == 0
    assert cache_read(chat.bind(cache_salt="tenant-b")) == 0
    assert cache_read(chat) > 40
    assert cache_read(chat.bind(cache_salt="tenant-b")) > 40


def test_llama_index_salt_from_the_constructor_and_per_call(engine_args, one_thread):
    llm = PagedLLM(
        model=engine_args["model"],
        engine_args={k: v for k, v in engine_args.items() if k != "model"},
        temperature=0,
        max_tokens=2,
        cache_salt="tenant-c",
    )
    messages = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content="Hi")]

    def cached(**kwargs) -> int:
        return llm.chat(messages, **kwargs).raw["usage"]["cached_tokens"]

    assert cached() == 0
    assert cached(cache_salt="tenant-d") == 0
    assert cached() > 40 and cached(cache_salt="tenant-d") > 40


LONG = {"max_tokens": 400, "ignore_eos": True}


def test_langchain_timeout_and_standard_params(engine_args, one_thread):
    chat = ChatPaged(**engine_args, temperature=0, timeout=0.05, api_key="unused", **LONG)
    with pytest.raises(TimeoutError, match="did not finish within"):
        chat.invoke("Tell me everything.")
    with pytest.raises(TimeoutError):
        list(chat.stream("Tell me everything."))
    # Per call, and a per-call value wins over the constructor's.
    assert chat.invoke("Hi", timeout=60, max_tokens=2).content is not None
    stats = chat.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    with pytest.raises(ValueError, match="max_retries"):
        ChatPaged(**engine_args, max_retries=-1)


async def test_llama_index_timeout(engine_args, one_thread):
    llm = PagedLLM(
        model=engine_args["model"],
        engine_args={k: v for k, v in engine_args.items() if k != "model"},
        temperature=0,
        timeout=0.05,
        max_tokens=400,
        additional_kwargs={"ignore_eos": True},
    )
    with pytest.raises(TimeoutError):
        llm.complete("Tell me everything.")
    with pytest.raises(TimeoutError):
        await llm.acomplete("Tell me everything.")
    assert llm.complete("Hi", timeout=60, max_tokens=2).text is not None


class _Overloaded:
    """An engine that refuses the first `refusals` submissions, as a full queue does: at
    submission (a local engine) or with the first output (a Ray engine's replicas)."""

    def __init__(self, refusals: int, at_first_output: bool = False) -> None:
        self.refusals, self.at_first_output = refusals, at_first_output
        self.calls = 0

    def _submit(self) -> None:
        self.calls += 1
        if self.calls <= self.refusals:
            raise EngineOverloadedError("queue full")

    def generate_stream(self, *args, **kwargs):
        if not self.at_first_output:
            self._submit()
        return self._outputs()

    def _outputs(self):
        if self.at_first_output:
            self._submit()
        yield "out"

    async def generate(self, *args, **kwargs):
        self._submit()
        yield "out"


@pytest.mark.parametrize("at_first_output", [False, True])
@pytest.mark.parametrize("refusals", [0, 1, 2])
async def test_overload_is_retried_up_to_max_retries(refusals, at_first_output):
    engine = _Overloaded(refusals, at_first_output)
    assert list(Submitter(engine, max_retries=2).stream("p", None)) == ["out"]
    assert engine.calls == refusals + 1
    engine = _Overloaded(refusals)
    assert [o async for o in Submitter(engine, max_retries=2).astream("p", None)] == ["out"]
    assert engine.calls == refusals + 1


async def test_overload_past_max_retries_raises():
    with pytest.raises(EngineOverloadedError):
        Submitter(_Overloaded(2), max_retries=1).stream("p", None)
    with pytest.raises(EngineOverloadedError):
        list(Submitter(_Overloaded(2, at_first_output=True), max_retries=1).stream("p", None))
    with pytest.raises(EngineOverloadedError):
        [o async for o in Submitter(_Overloaded(1), max_retries=0).astream("p", None)]
