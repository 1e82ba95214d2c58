"""`EngineClient`: what the local `AsyncEngine` and the Ray `RayEngine` share, as vLLM's
`EngineClient` protocol is what its engines implement.

A request is checked and tokenized here, once, in `_prepare` (slow, side-effect free, so that
`generate` runs it in a worker thread and never stalls the caller's event loop), then handed to
the subclass's quick `_submit`. Each engine supplies only what differs: where the request goes
(`_submit`), how its outputs come back (`_outputs`, `_aoutputs`) and how an unfinished request
is stopped (`_end`). The stream shapes, async iterator and thread iterator, are written here,
so that leaving either early aborts the request the same way on every engine.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Generator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from paged_backend.engine import PromptType, check_priority, tokenize_prompt, truncate_prompt
from paged_backend.outputs import RequestOutput
from paged_backend.prompt_dicts import prompt_source, salted
from paged_backend.sampling_params import SamplingParams


def check_timeout(timeout: object) -> None:
    """`timeout`: None or seconds for the whole request, checked before it is queued."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < 1e9:
        raise ValueError(f"timeout must be None or a number of seconds > 0, got {timeout!r}")


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed `_prepare`: what an engine queues or sends."""

    prompt: PromptType  # as given: a replica tokenizes text again, as a local engine would
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    add_special_tokens: bool
    timeout: float | None

    @property
    def text(self) -> str | None:
        """The prompt text, None when the prompt was given as token ids alone."""
        return prompt_source(self.prompt)[1]


class _Handle(Protocol):
    request_id: str


H = TypeVar("H", bound=_Handle)


class EngineClient(ABC, Generic[H]):
    """The interface adapters use: `generate` (async), `generate_stream` (threads), `abort`,
    tokenizer helpers, `stats`, `shutdown`. `H` is an engine's handle on one submitted
    request; subclasses set `tokenizer`, `model_name`, `max_model_len`, `_tokenizer_lock` and
    `_closed`."""

    tokenizer: Any  # paged_backend.tokenizer.Tokenizer
    model_name: str
    max_model_len: int
    _tokenizer_lock: threading.Lock
    _closed: bool

    # ---- helpers for adapters ---------------------------------------------------------------
    @abstractmethod
    def apply_chat_template(self, messages: list[dict], **kwargs) -> str: ...

    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        with self._tokenizer_lock:
            return tokenize_prompt(self.tokenizer, prompt, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ---- submitting ------------------------------------------------------------------------
    def _prepare(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        priority: int,
        add_special_tokens: bool,
        timeout: float | None,
    ) -> PreparedRequest:
        """Check and tokenize a request: the slow part of a submission, without side effects,
        so that `generate` can run it off the event loop. Bad input raises in the caller."""
        check_timeout(timeout)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        source, _, salt = prompt_source(prompt)
        params = salted(params, salt)
        ids = self.tokenize(source, add_special_tokens=add_special_tokens)
        ids = truncate_prompt(ids, params, self.max_model_len)
        self._validate(ids, params)
        check_priority(priority)
        return PreparedRequest(prompt, ids, params, priority, add_special_tokens, timeout)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Checks that need the model (vocabulary, context length, grammar); an engine that
        holds no model here leaves them to where it runs, which raises at the first output."""

    @abstractmethod
    def _submit(self, request: PreparedRequest, request_id: str | None) -> H:
        """Queue or send a prepared request: quick, safe on an event loop."""

    @abstractmethod
    def _outputs(self, handle: H) -> Generator[RequestOutput, None, None]:
        """A submitted request's outputs, read by blocking the calling thread."""

    @abstractmethod
    def _aoutputs(self, handle: H) -> AsyncIterator[RequestOutput]:
        """The same outputs, awaited on the caller's event loop."""

    @abstractmethod
    def _end(self, handle: H) -> None:
        """The caller is done with a request: abort it unless it finished. Called once."""

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream `RequestOutput`s (cumulative text and `delta_text`) until finished. Leaving
        the loop early or cancelling the task aborts the request and frees its blocks; so does
        `timeout` (seconds for the whole request), which then raises `TimeoutError`.
        Tokenizing and validating run in a worker thread, not on the caller's event loop."""
        request = await asyncio.to_thread(
            self._prepare, prompt, sampling_params, priority, add_special_tokens, timeout
        )
        handle = self._submit(request, request_id)
        try:
            async with aclosing(self._aoutputs(handle)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self._end(handle)

    def generate_stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> RequestStream:
        """The same stream for plain threads: the request is submitted now; closing or
        dropping the iterator before its end aborts it."""
        request = self._prepare(prompt, sampling_params, priority, add_special_tokens, timeout)
        handle = self._submit(request, request_id)
        return RequestStream(self, handle)

    async def abort(self, request_id: str) -> None:
        self.abort_sync(request_id)

    @abstractmethod
    def abort_sync(self, request_id: str) -> None:
        """Abort a request; its blocks are freed within a step. Unknown ids are ignored."""

    # ---- lifecycle and introspection -------------------------------------------------------
    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight end with `EngineShutdownError`."""

    @property
    def is_closed(self) -> bool:
        return self._closed

    @abstractmethod
    def stats(self) -> dict: ...


class RequestStream(Iterator[RequestOutput], Generic[H]):
    """A request's outputs for a plain thread. The request is already submitted: `close()`,
    leaving a `with` block, an error or timeout, or dropping the iterator before its end
    (also before reading anything) aborts it and frees its blocks."""

    def __init__(self, engine: EngineClient[H], handle: H) -> None:
        self.request_id = handle.request_id
        self._engine, self._handle = engine, handle
        self._outputs = engine._outputs(handle)
        self._closed = False

    def __next__(self) -> RequestOutput:
        try:
            return next(self._outputs)
        except BaseException:  # StopIteration included: the request is over either way
            self.close()
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outputs.close()
            self._engine._end(self._handle)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
