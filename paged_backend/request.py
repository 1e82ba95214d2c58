"""A request as the scheduler sees it: tokens, progress through the KV cache, stop state."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import torch

from paged_backend.block_pool import BlockHash, hash_block_tokens
from paged_backend.outputs import Logprob
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.completion import BudgetGuard
    from paged_backend.grammar_matcher import GrammarMatcher

_arrivals = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence. A user request with `n > 1` becomes `n` of these sharing `parent_id`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        parent_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        seed: int | None = None,
        max_tokens: int | None = None,
        detokenizer=None,
        grammar: GrammarMatcher | None = None,
        budget_guard: BudgetGuard | None = None,
        long_rope: bool = False,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> None:
        """`long_rope`: the sequence runs LongRoPE's long factors from its first token
        (`ModelConfig.long_rope`). `bad_words_token_ids`: the tokens of `params.bad_words`
        (`LLMEngine.bad_words_token_ids`)."""
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.arrival = next(_arrivals)
        self.status = RequestStatus.WAITING
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.block_hashes: list[BlockHash] = []
        self.num_hashed_blocks = 0  # how many of this request's blocks are registered in the cache
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # `params.prompt_logprobs`: token t's at t (none for the first), filled as the prefill's
        # rows give them; the first of `n` sequences alone computes them, for their parent.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.detokenizer = detokenizer
        self.bad_words_token_ids = bad_words_token_ids or []
        self.num_emitted_tokens = 0  # output tokens already reported in a RequestOutput
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)
        # Structured output: masks this sequence's logits; advanced by each appended token. The
        # guard keeps a completion within the tokens left (`completion`).
        self.grammar = grammar
        self.budget_guard = budget_guard
        self.long_rope = long_rope

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_logprob_row(self) -> int | None:
        """The first row whose logits give a prompt logprob not taken yet (row t's predict
        token t + 1); None when none is missing."""
        taken = self.prompt_logprobs
        if taken is None or len(taken) >= self.num_prompt_tokens:
            return None
        return len(taken) - 1

    @property
    def num_tokens_left(self) -> int:
        """New tokens this request may still produce."""
        return self.max_tokens - len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self, policy: str) -> tuple[int, ...]:
        """Smaller is more urgent. The scheduler's queues and preemption use only this."""
        return (self.priority, self.arrival) if policy == "priority" else (self.arrival,)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block: hash(i) = H(hash(i-1), tokens of block i), with
        the cache salt in the first block's, so that it separates every later one too; so does
        LongRoPE's long mode, whose keys differ from those of the same tokens in short mode."""
        tokens = self.all_token_ids
        salt = self.params.cache_salt
        first = (("cache_salt", salt),) if salt is not None else ()
        first += (("rope", "long"),) if self.long_rope else ()
        for i in range(len(self.block_hashes), len(tokens) // block_size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = first if i == 0 else ()
            block = tokens[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hash_block_tokens(parent, block, extra))
        return self.block_hashes
