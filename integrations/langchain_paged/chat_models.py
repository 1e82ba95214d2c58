"""`ChatPaged`: a LangChain chat model served by the in-process paged engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, closing
from functools import partial
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput, ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list

from langchain_paged.base import (
    PagedParams,
    alast_output,
    completion_metadata,
    last_output,
    usage_metadata,
)
from langchain_paged.messages import render_chat
from paged_backend import AsyncEngine, RequestOutput, SamplingParams
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
            structured_output=False,
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
