"""`EngineClient` alone, on a scripted engine (no model): the checks every engine runs before
a request is sent, and the stream shapes that end an unfinished request however the caller
leaves (the local and the Ray engine's own tests run the same paths on real engines)."""

from __future__ import annotations

import asyncio
import gc
import threading
from contextlib import aclosing
from dataclasses import dataclass

import pytest

from paged_backend import AsyncEngine, RequestOutput, SamplingParams
from paged_backend.engine_client import EngineClient, PreparedRequest, RequestStream


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@dataclass
class _Handle:
    request_id: str
    request: PreparedRequest
    ended: int = 0
    read: int = 0


class _ScriptedEngine(EngineClient[_Handle]):
    """Each request streams `STEPS` outputs, the last one finished; reading output number
    `fail_at` raises instead, and awaiting number `stall_at` never returns."""

    STEPS = 3

    def __init__(self, fail_at: int = 0, stall_at: int = 0) -> None:
        self.tokenizer, self.model_name, self.max_model_len = _Tokenizer(), "scripted", 64
        self._tokenizer_lock, self._closed = threading.Lock(), False
        self.fail_at, self.stall_at = fail_at, stall_at
        self.submitted: list[_Handle] = []
        self.aborted: list[str] = []
        self.on_loop: list[bool] = []

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return "".join(m["content"] for m in messages)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)

    def _submit(self, request: PreparedRequest, request_id: str | None) -> _Handle:
        handle = _Handle(request_id or f"r{len(self.submitted)}", request)
        self.submitted.append(handle)
        return handle

    def _output(self, handle: _Handle) -> RequestOutput:
        handle.read += 1
        if handle.read == self.fail_at:
            raise RuntimeError("the engine failed")
        finished = handle.read == self.STEPS
        return RequestOutput(handle.request_id, None, handle.request.prompt_token_ids, [], finished)

    def _outputs(self, handle: _Handle):
        while handle.read < self.STEPS:
            yield self._output(handle)

    async def _aoutputs(self, handle: _Handle):
        while handle.read < self.STEPS:
            if handle.read + 1 == self.stall_at:
                await asyncio.Event().wait()
            yield self._output(handle)

    def _end(self, handle: _Handle) -> None:
        handle.ended += 1
        if handle.read < self.STEPS:
            self.abort_sync(handle.request_id)

    def abort_sync(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True

    def stats(self) -> dict:
        return {}


def test_both_engines_are_engine_clients():
    pytest.importorskip("ray")
    from paged_backend.distributed.engine import RayEngine

    assert issubclass(AsyncEngine, EngineClient) and issubclass(RayEngine, EngineClient)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": 0}, ValueError, "timeout"),
        ({"sampling_params": {"temperature": 0}}, TypeError, "sampling_params"),
        ({"priority": "high"}, TypeError, "priority"),
        ({"prompt": b"hi"}, TypeError, "prompt"),
    ],
)
def test_bad_requests_raise_before_anything_is_sent(kwargs, error, match):
    engine = _ScriptedEngine()
    args = {"prompt": "hi", **kwargs}
    with pytest.raises(error, match=match):
        engine.generate_stream(**args)
    with pytest.raises(error, match=match):
        asyncio.run(anext(engine.generate(**args)))
    assert engine.submitted == []


def test_a_prepared_request_carries_what_the_caller_gave():
    engine = _ScriptedEngine()
    list(engine.generate_stream("ab", None, "mine", priority=3, add_special_tokens=False))
    (handle,) = engine.submitted
    assert handle.request_id == "mine"
    assert handle.request == PreparedRequest("ab", [97, 98], SamplingParams(), 3, False, None)
    assert handle.request.text == "ab"
    list(engine.generate_stream([5, 6]))
    assert engine.submitted[1].request.text is None


def test_a_thread_stream_read_to_its_end_is_not_aborted():
    engine = _ScriptedEngine()
    with engine.generate_stream("hi") as stream:
        assert isinstance(stream, RequestStream) and stream.request_id == "r0"
        assert [out.finished for out in stream] == [False, False, True]
    assert engine.aborted == [] and engine.submitted[0].ended == 1


@pytest.mark.parametrize("how", ["close", "with", "drop", "error"])
def test_leaving_a_thread_stream_early_aborts_it_once(how):
    engine = _ScriptedEngine(fail_at=2)
    stream = engine.generate_stream("hi")
    next(stream)
    if how == "close":
        stream.close()
        stream.close()
    elif how == "with":
        with stream:
            pass
    elif how == "drop":
        del stream
        gc.collect()
    else:
        with pytest.raises(RuntimeError, match="the engine failed"):
            next(stream)
    assert engine.aborted == ["r0"] and engine.submitted[0].ended == 1


async def test_generate_prepares_off_the_loop_and_ends_each_request_once():
    engine = _ScriptedEngine()
    outs = [out async for out in engine.generate("hi")]
    assert [out.finished for out in outs] == [False, False, True]
    assert engine.on_loop == [False] and engine.aborted == []

    async with aclosing(engine.generate("hi", request_id="early")) as outputs:
        async for _ in outputs:
            break
    assert engine.aborted == ["early"]

    assert [h.ended for h in engine.submitted] == [1, 1]


async def test_cancelling_the_reading_task_aborts_the_request():
    engine = _ScriptedEngine(stall_at=2)
    seen = []

    async def read():
        async for out in engine.generate("hi"):
            seen.append(out)

    task = asyncio.create_task(read())
    while not seen:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted == ["r0"] and engine.submitted[0].ended == 1
