"""`PagedLLM`: a LangChain text-completion model served by the in-process paged engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, closing
from functools import reduce
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.messages.ai import add_usage
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from langchain_paged.base import (
    PagedParams,
    completion_metadata,
    usage_metadata,
)
from paged_backend import RequestOutput
from paged_backend.adapters import alast_output, last_output
from paged_backend.engine_client import EngineClient


class PagedLLM(PagedParams, BaseLLM):
    """Completion model on the embedded engine (prompts go in as raw text, no chat template).
    `batch` hands every prompt to the engine at once: one continuous batch. Each generation's
    `generation_info` holds `finish_reason`, `model_name` and `usage`; `llm_output` the sum."""

    @property
    def _llm_type(self) -> str:
        return "paged"

    def _result(self, outs: list[RequestOutput]) -> LLMResult:
        generations = [
            [
                Generation(
                    text=c.text,
                    generation_info={
                        **completion_metadata(c, self.model_name, out),
                        "usage": usage_metadata(out, [c]),
                    },
                )
                for c in out.outputs
            ]
            for out in outs
        ]
        token_usage = reduce(add_usage, (usage_metadata(out) for out in outs))
        return LLMResult(
            generations=generations,
            llm_output={"model_name": self.model_name, "token_usage": token_usage},
        )

    def _chunk(self, out: RequestOutput) -> GenerationChunk | None:
        """The new text of one engine output; the last chunk carries usage and metadata."""
        c = out.outputs[0]
        if out.finished:
            info = {**completion_metadata(c, self.model_name, out), "usage": usage_metadata(out)}
            return GenerationChunk(text=c.delta_text, generation_info=info)
        return GenerationChunk(text=c.delta_text) if c.delta_text else None

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Submit every prompt, then collect: all of them run in the same batch."""
        submitter, params = self._prepare(stop, kwargs)
        ids = _request_ids(len(prompts))
        try:
            streams = [submitter.stream(p, params, i) for p, i in zip(prompts, ids, strict=True)]
            outs = [last_output(stream) for stream in streams]
        except BaseException:  # a bad prompt or an interrupt: stop the ones already queued
            _abort(submitter.engine, ids)
            raise
        return self._result(outs)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        submitter, params = await asyncio.to_thread(self._prepare, stop, kwargs)
        ids = _request_ids(len(prompts))
        try:
            outs = await asyncio.gather(
                *(
                    alast_output(submitter.astream(p, params, i))
                    for p, i in zip(prompts, ids, strict=True)
                )
            )
        except BaseException:  # including cancellation
            _abort(submitter.engine, ids)
            raise
        return self._result(list(outs))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        submitter, params = self._prepare(stop, kwargs, stream=True)
        with closing(submitter.stream(prompt, params)) as outs:
            for out in outs:
                if (chunk := self._chunk(out)) is not None:
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        submitter, params = await asyncio.to_thread(self._prepare, stop, kwargs, stream=True)
        async with aclosing(submitter.astream(prompt, params)) as outs:
            async for out in outs:
                if (chunk := self._chunk(out)) is not None:
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk


def _request_ids(n: int) -> list[str]:
    """Our own ids, so requests can be aborted even before their stream is read."""
    return [f"langchain-{uuid.uuid4().hex}" for _ in range(n)]


def _abort(engine: EngineClient, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort_sync(request_id)  # finished or unknown ids are ignored
