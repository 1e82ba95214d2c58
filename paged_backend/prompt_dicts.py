"""vLLM's prompt dicts, taken wherever a prompt is: `{"prompt": text}` (vLLM's `TextPrompt`) and
`{"prompt_token_ids": ids}` (`TokensPrompt`, whose optional "prompt" is the text outputs report,
not tokenized), each with an optional "cache_salt" (the request's `SamplingParams.cache_salt`).
Code written against vLLM's `LLM.generate` and `AsyncLLM.generate` passes them as they are."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from paged_backend.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# vLLM's keys for images, audio and the like: refused where they hold data (text models only)
MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def prompt_source(prompt: object) -> tuple[object, str | None, str | None]:
    """(what to tokenize: the text, or the token ids as given; the text outputs report; the
    dict's cache salt). A prompt that is not a dict is its own source and text (where a str)."""
    if not isinstance(prompt, Mapping):
        return prompt, prompt if isinstance(prompt, str) else None, None
    unknown = sorted(set(prompt) - {*PROMPT_KEYS, *MULTIMODAL_KEYS}, key=str)
    if unknown:
        raise ValueError(f"a prompt dict takes the keys {', '.join(PROMPT_KEYS)}; got {unknown}")
    for key in MULTIMODAL_KEYS:
        if prompt.get(key):
            raise ValueError(f"prompt {key!r}: this engine serves text-only models")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"a prompt dict's 'prompt' must be a str, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        source = prompt["prompt_token_ids"]
        if isinstance(source, str) or not isinstance(source, Sequence):
            raise TypeError(
                "a prompt dict's 'prompt_token_ids' must be a list of int token ids, got "
                f"{type(source).__name__}"
            )
    elif text is not None:
        source = text
    else:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
    return source, text, prompt.get("cache_salt")


def salted(params: SamplingParams, salt: str | None) -> SamplingParams:
    """`params` with a prompt dict's cache salt (checked as `SamplingParams` checks its own;
    params of another type are left to the entry's own check)."""
    if salt is None or not isinstance(params, SamplingParams) or salt == params.cache_salt:
        return params
    if params.cache_salt is not None:
        raise ValueError(
            f"the prompt's cache_salt {salt!r} differs from sampling_params.cache_salt "
            f"{params.cache_salt!r}; give one"
        )
    return dataclasses.replace(params, cache_salt=salt)
