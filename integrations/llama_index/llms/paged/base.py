"""`PagedLLM`: a LlamaIndex `LLM` served by the in-process paged-backend engine.

Every method runs natively on the shared `AsyncEngine`: sync methods read `generate_stream` in
the caller's thread, async ones `generate` on whatever event loop they run on (LlamaIndex runs
some coroutines on a fresh loop in a worker thread). Concurrent calls therefore join one
continuous batch, and prompts that share a prefix (system prompt, retrieved context) reuse its
cached KV blocks.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from typing import Any

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
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM, default_completion_to_prompt

from paged_backend.adapters import (
    SAMPLING_FIELDS,
    EngineHandle,
    build_sampling_params,
    context_window,
)
from paged_backend.async_engine import AsyncEngine
from paged_backend.model_loader import DEFAULT_MODEL_NAME, resolve_model_path
from paged_backend.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling_params import SamplingParams


class PagedLLM(LLM):
    """LlamaIndex chat/completion model on the embedded paged-backend engine.

    Construction is cheap: the engine for (`model`, `engine_args`) starts on first use and is
    shared with every other adapter on the same model and arguments. Messages (and `complete`
    prompts, as one user message) are rendered with the model's chat template, `system_prompt`
    included, unless `messages_to_prompt` / `completion_to_prompt` are given;
    `complete(prompt, formatted=True)` sends the prompt as it is.
    Sampling uses vLLM's names: `temperature` defaults to 0.1 (LlamaIndex's usual low value for
    grounded answers), fields left at None take the engine's defaults, any other
    `SamplingParams` field goes in `additional_kwargs`, and every field can be set per call.
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
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Any other SamplingParams fields (vLLM names)."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine arguments (dtype, num_kv_blocks, max_model_len, ...).",
    )

    _handle: EngineHandle = PrivateAttr()
    _model_facts: tuple[int, str] | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        self._handle = EngineHandle(self.model, self.engine_args)
        self._sampling_params({})  # bad values fail here, naming the field, not on first call

    @classmethod
    def class_name(cls) -> str:
        return "PagedLLM"

    @property
    def engine(self) -> AsyncEngine:
        """The shared engine, started on first use (stats, tokenizer, prefix-cache counters)."""
        return self._handle.get()

    @property
    def metadata(self) -> LLMMetadata:
        context_window, model_name = self._facts()
        return LLMMetadata(
            context_window=context_window,
            num_output=self.max_tokens,
            is_chat_model=True,
            model_name=model_name,
        )

    def _facts(self) -> tuple[int, str]:
        """Context window and model name as the engine will compute them, read from the model's
        config so that metadata (LlamaIndex asks on every call) never starts an engine."""
        if self._model_facts is None:
            path = resolve_model_path(self.model)
            window = context_window(self.model, self.engine_args)
            self._model_facts = (window, DEFAULT_MODEL_NAME if self.model is None else path.name)
        return self._model_facts

    def tokenize(self, text: str) -> list[int]:
        """The model's tokens for `text`. LlamaIndex packs prompts into `context_window` by
        counting with tiktoken unless `Settings.tokenizer = llm.tokenize`."""
        return self.engine.tokenize(text, add_special_tokens=False) if text else []

    # ---- requests --------------------------------------------------------------------------
    def _sampling_params(self, kwargs: dict[str, Any]) -> SamplingParams:
        """Constructor fields, then `additional_kwargs`, then call kwargs; stops from all three
        are merged (a per-call `stop=None` keeps the others)."""
        fields = type(self).model_fields
        defaults = {name: getattr(self, name) for name in SAMPLING_FIELDS if name in fields}
        overrides = {**self.additional_kwargs, **kwargs}
        overrides.pop("stop", None)
        stops = (self.additional_kwargs.get("stop"), kwargs.get("stop"))
        params = build_sampling_params(defaults, overrides, *stops)
        if params.n != 1:
            raise ValueError(f"n must be 1 (a LlamaIndex response holds one text), got {params.n}")
        return params

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> tuple[str, bool]:
        """(prompt, add_special_tokens): the chat template already holds any special tokens."""
        messages = list(messages)
        # predict() and the structured programs add `system_prompt` themselves; add it once.
        if self.system_prompt and not any(
            m.role == MessageRole.SYSTEM and m.content == self.system_prompt for m in messages
        ):
            messages = self._extend_messages(messages)
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages), True
        return self.engine.apply_chat_template([_message_dict(m) for m in messages]), False

    def _completion_prompt(self, prompt: str, formatted: bool) -> tuple[str, bool]:
        if formatted:
            return prompt, True
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt), True
        return self._chat_prompt([ChatMessage(role=MessageRole.USER, content=prompt)])

    def _request(
        self, prompt: tuple[str, bool], kwargs: dict[str, Any]
    ) -> tuple[list[int], SamplingParams]:
        text, add_special_tokens = prompt
        params = self._sampling_params(kwargs)
        engine = self.engine
        ids = engine.tokenize(text, add_special_tokens=add_special_tokens)
        room = engine.max_model_len - len(ids)
        if 0 < room < params.max_tokens:
            # LlamaIndex packs prompts against num_output with estimated token counts: let a
            # prompt that fits end at the context window instead of failing for max_tokens.
            params = dataclasses.replace(params, max_tokens=room)
        return ids, params

    def _stream(self, prompt: tuple[str, bool], kwargs: dict[str, Any]) -> Iterator[RequestOutput]:
        return self.engine.generate_stream(*self._request(prompt, kwargs))

    def _astream(
        self, prompt: tuple[str, bool], kwargs: dict[str, Any]
    ) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(*self._request(prompt, kwargs))

    # ---- LlamaIndex API --------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        outputs = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return _completion_response(_last(outputs), stream=False)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        outputs = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return _convert(outputs, _completion_response)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        outputs = self._stream(self._chat_prompt(messages), kwargs)
        return _chat_response(_last(outputs), stream=False)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        outputs = self._stream(self._chat_prompt(messages), kwargs)
        return _convert(outputs, _chat_response)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        outputs = self._astream(self._completion_prompt(prompt, formatted), kwargs)
        return _completion_response(await _alast(outputs), stream=False)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        outputs = self._astream(self._completion_prompt(prompt, formatted), kwargs)
        return _aconvert(outputs, _completion_response)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        outputs = self._astream(self._chat_prompt(messages), kwargs)
        return _chat_response(await _alast(outputs), stream=False)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        outputs = self._astream(self._chat_prompt(messages), kwargs)
        return _aconvert(outputs, _chat_response)


# ---- engine outputs -> LlamaIndex responses ------------------------------------------------
def _message_dict(message: ChatMessage) -> dict[str, str]:
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise ValueError(f"PagedLLM accepts text messages only, got a {type(block).__name__}")
    return {"role": message.role.value, "content": message.content or ""}


def _last(outputs: Iterator[RequestOutput]) -> RequestOutput:
    return collections.deque(outputs, maxlen=1)[0]


async def _alast(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for out in outputs:
        last = out
    return last


def _convert(outputs: Iterator[RequestOutput], respond: Callable[..., Any]) -> Iterator:
    with closing(outputs):  # a consumer that stops early aborts the request
        for out in outputs:
            yield respond(out, stream=True)


async def _aconvert(
    outputs: AsyncIterator[RequestOutput], respond: Callable[..., Any]
) -> AsyncIterator:
    async with aclosing(outputs):
        async for out in outputs:
            yield respond(out, stream=True)


def _raw(out: RequestOutput) -> dict[str, Any]:
    """OpenAI-shaped usage (read by TokenCountingHandler), plus prefix-cache hits."""
    completion = out.outputs[0]
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = len(completion.token_ids)
    return {
        "request_id": out.request_id,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "cached_tokens": out.num_cached_tokens,
        },
    }


def _logprobs(completion: CompletionOutput, stream: bool) -> list[list[LogProb]] | None:
    """Per token, the top candidates by rank; a stream chunk carries its new tokens only."""
    if completion.logprobs is None:
        return None
    end = len(completion.token_ids)  # the engine may already have appended more
    start = end - len(completion.delta_token_ids) if stream else 0
    return [
        [
            LogProb(
                token=lp.decoded_token or "",
                logprob=lp.logprob,
                bytes=list((lp.decoded_token or "").encode()),
            )
            for lp in sorted(position.values(), key=lambda lp: lp.rank)
        ]
        for position in completion.logprobs[start:end]
    ]


def _completion_response(out: RequestOutput, stream: bool) -> CompletionResponse:
    completion = out.outputs[0]
    return CompletionResponse(
        text=completion.text,
        delta=completion.delta_text if stream else None,
        raw=_raw(out),
        logprobs=_logprobs(completion, stream),
    )


def _chat_response(out: RequestOutput, stream: bool) -> ChatResponse:
    completion = out.outputs[0]
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=completion.text),
        delta=completion.delta_text if stream else None,
        raw=_raw(out),
        logprobs=_logprobs(completion, stream),
    )
