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
from collections.abc import AsyncIterator, Generator

from paged_backend import metrics
from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine
from paged_backend.engine_client import EngineClient, PreparedRequest
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
    """Outputs of one request, waited on by a thread or by a coroutine of any event loop; an
    error the engine put raises in the reader. With a `timeout` (seconds for the whole
    request, the caller's reading included), waiting past it raises TimeoutError, so that the
    caller aborts the request. Unread outputs are merged (`_Unread`), so it holds O(1) items
    however far the reader is behind. `finished`: the reader has the last output."""

    def __init__(self, request_id: str, timeout: float | None = None) -> None:
        self._items: collections.deque[_Unread | BaseException] = collections.deque()
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self.request_id, self._timeout = request_id, timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.finished = False

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

    def get(self) -> RequestOutput:
        with self._cond:
            while True:
                remaining = self._remaining()
                if remaining == 0.0:
                    raise self._timed_out()
                if self._items:
                    return self._pop()
                self._cond.wait(remaining)

    async def get_async(self) -> RequestOutput:
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

    def _pop(self) -> RequestOutput:
        item = self._items.popleft()
        out = _raise_if_error(item.output() if isinstance(item, _Unread) else item)
        self.finished = out.finished
        return out

    def _remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(
            f"request {self.request_id!r} did not finish within {self._timeout} s; aborted"
        )


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class AsyncEngine(EngineClient[_Stream]):
    """Embeddable streaming engine. Create with `AsyncEngine.from_model(model=None, ...)` or
    share one per model with `paged_backend.get_engine`. Requests are validated against the
    model in the caller's thread: bad input raises there, before anything is queued."""

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
        self._num_waiting = 0  # the last step's waiting queue, plus requests taken since
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

    # ---- submitting ------------------------------------------------------------------------
    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)  # grammar compile included: slow

    def _submit(self, request: PreparedRequest, request_id: str | None) -> _Stream:
        """Queue a request for the engine thread."""
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
            stream = self._streams[request_id] = _Stream(request_id, request.timeout)
            self._inbox.append(("add", request_id, request))
        self._wakeup.set()
        return stream

    def _outputs(self, stream: _Stream) -> Generator[RequestOutput, None, None]:
        while not stream.finished:
            yield stream.get()

    async def _aoutputs(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        while not stream.finished:
            yield await stream.get_async()

    def _end(self, stream: _Stream) -> None:
        if not stream.finished:
            self.abort_sync(stream.request_id)

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
                # taken requests stay counted until a step has run with them: counted in
                # neither the inbox nor the last step's queue, a full queue took more (the
                # Ray small-queue test's flake, under load: a step is long)
                self._num_waiting += sum(1 for c in inbox if c[0] == "add")
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
        _, request_id, request = cmd
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted before it was queued
        try:
            self.engine.add_request(
                request.text,
                request.params,
                request_id,
                priority=request.priority,
                prompt_token_ids=request.prompt_token_ids,
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
