"""`SamplingParams`: vLLM's names and meanings, validated at construction."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field

from paged_backend.structured_output import StructuredOutputsParams

MAX_INT = 2**63  # no int field needs more (seeds are 64-bit in torch)
# Sizes no real request reaches. Stop strings and stop token ids are matched on the engine
# thread for every new token, so one request with thousands of them stalls every tenant.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 4096  # enough to ban or favour a whole class of tokens
LOGIT_BIAS_RANGE = 100  # values in [-100, 100], as in OpenAI's API
MAX_CACHE_SALT_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 16384  # a step masks every logit but these for each request that asks
MAX_BAD_WORDS = 128  # checked against each request's output at every step, as stop strings are
_short = reprlib.Repr()  # for error messages: a value may be a list of 10^6 items
_short.maxstring = _short.maxother = 60


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or float (not a bool), finite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {_short.repr(value)}")


def _check_size(name: str, size: int, limit: int, unit: str) -> None:
    if size > limit:
        raise ValueError(f"{name} must have at most {limit} {unit}, got {size}")


def _checked_strings(
    name: str, values, limit: int, unit: str, allowed: str = "a list of strings"
) -> list[str] | None:
    """`values` as a list of at most `limit` strings of 1 to `MAX_STOP_STRING_CHARS` characters
    (None stays None)."""
    _check(values is None or isinstance(values, list | tuple), name, allowed, values)
    _check_size(name, len(values or ()), limit, unit)
    for value in values or ():
        _check(
            isinstance(value, str) and 0 < len(value) <= MAX_STOP_STRING_CHARS,
            name,
            f"strings of 1 to {MAX_STOP_STRING_CHARS} characters",
            value,
        )
    return None if values is None else list(values)


def _checked_token_ids(
    name: str, ids, limit: int, allowed_type: str, allowed_ids: str
) -> list[int] | None:
    """`ids` as a list of at most `limit` token ids >= 0 (None stays None)."""
    _check(ids is None or isinstance(ids, list | tuple), name, allowed_type, ids)
    _check_size(name, len(ids or ()), limit, "token ids")
    _check(all(_is_int(t) and t >= 0 for t in ids or ()), name, allowed_ids, ids)
    return None if ids is None else list(ids)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """Each prompt token's logprob after the tokens before it, with that many more of the most
    likely tokens there (vLLM's name): `RequestOutput.prompt_logprobs`, None for the first token.
    The prefill computes every prompt position for them, whatever the prefix cache holds."""
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None
    """Tenant isolation (vLLM's name): requests share prefix-cache blocks only with requests of
    the same salt (or, without one, with other unsalted requests)."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated (vLLM's name): every other logit is -inf."""
    bad_words: list[str] | None = None
    """Words never generated (vLLM's name): a word's last token is banned wherever the tokens
    before it end the output so far (a one-token word's, everywhere). A word counts as the
    tokenizer reads it alone and after a space."""
    truncate_prompt_tokens: int | None = None
    """Serve only the prompt's last k tokens (vLLM's name); -1: as many as `max_model_len`
    leaves after `max_tokens`."""
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Every field is checked for its type before its range, so a value of any type gets
        a ValueError naming the field and what it allows, never an error from inside."""
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        self._real("temperature", "finite and >= 0 (0 means greedy)", lambda v: v >= 0)
        self._real("top_p", "in (0, 1]", lambda v: 0 < v <= 1)
        _check(
            _is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "-1, 0 (no limit) or a positive integer",
            self.top_k,
        )
        self._real("min_p", "in [0, 1]", lambda v: 0 <= v <= 1)
        self._real("presence_penalty", "in [-2, 2]", lambda v: -2 <= v <= 2)
        self._real("frequency_penalty", "in [-2, 2]", lambda v: -2 <= v <= 2)
        self._real("repetition_penalty", "finite and > 0", lambda v: v > 0)
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "None or an integer >= 1",
            self.max_tokens,
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or MAX_INT),
            "min_tokens",
            "an integer >= 0 and <= max_tokens",
            self.min_tokens,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= 20),
                name,
                "None or an integer in [0, 20]",
                value,
            )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            "None or an integer in [0, 2**63)",
            self.seed,
        )
        self._check_stops()
        self._check_stop_token_ids()
        self._check_logit_bias()
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "None or a StructuredOutputsParams",
            self.structured_outputs,
        )
        salt = self.cache_salt
        _check(
            salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS),
            "cache_salt",
            f"None or a string of 1 to {MAX_CACHE_SALT_CHARS} characters",
            salt,
        )
        self._check_allowed_token_ids()
        self.bad_words = _checked_strings("bad_words", self.bad_words, MAX_BAD_WORDS, "words")
        truncate = self.truncate_prompt_tokens
        _check(
            truncate is None or (_is_int(truncate) and (truncate >= 1 or truncate == -1)),
            "truncate_prompt_tokens",
            "None, -1 (what max_model_len leaves after max_tokens) or an integer >= 1",
            truncate,
        )
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, "True or False", value)

    def _check_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        allowed = "a string or a list of strings"
        checked = _checked_strings("stop", stops, MAX_STOP_STRINGS, "strings", allowed)
        self.stop_strings = checked or []

    def _check_allowed_token_ids(self) -> None:
        ids, allowed = self.allowed_token_ids, "None or a non-empty list of token ids >= 0"
        ids = _checked_token_ids("allowed_token_ids", ids, MAX_ALLOWED_TOKEN_IDS, allowed, allowed)
        _check(ids is None or bool(ids), "allowed_token_ids", allowed, ids)
        self.allowed_token_ids = ids

    def _check_stop_token_ids(self) -> None:
        ids, listed = self.stop_token_ids, "a list of non-negative token ids"
        ids = _checked_token_ids("stop_token_ids", ids, MAX_STOP_TOKEN_IDS, "a list", listed)
        self.stop_token_ids = ids or []

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, dict), "logit_bias", "a dict", bias)
        _check_size("logit_bias", len(bias or {}), MAX_LOGIT_BIAS_ENTRIES, "entries")
        limit = LOGIT_BIAS_RANGE
        for token, value in (bias or {}).items():
            _check(_is_int(token) and token >= 0, "logit_bias", "keyed by token ids >= 0", token)
            _check(
                _is_real(value) and -limit <= value <= limit,
                "logit_bias",
                f"values in [-{limit}, {limit}]",
                value,
            )

    def _real(self, name: str, allowed: str, ok) -> None:
        value = getattr(self, name)
        _check(_is_real(value) and ok(value), name, allowed, value)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named in the params must exist in the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, f"token ids in [0, {vocab_size})", bad)
