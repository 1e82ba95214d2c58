"""What the LangChain and LlamaIndex adapters share: a lazily acquired shared engine, building
`SamplingParams` from adapter fields, call kwargs and stop sequences, submitting requests with a
deadline and retries on overload, and model facts (context window, tokenizer) that are
available without starting an engine."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_backend.config import EngineConfig, SpeculativeConfig
from paged_backend.engine_client import EngineClient
from paged_backend.errors import EngineOverloadedError
from paged_backend.model_loader import model_name, resolve_model_path
from paged_backend.models.config import ModelConfig
from paged_backend.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.sampling_params import SamplingParams
from paged_backend.shared_engines import RAY_ARGS, get_engine, release_engine
from paged_backend.tokenizer import Tokenizer
from paged_backend.tool_calling import ToolCallDelta, ToolCallParser

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
# Where the engine runs: "local" (this process) or "ray" (replicas in Ray actors), with the
# Ray backend's own arguments; adapters pass them through to `get_engine` like the rest.
BACKEND_ARGS = ("backend", *RAY_ARGS)
# What `get_engine(model, **engine_args)` accepts besides the model.
ENGINE_ARGS = (
    *(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"),
    "max_waiting_requests",
    *BACKEND_ARGS,
)


class EngineHandle:
    """Acquires the process-wide engine for (model, engine_args) on first use, so adapter
    construction stays cheap, and releases it when the adapter is garbage-collected."""

    def __init__(self, model: str | None, engine_args: dict | None = None) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self._engine: EngineClient | None = None
        self._lock = threading.Lock()

    def get(self) -> EngineClient:
        with self._lock:
            if self._engine is None or self._engine.is_closed:
                self._engine = get_engine(self.model, **self.engine_args)
                weakref.finalize(self, _release, self._engine)
            return self._engine

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def model_name(self) -> str:
        """The name users know the model by, known before the engine exists (for tracing)."""
        return model_name(self.model)

    @functools.cached_property
    def context_window(self) -> int:
        """`model_context_window`, read once (frameworks ask for it on every call)."""
        return model_context_window(self.model, self.engine_args)


# Per-call options that are not sampling parameters: LangChain's standard `timeout` and
# `max_retries`, and LlamaIndex's, with the same meaning in both adapters.
REQUEST_OPTIONS = ("timeout", "max_retries")


def check_max_retries(max_retries: object) -> None:
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")


def pop_request_options(defaults: object, kwargs: dict) -> dict:
    """An adapter's `timeout` and `max_retries`, overridden by (and popped from) call kwargs;
    `Submitter(engine, **options)` applies them."""
    options = {k: kwargs.pop(k, getattr(defaults, k)) for k in REQUEST_OPTIONS}
    check_max_retries(options["max_retries"])
    return options


# Submits a request as attempt n (from 0), retrying refusals at submission: (attempt, outputs).
_Submit = Callable[[int], tuple[int, Iterator[RequestOutput]]]


@dataclass
class Submitter:
    """Sends an adapter's requests to the shared engine: `timeout` (seconds for the whole
    request; it is then aborted and `TimeoutError` raised) and `max_retries` (resubmissions
    after `EngineOverloadedError`, with backoff; an admitted request is never sent twice)."""

    engine: EngineClient
    timeout: float | None = None
    max_retries: int = 0

    def stream(self, prompt, params, request_id=None, **kwargs) -> Iterator[RequestOutput]:
        """Sends the request now (a batch's requests queue together) and returns its outputs.
        A refusal is resubmitted whether it comes at submission (a local engine) or with the
        first output (a Ray engine, once every live replica refused)."""

        def submit(attempt: int) -> tuple[int, Iterator[RequestOutput]]:
            while True:
                try:
                    outputs = self.engine.generate_stream(
                        prompt, params, request_id, timeout=self.timeout, **kwargs
                    )
                    return attempt, outputs
                except EngineOverloadedError:
                    if not self._may_retry(attempt):
                        raise
                    attempt += 1

        return self._resubmitting(submit, *submit(0))

    def _resubmitting(
        self, submit: _Submit, attempt: int, outputs: Iterator[RequestOutput]
    ) -> Iterator[RequestOutput]:
        while True:
            with closing(outputs):  # leaving early aborts the request
                try:
                    first = next(outputs)
                except EngineOverloadedError:
                    if not self._may_retry(attempt):
                        raise
                    attempt, outputs = submit(attempt + 1)
                    continue
                yield first
                yield from outputs
                return

    def _may_retry(self, attempt: int) -> bool:
        """Whether refusal number `attempt` (from 0) is resubmitted, after its backoff."""
        if attempt >= self.max_retries:
            return False
        time.sleep(_retry_delay(attempt))
        return True

    async def astream(self, prompt, params, request_id=None, **kwargs) -> AsyncIterator:
        for attempt in itertools.count():
            outputs = self.engine.generate(
                prompt, params, request_id, timeout=self.timeout, **kwargs
            )
            async with aclosing(outputs):  # leaving early aborts the request
                try:
                    first = await anext(outputs)
                except EngineOverloadedError:
                    if attempt >= self.max_retries:
                        raise
                    await asyncio.sleep(_retry_delay(attempt))
                    continue
                yield first
                async for out in outputs:
                    yield out
                return


def _retry_delay(attempt: int) -> float:
    return min(0.1 * 2**attempt, 2.0)


def last_output(outputs: Iterator[RequestOutput]) -> RequestOutput:
    """Run a request to the end. An error or interrupt arrives inside the engine's iterator,
    whose cleanup aborts the request."""
    return collections.deque(outputs, maxlen=1)[0]


async def alast_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """`last_output` for the async engine stream (cancellation aborts the request)."""
    last = None
    async for out in outputs:
        last = out
    return last


@dataclass(frozen=True)
class TokenCounts:
    """A request's usage as both adapters report it."""

    prompt: int
    generated: int
    cached: int  # prompt tokens served from the prefix cache

    @property
    def total(self) -> int:
        return self.prompt + self.generated

    @classmethod
    def of(cls, out: RequestOutput, completions: list[CompletionOutput] | None = None):
        """Of the whole request, or of some of its `n` completions."""
        generated = sum(len(c.token_ids) for c in completions or out.outputs)
        return cls(len(out.prompt_token_ids), generated, out.num_cached_tokens)


def ranked_logprobs(
    completion: CompletionOutput, delta_only: bool = False
) -> list[list[tuple[int, Logprob]]] | None:
    """Per generated position (a stream chunk's new tokens only, with `delta_only`), the
    (token id, Logprob) candidates, best rank first; None when logprobs were not asked for."""
    if completion.logprobs is None:
        return None
    end = len(completion.token_ids)
    start = end - len(completion.delta_token_ids) if delta_only else 0
    return [_by_rank(position) for position in completion.logprobs[start:end]]


def ranked_prompt_logprobs(out: RequestOutput) -> list[list[tuple[int, Logprob]] | None]:
    """`ranked_logprobs` of the prompt's tokens (`SamplingParams.prompt_logprobs`), None for
    the first; [] when they were not asked for."""
    return [None if p is None else _by_rank(p) for p in out.prompt_logprobs or ()]


def _by_rank(position: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: item[1].rank)


def chat_message(
    role: str, content: str, calls: list[dict] | None = None, tool_call_id: str | None = None
) -> dict:
    """A message as the chat template and the tool rendering take it: earlier calls as
    `tool_calls` ({"id", "name", "arguments"}), a tool result with its `tool_call_id`."""
    entry: dict = {"role": role, "content": content}
    if calls:
        entry["tool_calls"] = calls
    if role == "tool":
        entry["tool_call_id"] = tool_call_id
    return entry


class StreamedText:
    """A stream's new text per engine output for the adapters' chunk builders. With tools
    bound, text that may begin a call is held back and comes out as call deltas instead."""

    def __init__(self, with_tools: bool) -> None:
        self.parser = ToolCallParser() if with_tools else None

    def __call__(self, out: RequestOutput) -> tuple[str, list[ToolCallDelta]]:
        text = out.outputs[0].delta_text
        if self.parser is None:
            return text, []
        return self.parser.feed(text, last=out.finished)


def _release(engine: EngineClient) -> None:
    if not engine.is_closed:
        release_engine(engine)


def merge_stop(*stops: str | list[str] | None) -> list[str] | None:
    """Union of stop sequences, in order, without duplicates; None when there are none. A None
    never overwrites stops given elsewhere (constructor stops survive `stop=None` calls)."""
    merged: list[str] = []
    for stop in stops:
        if not (stop is None or isinstance(stop, str | list | tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in [stop] if isinstance(stop, str) else stop or []:
            if s not in merged:
                merged.append(s)
    return merged or None


def sampling_fields(adapter_cls: type) -> tuple[str, ...]:
    """The `SamplingParams` fields an adapter class declares as (pydantic) fields of its own, in
    `SamplingParams`' order; the others are per-call keyword arguments only. Derived, so that a
    new `SamplingParams` field reaches an adapter by declaring it there, and nowhere else."""
    return tuple(name for name in SAMPLING_FIELDS if name in adapter_cls.model_fields)


def sampling_values(adapter: object) -> dict[str, Any]:
    """An adapter's own sampling values by `SamplingParams` name; None means unset."""
    return {name: getattr(adapter, name) for name in sampling_fields(type(adapter))}


def build_sampling_params(adapter: object, overrides: dict, *stops) -> SamplingParams:
    """SamplingParams from an adapter's own sampling fields, then per-call overrides (None
    means unset), with every stop sequence merged. Unknown override keys raise, naming the
    allowed ones."""
    unknown = set(overrides) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling argument(s) {sorted(unknown)}; allowed: {', '.join(SAMPLING_FIELDS)}"
        )
    values = {k: v for k, v in sampling_values(adapter).items() if v is not None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    values["stop"] = merge_stop(values.pop("stop", None), *stops)
    return SamplingParams(**values)


def check_engine_args(engine_args: dict) -> None:
    """Reject unknown engine arguments, and a malformed `speculative_config` (a nested dict,
    easy to get wrong), when an adapter is built, not at its first call."""
    unknown = set(engine_args) - set(ENGINE_ARGS)
    if unknown:
        raise TypeError(
            f"unknown engine argument(s) {sorted(unknown)}; allowed: {', '.join(ENGINE_ARGS)}"
        )
    spec = engine_args.get("speculative_config")
    if spec is not None and not isinstance(spec, SpeculativeConfig):
        SpeculativeConfig.from_dict(spec)


@functools.lru_cache(maxsize=16)
def _model_path(model: str | None, revision: str | None) -> Path:
    return resolve_model_path(model, revision)


def model_context_window(model: str | None, engine_args: dict) -> int:
    """The engine's `max_model_len` for these arguments, from the model's config.json alone:
    no engine starts."""
    path = _model_path(model, engine_args.get("revision"))
    config = ModelConfig.from_dir(path, engine_args.get("model_impl", "auto"))
    return config.resolve_max_model_len(engine_args.get("max_model_len"))


@functools.lru_cache(maxsize=16)
def model_tokenizer(
    model: str | None, revision: str | None = None, chat_template: str | None = None
) -> Tokenizer:
    """The model's own tokenizer, with the chat template the engine renders, for counting
    tokens without loading weights or a KV cache (the engine's `Tokenizer`: from the cache,
    without transformers' tokenizer)."""
    return Tokenizer(_model_path(model, revision), chat_template)
