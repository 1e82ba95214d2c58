"""One engine replica: an `AsyncEngine` in its own process (a Ray actor). Plain Python here so
that the contract (`info`, `generate`, `abort`, `stats`) stays the same when a replica later
becomes a group of processes (tensor parallelism)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing

from paged_backend.async_engine import AsyncEngine
from paged_backend.engine import PromptType
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams


class Replica:
    """The actor's body. Its `generate` is a Ray streaming generator: each output is one
    object; a caller's `ray.cancel` closes it, and closing aborts the request here."""

    def __init__(self, model: str | None, engine_args: dict) -> None:
        self.engine = AsyncEngine.from_model(model, **engine_args)

    def info(self) -> dict:
        """What the router and adapters need to know, as this replica resolved it."""
        config = self.engine.engine.config
        return {
            "block_size": config.block_size,
            "max_model_len": self.engine.max_model_len,
            "kv_blocks_total": self.engine.engine.kv.num_blocks,
        }

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int,
        add_special_tokens: bool,
        timeout: float | None,
    ) -> AsyncIterator[RequestOutput]:
        outputs = self.engine.generate(
            prompt,
            params,
            request_id,
            priority=priority,
            add_special_tokens=add_special_tokens,
            timeout=timeout,
        )
        async with aclosing(outputs):  # closed early (cancelled): the engine aborts it
            async for out in prompt_logprobs_once(outputs):
                yield out

    def abort(self, request_id: str) -> None:
        self.engine.abort_sync(request_id)

    def stats(self) -> dict:
        return self.engine.stats()


async def prompt_logprobs_once(
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[RequestOutput]:
    """`outputs` with their prompt logprobs in the first that has them only: each output is
    serialized on its way to the caller, and a long prompt's would be at every step (the
    caller puts them back, `RayEngine._received`)."""
    sent = False
    async for out in outputs:
        if sent:
            out = dataclasses.replace(out, prompt_logprobs=None)
        sent = sent or out.prompt_logprobs is not None
        yield out
