"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request. `text` is cumulative; `delta_*` is what is new
    since the previous output of the same request (for streaming)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # matched stop string or stop token id
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # `SamplingParams.prompt_logprobs`: each prompt token's, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
