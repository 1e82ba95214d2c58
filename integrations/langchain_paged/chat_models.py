"""`ChatPaged`: a LangChain chat model served by the in-process paged engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, closing
from functools import partial
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput, ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from pydantic import BaseModel

from langchain_paged.base import (
    PagedParams,
    alast_output,
    completion_metadata,
    last_output,
    usage_metadata,
)
from langchain_paged.messages import render_chat
from paged_backend import AsyncEngine, RequestOutput, SamplingParams, StructuredOutputsParams
from paged_backend.adapters import context_window, model_tokenizer

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

    def _resolve_model_profile(self) -> ModelProfile:
        window = context_window(self.model, self.engine_args)
        return ModelProfile(
            max_input_tokens=window - 1,  # at least one token is left to generate
            max_output_tokens=window - 1,
            text_inputs=True,
            text_outputs=True,
            image_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            pdf_inputs=False,
            tool_calling=False,
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
        """Prompt tokens of `messages` as the engine sees them, chat template included."""
        if tools:
            raise NotImplementedError("tool calling is not supported by ChatPaged yet")
        tokenizer = model_tokenizer(self.model)
        apply = partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
        prompt = render_chat(apply, messages)
        return len(tokenizer(prompt, add_special_tokens=False).input_ids)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type[BaseModel] | None = None,
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
        - `method="json_mode"`: any JSON object; parsed into `schema` when it is a pydantic
          class, otherwise returned as a dict.
        - `method="function_calling"`: not supported yet (ChatPaged has no tool calling).

        The JSON is compact (no free whitespace): small models may otherwise emit whitespace
        until `max_tokens`. `strict` is accepted and ignored: the constraint is always strict.
        With `include_raw=True` the output is `{"raw": AIMessage, "parsed": ...,
        "parsing_error": ...}` and a parsing failure lands in `parsing_error`, not raised.
        """
        del strict
        if kwargs:
            raise ValueError(f"received unsupported arguments {kwargs}")
        is_pydantic = isinstance(schema, type) and issubclass(schema, BaseModel)
        if method == "function_calling":
            raise NotImplementedError(
                "method='function_calling' needs tool calling, which ChatPaged does not support "
                "yet; use method='json_schema' or method='json_mode'"
            )
        if method == "json_schema":
            if is_pydantic:
                spec = StructuredOutputsParams(
                    json=schema.model_json_schema(), disable_any_whitespace=True
                )
            elif isinstance(schema, dict):
                spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            else:
                raise ValueError(
                    "method='json_schema' needs a pydantic model class or a JSON-schema dict, "
                    f"got {schema!r}"
                )
        elif method == "json_mode":
            spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        else:
            raise ValueError(
                f"unknown method {method!r}; allowed: 'json_schema', 'json_mode' "
                "('function_calling' is not supported yet)"
            )
        ls_format = {"kwargs": {"method": method}, "schema": schema}
        llm = self.bind(
            structured_outputs=spec,
            **({"ls_structured_output_format": ls_format} if schema is not None else {}),
        )
        parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
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
    ) -> tuple[AsyncEngine, str, SamplingParams]:
        engine, params = self._prepare(stop, kwargs, stream=stream)
        return engine, render_chat(engine.apply_chat_template, messages), params

    def _result(self, out: RequestOutput) -> ChatResult:
        generations = [
            ChatGeneration(
                message=AIMessage(
                    content=c.text,
                    usage_metadata=usage_metadata(out, [c]),
                    response_metadata=completion_metadata(c, self.model_name),
                )
            )
            for c in out.outputs
        ]
        return ChatResult(generations=generations, llm_output={"model_name": self.model_name})

    def _chunk(self, out: RequestOutput) -> ChatGenerationChunk | None:
        """The new text of one engine output; the last chunk carries usage and metadata."""
        c = out.outputs[0]
        if out.finished:
            message = AIMessageChunk(
                content=c.delta_text,
                chunk_position="last",
                usage_metadata=usage_metadata(out, [c]),
                response_metadata=completion_metadata(c, self.model_name),
            )
        elif c.delta_text:
            message = AIMessageChunk(content=c.delta_text)
        else:
            return None
        return ChatGenerationChunk(message=message)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, prompt, params = self._request(messages, stop, kwargs, stream=False)
        return self._result(
            last_output(engine.generate_stream(prompt, params, add_special_tokens=False))
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, prompt, params = self._request(messages, stop, kwargs, stream=False)
        return self._result(
            await alast_output(engine.generate(prompt, params, add_special_tokens=False))
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        engine, prompt, params = self._request(messages, stop, kwargs, stream=True)
        with closing(engine.generate_stream(prompt, params, add_special_tokens=False)) as outs:
            for out in outs:
                if (chunk := self._chunk(out)) is not None:
                    yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        engine, prompt, params = self._request(messages, stop, kwargs, stream=True)
        async with aclosing(engine.generate(prompt, params, add_special_tokens=False)) as outs:
            async for out in outs:
                if (chunk := self._chunk(out)) is not None:
                    yield chunk
