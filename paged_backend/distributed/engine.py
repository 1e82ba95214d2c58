"""`RayEngine`: `AsyncEngine`'s interface over N replicas, each an `AsyncEngine` in a Ray actor.

Ray does placement, the actor processes, restarts and streaming (each request is a Ray
streaming generator on its replica's async actor). This process keeps only what Ray does not
know: the tokenizer (to hash prompts for routing), the router, and which replica each request
runs on, so that a close, cancel or `abort` reaches it and a replica's death fails only its own
requests.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

from paged_backend import metrics
from paged_backend.chat_template import apply_chat_template
from paged_backend.config import EngineConfig
from paged_backend.distributed.replica import Replica
from paged_backend.distributed.router import NoReplicaError, Router, check_routing
from paged_backend.engine_client import EngineClient, PreparedRequest
from paged_backend.errors import (
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    RequestFailedError,
)
from paged_backend.model_loader import model_name, resolve_model_path
from paged_backend.outputs import RequestOutput
from paged_backend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# Ray restarts a crashed replica process itself (up to 3 times); a replica that is gone for
# good (killed, restarts used up) is replaced by a new actor, up to this many times in a row.
_MAX_REPLACEMENTS = 3
_ACTOR_OPTIONS = {"max_restarts": 3, "max_task_retries": 0, "max_concurrency": 10_000}
_QUEUE_ARG = "max_waiting_requests"  # AsyncEngine's own; every other engine argument is config
_COMBINE = {"max_batch_size": max}  # every other numeric stat is a sum over replicas
# Rates are not summed but recomputed from the summed counts: rate -> (numerator, denominator).
_RATES = {
    "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries"),
    "spec_acceptance_rate": ("spec_num_accepted_tokens", "spec_num_draft_tokens"),
}
_EXPORT_INTERVAL = 1.0  # seconds between gauge refreshes while requests run, as locally


@dataclass(eq=False)
class _Call:
    """One request: what its replica is sent, where it runs now, and how far it got."""

    request_id: str
    request: PreparedRequest  # its token ids are for routing
    replica: int = -1  # -1: not placed (or released)
    stream: ray.ObjectRefGenerator | None = None
    tried: set[int] = field(default_factory=set)
    refused: EngineOverloadedError | None = None  # the last replica's refusal: not admitted
    streamed: bool = False  # an output reached the caller: it can no longer move
    finished: bool = False
    ended: bool = False
    prompt_logprobs: list | None = None  # from its first output that had them


class RayEngine(EngineClient[_Call]):
    """Drop-in for `AsyncEngine` (`generate`, `generate_stream`, `abort`, `stats`,
    `shutdown`, tokenizer helpers) on `num_replicas` Ray actors. Create it with
    `paged_backend.get_engine(model, backend="ray", num_replicas=N, ...)`; `routing` is
    "prefix_affinity" (default), "least_loaded" or "round_robin" (see `router`), and
    `ray_actor_options` go to each actor (e.g. `{"num_gpus": 1}` or `{"num_cpus": 4}`)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        num_replicas: int = 2,
        routing: str = "prefix_affinity",
        ray_actor_options: dict | None = None,
        **engine_args,
    ) -> None:
        check_routing(routing, num_replicas)
        # Bad engine arguments raise here as they do locally, before any actor starts.
        EngineConfig(model=model, **{k: v for k, v in engine_args.items() if k != _QUEUE_ARG})
        if not ray.is_initialized():
            ray.init()  # the cluster RAY_ADDRESS or `ray start` runs, else a local one
        self.model_name = model_name(model)
        path = resolve_model_path(model, engine_args.get("revision"))
        self.tokenizer = Tokenizer(path, engine_args.get("chat_template"))
        self._tokenizer_lock = threading.Lock()
        self._model, self._engine_args = model, engine_args
        self._actor_class = ray.remote(Replica)
        self._actor_options = {**_ACTOR_OPTIONS, **(ray_actor_options or {})}
        self._name = f"paged-backend-{uuid.uuid4().hex[:8]}"
        self.engine_id = metrics.new_engine_id()
        self._generation = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._stopped = threading.Event()  # set by shutdown, for the gauge refresher
        self._calls: dict[str, _Call] = {}
        self._ids = itertools.count()
        self._actors = [self._new_actor(i) for i in range(num_replicas)]
        infos = self._start()
        block_sizes = {info["block_size"] for info in infos}
        if len(block_sizes) > 1:
            self.shutdown()
            raise EngineError(f"replicas resolved different block sizes {block_sizes}: pass one")
        self.max_model_len = min(info["max_model_len"] for info in infos)
        self._router = Router(
            num_replicas,
            block_sizes.pop(),
            routing,
            index_capacity=sum(info["kv_blocks_total"] for info in infos),
        )
        if metrics.ENABLED:
            threading.Thread(
                target=_refresh_gauges,
                args=(weakref.ref(self), self._stopped),
                name="paged-backend-ray-metrics",
                daemon=True,
            ).start()

    def _new_actor(self, slot: int):
        name = f"{self._name}-{slot}-{next(self._generation)}"
        options = {**self._actor_options, "name": name}
        return self._actor_class.options(**options).remote(self._model, self._engine_args)

    def _start(self) -> list[dict]:
        """Wait for every replica's model to load; a replica that cannot start stops them all."""
        try:
            return ray.get([actor.info.remote() for actor in self._actors])
        except RayError as exc:
            self.shutdown()
            raise EngineError(f"a replica failed to start: {exc}") from None

    # ---- helpers for adapters (tokenizer local, as the replicas' own) -------------------------
    @property
    def replicas(self) -> list:
        """The replicas' actor handles, in routing order (e.g. for `ray.kill` in a drill)."""
        return list(self._actors)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        with self._tokenizer_lock:
            return apply_chat_template(self.tokenizer, messages, **kwargs)

    # ---- submitting ------------------------------------------------------------------------
    def _submit(self, request: PreparedRequest, request_id: str | None) -> _Call:
        """Route and send a request. The replica validates it against the model: a bad request
        raises at the first output, as `EngineOverloadedError` does once every live replica
        refused it."""
        with self._lock:
            if request_id is None:
                request_id = f"ray-req-{next(self._ids)}"
            request_id = str(request_id)
            if request_id in self._calls:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            call = _Call(request_id, request)
            self._calls[request_id] = call
        try:
            self._dispatch(call)
        except NoReplicaError as exc:
            self._end(call)
            raise RequestFailedError(f"request {request_id!r}: {exc}") from None
        except BaseException:
            self._end(call)
            raise
        return call

    def _dispatch(self, call: _Call) -> None:
        with self._lock:
            if self._closed:
                raise EngineShutdownError("the engine has been shut down; create a new one")
            request = call.request
            call.replica = self._router.route(
                request.prompt_token_ids, request.params, exclude=call.tried
            )
            call.tried.add(call.replica)
            actor = self._actors[call.replica]
        call.stream = actor.generate.options(num_returns="streaming").remote(
            request.prompt,
            request.params,
            call.request_id,
            request.priority,
            request.add_special_tokens,
            request.timeout,
        )

    def _outputs(self, call: _Call) -> Generator[RequestOutput, None, None]:
        while True:
            try:
                for ref in call.stream:
                    yield self._received(call, ray.get(ref))
                return
            except RayError as exc:
                self._fail_over(call, exc)

    async def _aoutputs(self, call: _Call) -> AsyncIterator[RequestOutput]:
        while True:
            try:
                async for ref in call.stream:
                    yield self._received(call, await ref)
                return
            except RayError as exc:
                self._fail_over(call, exc)

    def _received(self, call: _Call, out: RequestOutput) -> RequestOutput:
        call.streamed = True
        call.finished = out.finished
        if out.prompt_logprobs is not None:  # a replica sends them once (`prompt_logprobs_once`)
            call.prompt_logprobs = out.prompt_logprobs
        elif call.prompt_logprobs is not None:
            out = replace(out, prompt_logprobs=call.prompt_logprobs)
        return out

    def _fail_over(self, call: _Call, exc: RayError) -> None:
        """After a Ray error: raise what the caller should see, or send the request to another
        replica when its own died or refused it as overloaded before anything was streamed.
        A refusal reaches the caller (`EngineOverloadedError`, as locally) only when no live
        replica is left to try."""
        if isinstance(exc, RayTaskError):  # the replica's engine raised
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if not isinstance(cause, EngineOverloadedError) or call.streamed:
                raise cause from None
            call.refused = cause
        if self._closed:
            raise EngineShutdownError("the engine was shut down while the request ran") from None
        failed = call.replica
        if isinstance(exc, RayActorError):
            self._replica_down(failed, exc)
        with self._lock:
            self._router.done(failed)
            call.replica = -1
        if call.streamed:
            raise RequestFailedError(
                f"replica {failed} failed while request {call.request_id!r} ran: {exc}"
            ) from None
        try:
            self._dispatch(call)
        except NoReplicaError:
            if call.refused is not None:
                raise EngineOverloadedError(
                    f"every live replica refused request {call.request_id!r}; the last one: "
                    f"{call.refused}"
                ) from None
            raise RequestFailedError(
                f"replica {failed} failed before request {call.request_id!r} started, and no "
                f"other replica is available: {exc}"
            ) from None

    def _end(self, call: _Call) -> None:
        """The caller is done with a request: free its place, stop it if it still runs."""
        with self._lock:
            if call.ended:
                return
            call.ended = True
            self._calls.pop(call.request_id, None)
            if call.replica >= 0:
                self._router.done(call.replica)
        if not (call.finished or call.stream is None or self._closed):
            ray.cancel(call.stream)  # closes the replica's generator, which aborts the request

    def abort_sync(self, request_id: str) -> None:
        """Abort a request on its replica; its stream ends (finish_reason "abort") within a
        step. Unknown or finished ids are ignored."""
        with self._lock:
            call = self._calls.get(str(request_id))
            actor = self._actors[call.replica] if call and call.replica >= 0 else None
        if actor is not None:
            actor.abort.remote(call.request_id)

    # ---- replicas failing and coming back --------------------------------------------------
    def _replica_down(self, slot: int, exc: BaseException) -> None:
        with self._lock:
            if self._closed or not self._router.up[slot]:
                return  # shutting down, or already being brought back
            self._router.mark_down(slot)
        logger.warning("replica %d failed (%s); routing around it until it is back", slot, exc)
        threading.Thread(
            target=self._recover, args=(slot,), name=f"paged-backend-recover-{slot}", daemon=True
        ).start()

    def _recover(self, slot: int) -> None:
        """Wait for Ray's restart of the replica, or replace it when it is gone for good."""
        replacements = 0
        while not self._closed:
            try:
                ray.get(self._actors[slot].info.remote())
            except ActorUnavailableError:  # restarting: ask again
                time.sleep(0.5)
                continue
            except RayActorError as exc:
                with self._lock:
                    if self._closed:
                        return
                    if replacements == _MAX_REPLACEMENTS:
                        logger.error("replica %d could not be brought back: %s", slot, exc)
                        return
                    replacements += 1
                    self._actors[slot] = self._new_actor(slot)
                continue
            with self._lock:
                if not self._closed:
                    self._router.mark_up(slot)
            logger.warning("replica %d is back", slot)
            return

    # ---- lifecycle and introspection -------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Kill the replicas (requests in flight end with `EngineShutdownError`) and wait up to
        `timeout` seconds for Ray to report them dead, so their resources are free again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            actors = list(self._actors)
        self._stopped.set()
        if not ray.is_initialized():
            return  # Ray was shut down first, and its actors with it
        for actor in actors:
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout
        for actor in actors:
            try:
                ray.get(actor.info.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except RayError:
                continue  # dead, as it should be (or the wait is over)

    def stats(self) -> dict:
        """The replicas' numeric stats summed (`max_batch_size`: the largest), the rates (prefix
        cache hits, accepted drafts) recomputed from the sums, `replicas` (each one's own, with
        `alive`) and `routing` (how many requests each rule placed). With prometheus-client the
        totals are exported with `replica=""` and each replica's with its index (see
        `metrics`)."""
        with self._lock:
            actors, up = list(self._actors), list(self._router.up)
            decisions = dict(self._router.decisions)
        refs = [actor.stats.remote() if ok else None for actor, ok in zip(actors, up, strict=True)]
        replicas = []
        for slot, ref in enumerate(refs):
            stats = None
            if ref is not None:
                try:
                    stats = ray.get(ref, timeout=30)
                except RayError as exc:
                    if isinstance(exc, RayActorError):
                        self._replica_down(slot, exc)
            replicas.append({"replica": slot, "alive": stats is not None, **(stats or {})})
        merged = _merge([r for r in replicas if r["alive"]])
        metrics.export(merged, self.model_name, self.engine_id)
        for stats in replicas:
            own = {k: v for k, v in stats.items() if k != "replica"}
            metrics.export(own, self.model_name, self.engine_id, replica=str(stats["replica"]))
        merged.update(engine_id=self.engine_id, replicas=replicas, routing=decisions)
        return merged


def _refresh_gauges(ref: weakref.ref[RayEngine], stopped: threading.Event) -> None:
    """Refresh the engine's gauges every second while it has requests in flight, as a local
    engine's step loop does, and once more when they are done, so that idle replicas do not
    keep showing their last busy figures. The engine is held weakly: dropping it still drops
    its actors' handles."""
    busy = False
    while not stopped.wait(_EXPORT_INTERVAL):
        engine = ref()
        if engine is None or not ray.is_initialized():
            return
        was_busy, busy = busy, bool(engine._calls)
        if busy or was_busy:
            engine.stats()
        engine = None  # not held while waiting


def _merge(replicas: list[dict]) -> dict:
    """The replicas' numeric stats combined (`_COMBINE`; a sum by default), the rates
    recomputed from the combined counts, as one engine reports them."""
    merged: dict = {}
    for stats in replicas:
        for key, value in stats.items():
            if key in ("replica", "alive") or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                combine = _COMBINE.get(key, operator.add)
                merged[key] = combine(merged[key], value) if key in merged else value
    for rate, (numerator, denominator) in _RATES.items():
        total = merged.get(denominator, 0)
        merged[rate] = merged.get(numerator, 0) / total if total else 0.0
    steps = merged.get("spec_num_drafting_steps", 0)
    merged["spec_mean_acceptance_length"] = (
        1 + merged.get("spec_num_accepted_tokens", 0) / steps if steps else 0.0
    )
    return merged
