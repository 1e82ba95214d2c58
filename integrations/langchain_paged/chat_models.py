"""`ChatPaged`: a LangChain chat model served by the in-process paged engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from functools import partial
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput, ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from langchain_paged.base import (
    PagedParams,
    completion_metadata,
    usage_metadata,
)
from langchain_paged.messages import render_chat, to_chat_dicts
from paged_backend import RequestOutput, SamplingParams, StructuredOutputsParams
from paged_backend.adapters import (
    StreamedText,
    Submitter,
    alast_output,
    last_output,
    model_context_window,
    model_tokenizer,
)
from paged_backend.chat_template import apply_chat_template, check_chat_messages
from paged_backend.tool_calling import (
    ToolCallDelta,
    check_tools,
    parse_tool_calls,
    pop_tool_request,
    render_tool_chat,
    tool_choice_name,
)

# Threads for `batch`: the engine's default max_num_seqs; more would only wait in its queue.
MAX_BATCH_THREADS = 128


class ChatPaged(PagedParams, BaseChatModel):
    """Chat model on the embedded engine. Construction is cheap; the engine starts on first use
    and is shared by every adapter with the same model and engine arguments, so concurrent
    calls (threads, tasks, `batch`) land in one continuous batch and share the prefix cache.

    ```python
    chat = ChatPaged(max_tokens=256, temperature=0)          # default SmolLM2-135M-Instruct
    chat = ChatPaged(model="~/models/Qwen2.5-0.5B-Instruct", dtype="float32")
    ```
    """

    streaming: bool = False
    """Stream even from `invoke`, so callbacks see every token."""

    @property
    def _llm_type(self) -> str:
        return "paged-chat"

    def _convert_input(self, model_input: LanguageModelInput) -> PromptValue:
        """LangChain's reading of the input, whose KeyError or AttributeError on a malformed
        message (a ("tool", text) pair without its call id, say) becomes a ValueError naming
        the messages, as every other bad input gets."""
        try:
            return super()._convert_input(model_input)
        except (KeyError, AttributeError, TypeError) as exc:
            raise ValueError(
                f"messages could not be read as chat messages: {type(exc).__name__}: {exc}"
            ) from None

    def _resolve_model_profile(self) -> ModelProfile:
        window = model_context_window(self.model, self.engine_args)  # before _handle exists
        return ModelProfile(
            max_input_tokens=window - 1,  # at least one token is left to generate
            max_output_tokens=window - 1,
            text_inputs=True,
            text_outputs=True,
            image_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            pdf_inputs=False,
            tool_calling=True,
            tool_choice=True,
            structured_output=True,
        )

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[BaseMessage]:
        """Every input in flight at once (LangChain's default pool has CPU count + 4 threads),
        so the engine batches them all. `max_concurrency` in the config still limits it."""
        configs = get_config_list(config, len(inputs))
        if configs and configs[0].get("max_concurrency") is None:
            configs[0] = {**configs[0], "max_concurrency": min(len(inputs), MAX_BATCH_THREADS)}
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Prompt tokens of `messages` as the engine sees them: chat template and tools."""
        args = self.engine_args
        tokenizer = model_tokenizer(self.model, args.get("revision"), args.get("chat_template"))
        apply = partial(apply_chat_template, tokenizer)
        specs = [convert_to_openai_tool(t) for t in tools] if tools else None
        prompt = render_chat(apply, tokenizer.chat_template, messages, specs)
        return len(tokenizer.encode(prompt, add_special_tokens=False))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer `tools` (pydantic classes, functions, LangChain tools or OpenAI specs).

        `tool_choice`: None / "auto" lets the model answer or call; "any" / "required" / True
        makes it call one of the tools; a tool name makes it call that tool; "none" describes
        the tools but never parses calls. Every call the model writes is valid for its tool's
        schema (constrained decoding), and without `parallel_tool_calls` it writes at most one.
        Calls arrive in `AIMessage.tool_calls`, and as `tool_call_chunks` when streaming.
        """
        specs = check_tools([_openai_tool(i, t) for i, t in enumerate(tools)])
        choice = tool_choice_name(tool_choice, specs)
        return self.bind(
            tools=specs, tool_choice=choice, parallel_tool_calls=parallel_tool_calls, **kwargs
        )

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A runnable whose output follows `schema`, enforced by the engine's constrained
        decoding (every call of the binding: invoke, stream, batch and their async forms).

        - `method="json_schema"` (default): `schema` is a pydantic model class (the output is
          an instance of it) or a JSON-schema dict (the output is a dict).
        - `method="function_calling"`: `schema` (a pydantic class, TypedDict, JSON schema or
          OpenAI function spec) is bound as the one tool and the model must call it; the
          output is the call's arguments, as an instance of a pydantic `schema`.
        - `method="json_mode"`: a JSON object, constrained to `schema` when one is given (so
          that it always parses into it); parsed into a pydantic `schema`, else a dict.

        The JSON is compact (no free whitespace): small models may otherwise emit whitespace
        until `max_tokens`; and near `max_tokens` the engine steers it to close, so that
        it always parses. `strict` is accepted and ignored: the constraint is always strict.
        With `include_raw=True` the output is `{"raw": AIMessage, "parsed": ...,
        "parsing_error": ...}` and a parsing failure lands in `parsing_error`, not raised.
        """
        del strict
        if kwargs:
            raise ValueError(f"received unsupported arguments {kwargs}")
        is_pydantic = is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method}, "schema": schema}
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            spec = convert_to_openai_tool(schema)
            name = spec["function"]["name"]
            llm = self.bind_tools([spec], tool_choice=name, ls_structured_output_format=ls_format)
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        else:
            llm = self.bind(
                structured_outputs=_json_output_spec(schema, method),
                **({"ls_structured_output_format": ls_format} if schema is not None else {}),
            )
            parser = (
                PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
            )
        if not include_raw:
            return llm | parser
        parser_assign = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        parser_with_fallback = parser_assign.with_fallbacks(
            [parser_none], exception_key="parsing_error"
        )
        return RunnableMap(raw=llm) | parser_with_fallback

    # ---- generation -------------------------------------------------------------------------
    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict, stream: bool
    ) -> tuple[Submitter, str, SamplingParams, bool]:
        """(submitter, prompt, params, whether to parse tool calls). Tools come from `bind_tools`
        (or as call kwargs in the same form) and turn into the prompt and a constraint. It may
        start the engine: async callers run it in a worker thread, off their event loop."""
        kwargs = dict(kwargs)
        if kwargs.get("tools") is not None:
            kwargs["tools"] = [convert_to_openai_tool(t) for t in kwargs["tools"]]
        tools = pop_tool_request(kwargs)
        dicts = to_chat_dicts(messages)
        check_chat_messages(dicts)  # indices of the caller's messages, before tools are added
        submitter, params = self._prepare(stop, kwargs, stream=stream)
        engine = submitter.engine
        prompt = render_tool_chat(
            engine.apply_chat_template, engine.tokenizer.chat_template, dicts, tools
        )
        return submitter, prompt, params, tools is not None

    def _result(self, out: RequestOutput, with_tools: bool) -> ChatResult:
        generations = [
            ChatGeneration(
                message=AIMessage(
                    **_message_fields(c.text, with_tools),
                    usage_metadata=usage_metadata(out, [c]),
                    response_metadata=completion_metadata(c, self.model_name, out),
                )
            )
            for c in out.outputs
        ]
        return ChatResult(generations=generations, llm_output={"model_name": self.model_name})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        submitter, prompt, params, with_tools = self._request(messages, stop, kwargs, stream=False)
        outputs = submitter.stream(prompt, params, add_special_tokens=False)
        return self._result(last_output(outputs), with_tools)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = await asyncio.to_thread(self._request, messages, stop, kwargs, stream=False)
        submitter, prompt, params, with_tools = request
        outputs = submitter.astream(prompt, params, add_special_tokens=False)
        return self._result(await alast_output(outputs), with_tools)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        submitter, prompt, params, with_tools = self._request(messages, stop, kwargs, stream=True)
        to_chunk = _ChunkBuilder(self.model_name, with_tools)
        with closing(submitter.stream(prompt, params, add_special_tokens=False)) as outs:
            for out in outs:
                if (chunk := to_chunk(out)) is not None:
                    yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = await asyncio.to_thread(self._request, messages, stop, kwargs, stream=True)
        submitter, prompt, params, with_tools = request
        to_chunk = _ChunkBuilder(self.model_name, with_tools)
        async with aclosing(submitter.astream(prompt, params, add_special_tokens=False)) as outs:
            async for out in outs:
                if (chunk := to_chunk(out)) is not None:
                    yield chunk


def _openai_tool(index: int, tool: Any) -> dict[str, Any]:
    """LangChain's conversion, with whatever it raises on a malformed tool (AttributeError
    and KeyError too) turned into one ValueError naming the tool."""
    try:
        return convert_to_openai_tool(tool)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise ValueError(f"tools[{index}] is not a tool: {exc}") from None


def _json_output_spec(schema: Any, method: str) -> StructuredOutputsParams:
    """The constraint of `with_structured_output` for the JSON methods."""
    if method == "json_mode" and schema is None:
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    if method not in ("json_schema", "json_mode"):
        raise ValueError(
            f"unknown method {method!r}; allowed: 'json_schema', 'function_calling', 'json_mode'"
        )
    if isinstance(schema, dict):  # a JSON schema, used as it is
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    try:
        json_schema = convert_to_json_schema(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            "method='json_schema' needs a pydantic class, TypedDict or JSON-schema dict, "
            f"got {schema!r}: {exc}"
        ) from None
    return StructuredOutputsParams(json=json_schema, disable_any_whitespace=True)


def _message_fields(text: str, with_tools: bool) -> dict[str, Any]:
    """AIMessage content, plus its tool calls when tools were bound."""
    if not with_tools:
        return {"content": text}
    parsed = parse_tool_calls(text)
    return {
        "content": parsed.content,
        "tool_calls": [
            tool_call(name=c.name, args=c.arguments, id=c.id) for c in parsed.tool_calls
        ],
        "invalid_tool_calls": [
            invalid_tool_call(name=name, args=args, id=id_, error=error)
            for id_, name, args, error in parsed.invalid_tool_calls
        ],
    }


class _ChunkBuilder:
    """Engine outputs of one stream -> message chunks: new text, tool-call chunks when tools
    are bound, and usage and metadata on the last chunk."""

    def __init__(self, model_name: str, with_tools: bool) -> None:
        self.model_name = model_name
        self.new_text = StreamedText(with_tools)

    def __call__(self, out: RequestOutput) -> ChatGenerationChunk | None:
        c = out.outputs[0]
        text, deltas = self.new_text(out)
        fields: dict[str, Any] = {"content": text}
        if deltas:
            fields["tool_call_chunks"] = [_tool_call_chunk(d) for d in deltas]
        if out.finished:
            fields.update(
                chunk_position="last",
                usage_metadata=usage_metadata(out, [c]),
                response_metadata=completion_metadata(c, self.model_name, out),
            )
        elif not text and not deltas:
            return None
        return ChatGenerationChunk(message=AIMessageChunk(**fields))


def _tool_call_chunk(delta: ToolCallDelta):
    return tool_call_chunk(name=delta.name, args=delta.arguments, id=delta.id, index=delta.index)
