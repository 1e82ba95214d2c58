"""`PagedLLM`: a LlamaIndex `LLM` served by the in-process paged-backend engine.

Every method runs natively on the shared `AsyncEngine`: sync methods read `generate_stream` in
the caller's thread, async ones `generate` on whatever event loop they run on (LlamaIndex runs
some coroutines on a fresh loop in a worker thread). Concurrent calls therefore join one
continuous batch, and prompts that share a prefix (system prompt, retrieved context) reuse its
cached KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from functools import partial
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.program.function_program import FunctionCallingProgram, get_function_tool
from llama_index.core.program.utils import get_program_for_llm
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import PydanticProgramMode

from paged_backend.adapters import (
    BACKEND_ARGS,
    EngineHandle,
    StreamedText,
    Submitter,
    TokenCounts,
    alast_output,
    build_sampling_params,
    chat_message,
    check_engine_args,
    check_max_retries,
    last_output,
    pop_request_options,
    ranked_logprobs,
    ranked_prompt_logprobs,
)
from paged_backend.chat_template import check_chat_messages
from paged_backend.engine import check_prompt_text
from paged_backend.engine_client import EngineClient
from paged_backend.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.sampling_params import SamplingParams
from paged_backend.tool_calling import (
    ParsedOutput,
    collect_calls,
    parse_tool_calls,
    pop_tool_request,
    render_tool_chat,
)

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

# Engine arguments `PagedLLM` also takes as keywords of its own (the others go in `engine_args`).
_MOVED_ARGS = (*BACKEND_ARGS, "chat_template", "speculative_config")


class PagedLLM(FunctionCallingLLM):
    """LlamaIndex chat/completion model on the embedded paged-backend engine.

    Construction is cheap: the engine for (`model`, `engine_args`) starts on first use and is
    shared with every other adapter on the same model and arguments. Messages (and `complete`
    prompts, as one user message) are rendered with the model's chat template, `system_prompt`
    included, unless `messages_to_prompt` / `completion_to_prompt` are given;
    `complete(prompt, formatted=True)` sends the prompt as it is.
    Sampling uses vLLM's names: `temperature` defaults to 0.1 (LlamaIndex's usual low value for
    grounded answers), fields left at None take the engine's defaults, any other
    `SamplingParams` field goes in `additional_kwargs`, and every field can be set per call.

    Function calling (`chat_with_tools`, `predict_and_call`, function-mode `structured_predict`,
    `FunctionAgent`): tool calls are constrained to valid calls of the given tools; with
    `tool_required=True` (structured programs) or a `tool_choice` the reply is only calls.
    Small models rarely decide to call a tool on their own: give agents `initial_tool_choice`.
    """

    model: str | None = Field(
        default=None,
        description="Hugging Face model directory or .gguf file; None means the embedded "
        "default model (SmolLM2-135M-Instruct).",
    )
    temperature: float | None = Field(default=0.1, description="0 means greedy.")
    max_tokens: int = Field(default=256, description="Most new tokens per response.")
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = Field(
        default=None, description="Stop sequences, merged with those given per call."
    )
    cache_salt: str | None = Field(
        default=None,
        description="Tenant isolation: only requests with the same salt share prefix-cache "
        "blocks (per call too, as a keyword argument).",
    )
    timeout: float | None = Field(
        default=None,
        description="Seconds a request may take in all; it is then aborted and TimeoutError "
        "raised (per call too).",
    )
    max_retries: int = Field(
        default=2,
        description="Resubmissions, with backoff, of a request refused with "
        "EngineOverloadedError (per call too).",
    )
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Any other SamplingParams fields (vLLM names)."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine arguments (dtype, num_kv_blocks, max_model_len, ...; backend='ray' "
        "with num_replicas, routing, ray_actor_options for replicas on a Ray cluster; "
        "chat_template for a model that has none; speculative_config={'method': 'ngram', "
        "'num_speculative_tokens': k} for drafts by prompt lookup).",
    )

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _collect_backend_args(cls, values: Any) -> Any:
        """`PagedLLM(backend="ray", num_replicas=2)` is `PagedLLM(engine_args={"backend": "ray",
        "num_replicas": 2})`, as in the LangChain adapter; `chat_template` and
        `speculative_config` likewise."""
        if not isinstance(values, dict) or not set(_MOVED_ARGS) & set(values):
            return values
        rest = {k: v for k, v in values.items() if k not in _MOVED_ARGS}
        moved = {k: v for k, v in values.items() if k in _MOVED_ARGS}
        return {**rest, "engine_args": {**(rest.get("engine_args") or {}), **moved}}

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        check_engine_args(self.engine_args)
        self._handle = EngineHandle(self.model, self.engine_args)
        self._sampling_params({})  # bad values fail here, naming the field, not on first call
        check_max_retries(self.max_retries)

    @classmethod
    def class_name(cls) -> str:
        return "PagedLLM"

    @property
    def engine(self) -> EngineClient:
        """The shared engine, started on first use (stats, tokenizer, prefix-cache counters)."""
        return self._handle.get()

    @property
    def metadata(self) -> LLMMetadata:
        """Read from the model's config (LlamaIndex asks on every call): no engine starts."""
        return LLMMetadata(
            context_window=self._handle.context_window,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._handle.model_name,
        )

    def tokenize(self, text: str) -> list[int]:
        """The model's tokens for `text`. LlamaIndex packs prompts into `context_window` by
        counting with tiktoken unless `Settings.tokenizer = llm.tokenize`."""
        return self.engine.tokenize(text, add_special_tokens=False) if text else []

    # ---- requests --------------------------------------------------------------------------
    def _sampling_params(self, kwargs: dict[str, Any]) -> SamplingParams:
        """Constructor fields, then `additional_kwargs`, then call kwargs; stops from all three
        are merged (a per-call `stop=None` keeps the others)."""
        overrides = {**self.additional_kwargs, **kwargs}
        overrides.pop("stop", None)
        stops = (self.additional_kwargs.get("stop"), kwargs.get("stop"))
        params = build_sampling_params(self, overrides, *stops)
        if params.n != 1:
            raise ValueError(f"n must be 1 (a LlamaIndex response holds one text), got {params.n}")
        return params

    def _chat_prompt(
        self, messages: Sequence[ChatMessage], tools: list[dict] | None = None
    ) -> tuple[str, bool]:
        """(prompt, add_special_tokens): the chat template already holds any special tokens."""
        messages = list(messages)
        check_chat_messages([{"role": m.role.value, "content": m.content} for m in messages])
        # predict() and the structured programs add `system_prompt` themselves; add it once.
        if self.system_prompt and not any(
            m.role == MessageRole.SYSTEM and m.content == self.system_prompt for m in messages
        ):
            messages = self._extend_messages(messages)
        if self.messages_to_prompt is not generic_messages_to_prompt and not tools:
            return self.messages_to_prompt(messages), True
        engine = self.engine
        dicts = [_message_dict(m) for m in messages]
        prompt = render_tool_chat(
            engine.apply_chat_template, engine.tokenizer.chat_template, dicts, tools
        )
        return prompt, False

    def _completion_prompt(self, prompt: str, formatted: bool) -> tuple[str, bool]:
        check_prompt_text(prompt)  # before a template or `completion_to_prompt` frames it
        if formatted:
            return prompt, True
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt), True
        return self._chat_prompt([ChatMessage(role=MessageRole.USER, content=prompt)])

    def _request(
        self, prompt: tuple[str, bool], kwargs: dict[str, Any]
    ) -> tuple[Submitter, list[int], SamplingParams]:
        text, add_special_tokens = prompt
        kwargs = dict(kwargs)
        options = pop_request_options(self, kwargs)
        params = self._sampling_params(kwargs)
        engine = self.engine
        ids = engine.tokenize(text, add_special_tokens=add_special_tokens)
        room = engine.max_model_len - len(ids)
        if 0 < room < params.max_tokens:
            # LlamaIndex packs prompts against num_output with estimated token counts: let a
            # prompt that fits end at the context window instead of failing for max_tokens.
            params = dataclasses.replace(params, max_tokens=room)
        return Submitter(engine, **options), ids, params

    def _stream(self, prompt: tuple[str, bool], kwargs: dict[str, Any]) -> Iterator[RequestOutput]:
        submitter, ids, params = self._request(prompt, kwargs)
        return submitter.stream(ids, params)

    async def _astream(
        self, prompt: tuple[str, bool], kwargs: dict[str, Any]
    ) -> AsyncIterator[RequestOutput]:
        """`_stream` for async callers: starting the engine on first use and tokenizing run in a
        worker thread, off their event loop."""
        submitter, ids, params = await asyncio.to_thread(self._request, prompt, kwargs)
        return submitter.astream(ids, params)

    # ---- LlamaIndex API --------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        outputs = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return _completion_response(last_output(outputs), stream=False)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        outputs = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return _convert(outputs, partial(_completion_response, stream=True), self._handle)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, kwargs, with_tools = self._chat_request(messages, kwargs)
        out = last_output(self._stream(prompt, kwargs))
        return _chat_response(out, parse_tool_calls(out.outputs[0].text) if with_tools else None)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, kwargs, with_tools = self._chat_request(messages, kwargs)
        return _convert(self._stream(prompt, kwargs), _ChatStream(with_tools), self._handle)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        rendered = await asyncio.to_thread(self._completion_prompt, prompt, formatted)
        outputs = await self._astream(rendered, kwargs)
        return _completion_response(await alast_output(outputs), stream=False)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        rendered = await asyncio.to_thread(self._completion_prompt, prompt, formatted)
        outputs = await self._astream(rendered, kwargs)
        return _aconvert(outputs, partial(_completion_response, stream=True), self._handle)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, kwargs, with_tools = await asyncio.to_thread(self._chat_request, messages, kwargs)
        out = await alast_output(await self._astream(prompt, kwargs))
        return _chat_response(out, parse_tool_calls(out.outputs[0].text) if with_tools else None)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        prompt, kwargs, with_tools = await asyncio.to_thread(self._chat_request, messages, kwargs)
        return _aconvert(await self._astream(prompt, kwargs), _ChatStream(with_tools), self._handle)

    # ---- function calling ------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """`chat` arguments for a turn with tools. `tool_choice` ("auto", "required", "none" or
        a tool name) overrides `tool_required`."""
        messages = list(chat_history or [])
        if user_msg is not None:
            if isinstance(user_msg, str):
                user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
            messages.append(user_msg)
        if not tools:
            return {"messages": messages, **kwargs}
        return {
            "messages": messages,
            "tools": [t.metadata.to_openai_tool(skip_length_check=True) for t in tools],
            "tool_choice": tool_choice or ("required" if tool_required else "auto"),
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls of a `chat_with_tools` reply (also of each streamed response so far)."""
        calls = [
            ToolSelection(
                tool_id=block.tool_call_id or "",
                tool_name=block.tool_name,
                tool_kwargs=block.tool_kwargs,
            )
            for block in response.message.blocks
            if isinstance(block, ToolCallBlock)
        ]
        if not calls and error_on_no_tool_call:
            raise ValueError(
                f"expected a tool call, the model answered {response.message.content!r}"
            )
        return calls

    def _structured_stream_call(
        self, output_cls: type, prompt: PromptTemplate, llm_kwargs=None, **prompt_args: Any
    ):
        return self._structured_program(output_cls, prompt).stream_call(
            llm_kwargs=llm_kwargs, **prompt_args
        )

    async def _structured_astream_call(
        self, output_cls: type, prompt: PromptTemplate, llm_kwargs=None, **prompt_args: Any
    ):
        return await self._structured_program(output_cls, prompt).astream_call(
            llm_kwargs=llm_kwargs, **prompt_args
        )

    def _structured_program(self, output_cls: type, prompt: PromptTemplate):
        """The program LlamaIndex would pick, except that a function-calling one names its tool
        as the tool choice: LlamaIndex's streaming programs leave the choice to the model
        (non-streaming ones require the call), and a small model then answers in text."""
        function_modes = (PydanticProgramMode.DEFAULT, PydanticProgramMode.FUNCTION)
        if self.pydantic_program_mode not in function_modes:
            return get_program_for_llm(
                output_cls, prompt, self, pydantic_program_mode=self.pydantic_program_mode
            )
        name = get_function_tool(output_cls).metadata.name
        return FunctionCallingProgram.from_defaults(
            output_cls=output_cls, prompt=prompt, llm=self, tool_choice=name
        )

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[tuple[str, bool], dict[str, Any], bool]:
        """(prompt, sampling kwargs, whether tools were given): tools leave the kwargs as a
        call constraint and a description in the prompt."""
        kwargs = dict(kwargs)
        tools = pop_tool_request(kwargs)
        return self._chat_prompt(messages, tools), kwargs, tools is not None


# ---- engine outputs -> LlamaIndex responses ------------------------------------------------
def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """The shared message dict; tool calls come from blocks, or from OpenAI-style
    `additional_kwargs`, and a tool result's `tool_call_id` from `additional_kwargs`."""
    calls = []
    for block in message.blocks:
        if isinstance(block, ToolCallBlock):
            calls.append(
                {"id": block.tool_call_id, "name": block.tool_name, "arguments": block.tool_kwargs}
            )
        elif not isinstance(block, TextBlock):
            raise ValueError(f"PagedLLM accepts text messages only, got a {type(block).__name__}")
    if not calls:  # our replies carry both forms: take the blocks
        for call in message.additional_kwargs.get("tool_calls") or []:
            calls.append({"id": call.get("id"), **call["function"]})
    tool_call_id = message.additional_kwargs.get("tool_call_id")
    return chat_message(message.role.value, message.content or "", calls, tool_call_id)


def _convert(
    outputs: Iterator[RequestOutput], respond: Callable[[RequestOutput], Any], handle: EngineHandle
) -> Iterator:
    """The responses of a stream. It holds `handle` until it ends: an adapter dropped while its
    stream runs (`PagedLLM(...).stream_complete(...)`) would otherwise release the engine."""
    with closing(outputs):  # a consumer that stops early aborts the request
        for out in outputs:
            yield respond(out)


async def _aconvert(
    outputs: AsyncIterator[RequestOutput], respond: Callable[[RequestOutput], Any], handle
) -> AsyncIterator:
    """`_convert` for async streams."""
    async with aclosing(outputs):
        async for out in outputs:
            yield respond(out)


def _raw(out: RequestOutput) -> dict[str, Any]:
    """OpenAI-shaped usage (read by TokenCountingHandler), plus prefix-cache hits; with
    `prompt_logprobs` asked for, each prompt token's candidates (None for the first)."""
    completion = out.outputs[0]
    counts = TokenCounts.of(out)
    raw = {
        "request_id": out.request_id,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "usage": {
            "prompt_tokens": counts.prompt,
            "completion_tokens": counts.generated,
            "total_tokens": counts.total,
            "cached_tokens": counts.cached,
        },
    }
    if out.prompt_logprobs is not None:
        ranked = ranked_prompt_logprobs(out)
        raw["prompt_logprobs"] = [None if c is None else _log_probs(c) for c in ranked]
    return raw


def _logprobs(completion: CompletionOutput, stream: bool) -> list[list[LogProb]] | None:
    """Per token, the candidates best first; a stream chunk carries its new tokens only."""
    positions = ranked_logprobs(completion, delta_only=stream)
    return None if positions is None else [_log_probs(c) for c in positions]


def _log_probs(candidates: list[tuple[int, Logprob]]) -> list[LogProb]:
    return [
        LogProb(
            token=lp.decoded_token or "",
            logprob=lp.logprob,
            bytes=list((lp.decoded_token or "").encode()),
        )
        for _, lp in candidates
    ]


def _completion_response(out: RequestOutput, stream: bool) -> CompletionResponse:
    completion = out.outputs[0]
    return CompletionResponse(
        text=completion.text,
        delta=completion.delta_text if stream else None,
        raw=_raw(out),
        logprobs=_logprobs(completion, stream),
    )


def _chat_response(
    out: RequestOutput, parsed: ParsedOutput | None, delta: str | None = None
) -> ChatResponse:
    """A reply (a stream chunk when `delta` is given); with `parsed`, its content and its
    calls as `ToolCallBlock`s."""
    completion = out.outputs[0]
    blocks: list[Any] = [TextBlock(text=completion.text if parsed is None else parsed.content)]
    extra: dict[str, Any] = {}
    if parsed is not None and parsed.tool_calls:
        blocks += [
            ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments)
            for c in parsed.tool_calls
        ]
        # OpenAI-shaped too: LlamaIndex's streaming structured programs look for this list.
        extra["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in parsed.tool_calls
        ]
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra),
        delta=delta,
        raw=_raw(out),
        logprobs=_logprobs(completion, stream=delta is not None),
    )


class _ChatStream:
    """Engine outputs of one chat stream -> responses with the new text as `delta`; with
    tools, the text of calls is left out of it and the calls complete so far are blocks."""

    def __init__(self, with_tools: bool) -> None:
        self.new_text = StreamedText(with_tools)
        self.with_tools = with_tools
        self.content = ""
        self.deltas: list = []

    def __call__(self, out: RequestOutput) -> ChatResponse:
        text, deltas = self.new_text(out)
        if not self.with_tools:
            return _chat_response(out, None, delta=text)
        self.content += text
        self.deltas += deltas
        return _chat_response(out, collect_calls(self.content, self.deltas), delta=text)
