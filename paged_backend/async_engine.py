"""`AsyncEngine`: one engine stepping in a background thread, shared by any number of event
loops and threads. Everyone's requests land in the same continuous batch.

Only the engine thread touches the `LLMEngine`. Callers validate their request in their own
thread (async callers in a worker thread, so that tokenizing and grammar compiles never stall
their event loop; bad input raises in the caller, before anything is queued), then hand it over
through a locked inbox. Outputs go back through a per-request `_Stream` that a coroutine on any
event loop, or a plain thread, can wait on; the engine thread never blocks on a slow consumer.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator

from paged_backend import metrics
from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine, PromptType, check_priority
from paged_backend.errors import (
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    RequestFailedError,
)
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_THROUGHPUT_WINDOW_S = 10.0


class _Unread:
    """The outputs of a request that its reader has not taken yet, folded into one (vLLM's
    `RequestOutputCollector`): the newest state plus every unread step's deltas. A stalled
    reader then costs one output, not a snapshot of the whole text per step."""

    def __init__(self, out: RequestOutput) -> None:
        self.latest = out
        self.steps = 1
        self.texts = {c.index: [c.delta_text] for c in out.outputs}
        self.ids = {c.index: list(c.delta_token_ids) for c in out.outputs}

    def add(self, out: RequestOutput) -> None:
        self.latest = out
        self.steps += 1
        for c in out.outputs:
            self.texts.setdefault(c.index, []).append(c.delta_text)
            self.ids.setdefault(c.index, []).extend(c.delta_token_ids)

    def output(self) -> RequestOutput:
        """One step is handed over as it came: a reader who keeps up sees what it always did."""
        if self.steps == 1:
            return self.latest
        completions = [
            dataclasses.replace(
                c, delta_text="".join(self.texts[c.index]), delta_token_ids=self.ids[c.index]
            )
            for c in self.latest.outputs
        ]
        return dataclasses.replace(self.latest, outputs=completions)


class _Stream:
    """Outputs of one request, waited on by a thread or by a coroutine of any event loop. With
    a `timeout` (seconds for the whole request, the caller's reading included), waiting past
    it raises TimeoutError, so that the caller aborts the request. Unread outputs are merged
    (`_Unread`), so it holds O(1) items however far the reader is behind."""

    def __init__(self, request_id: str, timeout: float | None = None) -> None:
        self._items: collections.deque[_Unread | BaseException] = collections.deque()
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._request_id, self._timeout = request_id, timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def put(self, item: RequestOutput | BaseException) -> None:
        with self._cond:
            last = self._items[-1] if self._items else None
            if isinstance(item, RequestOutput) and isinstance(last, _Unread):
                last.add(item)
            else:
                self._items.append(_Unread(item) if isinstance(item, RequestOutput) else item)
            self._cond.notify()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):  # a closed loop: its consumer is gone
                loop.call_soon_threadsafe(_wake, fut)

    def get(self) -> RequestOutput | BaseException:
        with self._cond:
            while True:
                remaining = self._remaining()
                if remaining == 0.0:
                    raise self._timed_out()
                if self._items:
                    return self._pop()
                self._cond.wait(remaining)

    async def get_async(self) -> RequestOutput | BaseException:
        while True:
            with self._cond:
                remaining = self._remaining()
                if remaining == 0.0:
                    raise self._timed_out()
                if self._items:
                    return self._pop()
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiter = (loop, fut)
            with contextlib.suppress(TimeoutError):  # the loop above raises it, with the id
                await asyncio.wait_for(fut, remaining)

    def _pop(self) -> RequestOutput | BaseException:
        item = self._items.popleft()
        return item.output() if isinstance(item, _Unread) else item

    def _remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(
            f"request {self._request_id!r} did not finish within {self._timeout} s; aborted"
        )


def check_timeout(timeout: object) -> None:
    """`timeout`: None or seconds for the whole request, checked before it is queued."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < 1e9:
        raise ValueError(f"timeout must be None or a number of seconds > 0, got {timeout!r}")


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestStream(Iterator[RequestOutput]):
    """A request's outputs for a plain thread. The request is already submitted: `close()`,
    leaving a `with` block, an error or timeout, or dropping the iterator before its end
    (also before reading anything) aborts it and frees its blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._engine, self._stream = engine, stream
        self._done = False

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        try:
            out = _raise_if_error(self._stream.get())
        except BaseException:
            self.close()
            raise
        self._done = out.finished
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort_sync(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class AsyncEngine:
    """Embeddable streaming engine. Create with `AsyncEngine.from_model(model=None, ...)` or
    share one per model with `paged_backend.get_engine`."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int = 1024) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._inbox: list[tuple] = []
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._closed = False
        self._ids = itertools.count()
        self._num_waiting = 0  # engine's waiting queue after the last step (read racily)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._last_export = 0.0
        self._thread = threading.Thread(target=self._run, name="paged-backend-engine", daemon=True)
        self._thread.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    @classmethod
    def from_model(
        cls, model: str | None = None, *, max_waiting_requests: int = 1024, **engine_args
    ) -> AsyncEngine:
        return cls(
            LLMEngine(EngineConfig(model=model, **engine_args)),
            max_waiting_requests=max_waiting_requests,
        )

    # ---- helpers for adapters ---------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        with self._tokenizer_lock:
            return self.engine.apply_chat_template(messages, **kwargs)

    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        with self._tokenizer_lock:
            return self.engine.tokenize(prompt, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ---- submitting ------------------------------------------------------------------------
    def _prepare(
        self, prompt, params, priority, add_special_tokens, timeout
    ) -> tuple[str | None, list[int], SamplingParams, int]:
        """Tokenize and validate (grammar compile included): the slow part of a submission,
        which has no side effect, so that `generate` can run it off the event loop."""
        check_timeout(timeout)
        params = params if params is not None else SamplingParams()
        ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
        self.engine.validate(ids, params)
        check_priority(priority)
        return (prompt if isinstance(prompt, str) else None), ids, params, priority

    def _enqueue(self, request: tuple, request_id, timeout) -> tuple[str, _Stream]:
        """Queue a `_prepare`d request for the engine thread: quick, safe on an event loop."""
        with self._lock:
            if self._closed:
                raise EngineShutdownError("the engine has been shut down; create a new one")
            waiting = self._num_waiting + sum(1 for c in self._inbox if c[0] == "add")
            if waiting >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{waiting} requests are already waiting (max_waiting_requests="
                    f"{self.max_waiting_requests}); retry later or raise the limit"
                )
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            request_id = str(request_id)
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            stream = self._streams[request_id] = _Stream(request_id, timeout)
            self._inbox.append(("add", request_id, *request))
        self._wakeup.set()
        return request_id, stream

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
        request_id, stream = self._enqueue(request, request_id, timeout)
        finished = False
        try:
            while not finished:
                out = _raise_if_error(await stream.get_async())
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort_sync(request_id)

    def generate_stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> Iterator[RequestOutput]:
        """The same stream for plain threads; closing the iterator early aborts the request."""
        request = self._prepare(prompt, sampling_params, priority, add_special_tokens, timeout)
        request_id, stream = self._enqueue(request, request_id, timeout)
        return RequestStream(self, request_id, stream)

    async def abort(self, request_id: str) -> None:
        self.abort_sync(request_id)

    def abort_sync(self, request_id: str) -> None:
        """Abort a request; its blocks are freed within one step. Unknown ids are ignored."""
        with self._lock:
            if self._closed:
                return
            self._inbox.append(("abort", str(request_id)))
        self._wakeup.set()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                closed = self._closed
            if closed:
                return
            try:
                for cmd in inbox:
                    self._apply(cmd)
                if not engine.has_unfinished_requests():
                    self._num_waiting = 0
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                self._num_waiting = len(engine.scheduler.waiting)
                self._record_throughput(outputs)
                if time.monotonic() - self._last_export > 1.0:  # keep gauges fresh, cheaply
                    self._last_export = time.monotonic()
                    self.stats()
                for out in outputs:
                    self._deliver(out)
            except Exception as exc:  # a bug outside the model step: fail everyone in flight
                logger.exception("engine loop failed")
                self._fail_all(RequestFailedError(f"engine loop failed: {exc!r}"))

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            return
        _, request_id, text, ids, params, priority = cmd
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted before it was queued
        try:
            self.engine.add_request(
                text, params, request_id, priority=priority, prompt_token_ids=ids
            )
        except Exception as exc:  # e.g. the id clashes with one the engine still holds
            with self._lock:
                self._streams.pop(request_id, None)
            stream.put(exc)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is not None:
            stream.put(out)

    def _record_throughput(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self._recent.append((now, sum(len(c.delta_token_ids) for o in outputs for c in o.outputs)))
        while self._recent and self._recent[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be in a bad state; the stream still learns
                logger.exception("abort during failure handling failed")
            stream.put(exc)

    # ---- lifecycle and introspection -------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests in flight end with `EngineShutdownError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams, self._streams = self._streams, {}
        self._wakeup.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        for stream in streams.values():
            stream.put(EngineShutdownError("the engine was shut down while the request ran"))

    @property
    def is_closed(self) -> bool:
        return self._closed

    def stats(self) -> dict:
        stats = self.engine.stats()
        recent = list(self._recent)
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        stats["generation_tokens_per_s"] = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        stats["num_in_flight"] = len(self._streams)
        metrics.export(stats, self.model_name, self.engine.engine_id)
        return stats


def _raise_if_error(item: RequestOutput | BaseException) -> RequestOutput:
    if isinstance(item, BaseException):
        raise item
    if item.error is not None:
        raise RequestFailedError(item.error)
    return item


def _shutdown_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown(timeout=2.0)


__all__ = ["AsyncEngine", "EngineError"]
