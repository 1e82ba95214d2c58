"""LangChain's own standard test suites for chat models, run against `ChatPaged` on the default
model. Tool calling, tool choice, structured output and JSON mode are on; multimodal inputs are
off (the model reads text only)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_paged import ChatPaged
from paged_backend import get_engine, release_engine

ENGINE_ARGS = {"num_kv_blocks": 512}


class PagedChatTestConfig:
    """What `ChatPaged` is and what it can do, for both suites."""

    @property
    def chat_model_class(self) -> type[ChatPaged]:
        return ChatPaged

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(ENGINE_ARGS)

    has_tool_calling = True
    has_tool_choice = True
    has_structured_output = True
    supports_json_mode = True
    supports_image_inputs = False
    supports_image_urls = False
    supports_pdf_inputs = False
    supports_audio_inputs = False
    supports_video_inputs = False
    supports_image_tool_message = False
    supports_pdf_tool_message = False
    supports_anthropic_inputs = False
    supports_model_override = False  # one engine serves one model
    returns_usage_metadata = True


class TestChatPagedUnit(PagedChatTestConfig, ChatModelUnitTests):
    """With LangChain's standard parameters as they are: `timeout` is the request deadline,
    `max_retries` retries on overload, `api_key` is accepted and ignored."""


@pytest.mark.slow
class TestChatPagedIntegration(PagedChatTestConfig, ChatModelIntegrationTests):
    """Short greedy answers: a quick suite that sees the same text on every run. The budget
    guard ends every tool call and JSON object complete within `max_tokens`, and leaves the
    tokens it does not need to the arguments' content."""

    max_tokens = 64

    @pytest.fixture(autouse=True, scope="class")
    def _shared_engine(self):
        """Keep the suite's engine alive between tests: each test builds its own ChatPaged,
        and the last adapter to go would otherwise shut the engine down."""
        engine = get_engine(None, **ENGINE_ARGS)
        yield
        release_engine(engine)

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {"temperature": 0, "max_tokens": self.max_tokens}

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The second of two requests with the same long system prompt reads it from cache."""
        model = ChatPaged(**ENGINE_ARGS, temperature=0, max_tokens=4)
        system = "You answer questions about the solar system. " * 12
        messages = [SystemMessage(system), HumanMessage("Which planet is largest?")]
        model.invoke(messages)
        if not stream:
            return model.invoke(messages)
        full = None
        for chunk in model.stream(messages):
            full = chunk if full is None else full + chunk
        return full

    @pytest.mark.xfail(
        reason="SmolLM2-135M answers the weather question in text instead of calling the "
        "offered tool when the tool choice is left to it ('auto'): transformers' own greedy "
        "generation of the same rendered prompt gives the same text, token for token, and "
        "ranks the call's first token 13th; forced calls pass in test_tool_calling and "
        "test_tool_choice",
        strict=True,
    )
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)


@pytest.mark.slow
class TestChatPagedIntegrationTight(TestChatPagedIntegration):
    """The suite's structured answers and a tool call with a tighter budget, where a call's
    scaffolding takes most of it (the budget guard's hard case). These are the tests whose
    answers the guard shaped at 48 tokens (counted by wrapping `BudgetGuard`, fp32, 2026-12-06);
    in the suite's other tool-call and JSON tests, and the async twins of these, it never
    acted, so they run at 64 tokens only."""

    max_tokens = 48
    BUDGET_TESTS = frozenset(
        {
            "test_structured_output",
            "test_structured_output_optional_param",
            "test_unicode_tool_call_integration",
        }
    )

    @pytest.fixture(autouse=True)
    def _budget_tests_only(self, request):
        if request.node.originalname not in self.BUDGET_TESTS:
            pytest.skip("no budget guard at work: run at 64 tokens by TestChatPagedIntegration")
