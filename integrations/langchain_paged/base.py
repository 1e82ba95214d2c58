"""What `ChatPaged` and `PagedLLM` share: their fields (the model, engine arguments and every
`SamplingParams` field), the lazily started shared engine, and usage/metadata of an output."""

from __future__ import annotations

import dataclasses
from typing import Any

from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages.ai import UsageMetadata
from pydantic import BaseModel, Field, PrivateAttr, SecretStr, model_validator

from paged_backend import CompletionOutput, RequestOutput, SamplingParams
from paged_backend.adapters import (
    EngineHandle,
    Submitter,
    TokenCounts,
    build_sampling_params,
    check_engine_args,
    check_max_retries,
    merge_stop,
    model_tokenizer,
    pop_request_options,
    ranked_logprobs,
    ranked_prompt_logprobs,
    sampling_values,
)
from paged_backend.engine_client import EngineClient
from paged_backend.outputs import Logprob

PROVIDER = "paged"


class PagedParams(BaseModel):
    """Mixed into both LangChain classes. Sampling fields left at None take `SamplingParams`'
    defaults; any other keyword argument is an engine argument (dtype, num_kv_blocks, ...;
    backend="ray" with num_replicas, routing, ray_actor_options for replicas on Ray)."""

    model: str | None = None
    """Hugging Face model directory or `.gguf` file; None is the embedded SmolLM2-135M."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Engine arguments; adapters with the same model and arguments share one engine."""
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = 512
    """New tokens at most; None runs to EOS or the context window (`SamplingParams`' own
    default, 16, is too short for an answer)."""
    min_tokens: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """Each prompt token's logprob, with that many of the most likely tokens there, in the
    response metadata's `prompt_logprobs` (None for the first token)."""
    skip_special_tokens: bool | None = None
    logit_bias: dict[int, float] | None = None
    cache_salt: str | None = None
    """Tenant isolation: only requests with the same salt share prefix-cache blocks (per call
    too: `.bind(cache_salt=...)` or `invoke(..., cache_salt=...)`)."""
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    timeout: float | None = None
    """Seconds a request may take in all; it is then aborted and `TimeoutError` raised."""
    max_retries: int = 2
    """Resubmissions, with backoff, of a request refused with `EngineOverloadedError`."""
    api_key: SecretStr | None = Field(default=None, exclude=True)
    """Accepted for drop-in use with code written for hosted models, and ignored: the engine
    runs in this process and needs no key."""

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _collect_engine_args(cls, values: Any) -> Any:
        """`ChatPaged(dtype="float32")` is `ChatPaged(engine_args={"dtype": "float32"})`."""
        if not isinstance(values, dict):
            return values
        extra = {k: v for k, v in values.items() if k not in cls.model_fields}
        if not extra:
            return values
        rest = {k: v for k, v in values.items() if k in cls.model_fields}
        return {**rest, "engine_args": {**(rest.get("engine_args") or {}), **extra}}

    @model_validator(mode="after")
    def _check(self) -> PagedParams:
        """Bad sampling values and unknown engine arguments fail here, before any work."""
        check_engine_args(self.engine_args)
        check_max_retries(self.max_retries)
        self._sampling_params(None, {})
        self._handle = EngineHandle(self.model, self.engine_args)
        return self

    @property
    def model_name(self) -> str:
        return self._handle.model_name

    @property
    def engine(self) -> EngineClient:
        """The shared engine (started on first access), e.g. for `engine.stats()`."""
        return self._handle.get()

    def _sampling_params(self, stop: list[str] | None, kwargs: dict) -> SamplingParams:
        # A SamplingParams field not declared above is a call kwarg only (e.g. a per-call schema).
        params = build_sampling_params(self, kwargs, stop)
        if self.max_tokens is None and kwargs.get("max_tokens") is None:
            params = dataclasses.replace(params, max_tokens=None)  # None there means "unset"
        return params

    def _prepare(
        self, stop: list[str] | None, kwargs: dict, *, stream: bool = False
    ) -> tuple[Submitter, SamplingParams]:
        """Validate the call's parameters, then (only then) start or reuse the engine: seconds
        on first use, so async callers run this in a worker thread, off their event loop."""
        options = pop_request_options(self, kwargs)
        params = self._sampling_params(stop, kwargs)
        if stream and params.n != 1:
            raise ValueError(f"n must be 1 when streaming, got {params.n}")
        return Submitter(self._handle.get(), **options), params

    @property
    def _identifying_params(self) -> dict[str, Any]:
        sampling = {k: v for k, v in sampling_values(self).items() if v is not None}
        return {"model": self.model, **sampling, "engine_args": self.engine_args}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs.get("model") or self.model_name
        stops = merge_stop(self.stop, stop)
        if stops:
            params["ls_stop"] = stops
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (the engine need not be running)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        tokenizer = model_tokenizer(self.model, self.engine_args.get("revision"))
        return tokenizer.encode(text, add_special_tokens=False)


def usage_metadata(
    out: RequestOutput, completions: list[CompletionOutput] | None = None
) -> UsageMetadata:
    """Token counts of a request (or of some of its `n` completions); `cache_read` is the
    prompt tokens served from the prefix cache."""
    counts = TokenCounts.of(out, completions)
    return UsageMetadata(
        input_tokens=counts.prompt,
        output_tokens=counts.generated,
        total_tokens=counts.total,
        input_token_details={"cache_read": counts.cached},
    )


def completion_metadata(
    completion: CompletionOutput, model_name: str, out: RequestOutput | None = None
) -> dict[str, Any]:
    """`finish_reason` ("stop", "length", "abort"), the matched stop and, when asked for,
    per-token logprobs (a list per position of the sampled and top tokens, best first) and the
    prompt's (`out`'s, the same lists, None for the first token)."""
    meta: dict[str, Any] = {
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "model_name": model_name,
    }
    positions = ranked_logprobs(completion)
    if positions is not None:
        meta["logprobs"] = [_candidates(c) for c in positions]
    if out is not None and out.prompt_logprobs is not None:
        meta["prompt_logprobs"] = [
            None if c is None else _candidates(c) for c in ranked_prompt_logprobs(out)
        ]
    return meta


def _candidates(candidates: list[tuple[int, Logprob]]) -> list[dict[str, Any]]:
    return [
        {"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}
        for t, lp in candidates
    ]
