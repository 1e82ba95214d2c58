"""One `AsyncEngine` per model and engine arguments in the process, shared by every adapter, so
weights and the prefix cache exist once. Reference-counted: the last `release` shuts it down."""

from __future__ import annotations

import threading

from paged_backend.async_engine import AsyncEngine
from paged_backend.model_loader import resolve_model_path

_lock = threading.RLock()  # reentrant: a GC finalizer may release inside get_engine
_engines: dict[tuple, AsyncEngine] = {}
_users: dict[int, int] = {}


def _key(model: str | None, engine_args: dict) -> tuple:
    revision = engine_args.get("revision")
    path = str(resolve_model_path(model, revision)) if model is not None else None
    return (path, tuple(sorted((k, repr(v)) for k, v in engine_args.items())))


def get_engine(model: str | None = None, **engine_args) -> AsyncEngine:
    """The process-wide engine for `model` and these arguments, created on first use. Each call
    takes a reference; hand it back with `release_engine`."""
    key = _key(model, engine_args)
    with _lock:
        engine = _engines.get(key)
        if engine is None or engine.is_closed:
            engine = AsyncEngine.from_model(model, **engine_args)
            _engines[key] = engine
            _users[id(engine)] = 0
        _users[id(engine)] += 1
        return engine


def release_engine(engine: AsyncEngine) -> None:
    """Drop one reference; the engine shuts down when nobody holds it any more."""
    with _lock:
        count = _users.get(id(engine), 0) - 1
        if count > 0:
            _users[id(engine)] = count
            return
        _users.pop(id(engine), None)
        for key, value in list(_engines.items()):
            if value is engine:
                del _engines[key]
    engine.shutdown()
