"""One engine per model and engine arguments in the process, shared by every adapter, so
weights and the prefix cache exist once. Reference-counted: the last `release` shuts it down.
`backend="local"` (default) is an `AsyncEngine` in this process; `backend="ray"` a `RayEngine`
whose replicas run in Ray actors (the `ray` extra)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from paged_backend.async_engine import AsyncEngine
from paged_backend.model_loader import resolve_model_path

if TYPE_CHECKING:
    from paged_backend.distributed import RayEngine

BACKENDS = ("local", "ray")
# Engine arguments that only `backend="ray"` takes.
RAY_ARGS = ("num_replicas", "routing", "ray_actor_options")

_lock = threading.RLock()  # reentrant: a GC finalizer may release inside get_engine
_engines: dict[tuple, AsyncEngine | RayEngine] = {}
_users: dict[int, int] = {}
# Engines being created, by key: creation runs outside `_lock` (a model load takes seconds and
# must not hold up `get_engine` for other models); callers for the same key wait on its future.
_creating: dict[tuple, Future] = {}


def _key(model: str | None, engine_args: dict) -> tuple:
    revision = engine_args.get("revision")
    path = str(resolve_model_path(model, revision)) if model is not None else None
    return (path, tuple(sorted((k, repr(v)) for k, v in engine_args.items())))


def _create(model: str | None, backend: str, engine_args: dict) -> AsyncEngine | RayEngine:
    if backend == "local":
        return AsyncEngine.from_model(model, **engine_args)
    try:
        from paged_backend.distributed.engine import RayEngine
    except ImportError as exc:
        raise ImportError(
            f"backend='ray' needs Ray: pip install 'paged-backend[ray]' ({exc})"
        ) from exc
    return RayEngine(model, **engine_args)


def get_engine(
    model: str | None = None, *, backend: str = "local", **engine_args
) -> AsyncEngine | RayEngine:
    """The process-wide engine for `model` and these arguments, created on first use. Each call
    takes a reference; hand it back with `release_engine`. With `backend="ray"`, also
    `num_replicas`, `routing` and `ray_actor_options` (see `RayEngine`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    ray_only = sorted(set(RAY_ARGS) & set(engine_args))
    if backend == "local" and ray_only:
        raise ValueError(f"{', '.join(ray_only)} need backend='ray'")
    key_args = engine_args if backend == "local" else {**engine_args, "backend": backend}
    key = _key(model, key_args)
    while True:
        with _lock:
            engine = _engines.get(key)
            if engine is not None and not engine.is_closed:
                _users[id(engine)] += 1
                return engine
            pending = _creating.get(key)
            if pending is None:
                pending = _creating[key] = Future()
                break
        pending.result()  # created (or failed): take a reference above, unless it is gone
    return _create_shared(key, pending, model, backend, engine_args)


def _create_shared(
    key: tuple, pending: Future, model: str | None, backend: str, engine_args: dict
) -> AsyncEngine | RayEngine:
    """Create the engine for `key` (no lock held) and hand it to anyone waiting for it."""
    try:
        engine = _create(model, backend, engine_args)
    except BaseException as exc:
        with _lock:
            del _creating[key]
        if isinstance(exc, Exception):
            pending.set_exception(exc)  # waiters see the same error
        else:
            pending.set_result(None)  # this thread was interrupted: a waiter tries again
        raise
    with _lock:
        del _creating[key]
        _engines[key] = engine
        _users[id(engine)] = 1
    pending.set_result(engine)
    return engine


def release_engine(engine: AsyncEngine | RayEngine) -> None:
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
