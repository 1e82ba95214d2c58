"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill and decode phases: each request has `num_computed_tokens`, and a step gives
each request some of its uncomputed tokens within `max_num_batched_tokens` and `max_num_seqs`.
Running requests are served first, most urgent first; then waiting ones in queue order. When
blocks run out, the least urgent running request is preempted: its blocks are freed (their
hashes stay, so its re-prefill usually hits the prefix cache) and it goes back to `waiting`.
Urgency is `Request.sort_key`: arrival order (fcfs) or (priority, arrival) (priority).

Head-of-line blocking: a request with more than `long_prefill_token_threshold` tokens to compute
(a long prefill) gets at most that many per step, and long prefills together leave `reserve`
tokens of every step's budget to decodes and short prompts; a long waiting request that finds
no room is passed over, so shorter ones queued behind it still start in this step (vLLM v1's
per-request cap, with the share of long prefills bounded as V0's `max_long_partial_prefills`).

Speculative decoding: a running request with one token left to compute may add drafted tokens
(`NgramProposer`) after it, as one chunk of 1 + drafts rows that the model runs as it runs a
prefill chunk, in steps that start with at most `max_drafting_seqs` running (larger steps are
compute-bound: rows cost nearly their share, and rejected drafts are lost time). Drafts count
against the token budget, stop before `max_tokens` and
`max_model_len`, and are dropped rather than preempting anything when blocks are short. Their
blocks are never hashed (hashes cover known tokens only); `update` gives back those that hold
rejected drafts only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from paged_backend.kv_cache_manager import KVCacheManager
from paged_backend.ngram_proposer import NgramProposer
from paged_backend.request import Request, RequestStatus
from paged_backend.spec_decode import grammar_prefix


@dataclass
class SchedulerOutput:
    num_scheduled: dict[Request, int] = field(default_factory=dict)  # request -> new tokens
    # request -> its drafted tokens, run after its last known token (counted in num_scheduled)
    drafts: dict[Request, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled.values())

    @property
    def prefills(self) -> bool:
        """Whether a request runs prompt tokens: a chunk of more than one that is not drafts."""
        return any(n > 1 and r not in self.drafts for r, n in self.num_scheduled.items())


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str,
        long_prefill_token_threshold: int | None = None,
        proposer: NgramProposer | None = None,
        max_drafting_seqs: int = 0,
    ) -> None:
        """`proposer`: drafts for the requests that may draft (None: no drafting), in steps
        that start with at most `max_drafting_seqs` running requests."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold or 0
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.proposer = proposer
        self.max_drafting_seqs = max_drafting_seqs

    def _key(self, request: Request) -> tuple[int, ...]:
        return request.sort_key(self.policy)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def reserve(self) -> int:
        """Tokens of a step's budget that long prefills leave to other work: a whole short prompt
        (at most the threshold), or less where the threshold is over half the budget; none where
        it caps nothing (off, or at least the budget)."""
        cap = self.long_prefill_token_threshold
        return max(min(cap, self.max_num_batched_tokens - cap), 0)

    def _chunk(self, num_uncomputed: int, budget: int) -> int:
        """How many of a request's uncomputed tokens this step runs, `budget` being left."""
        cap = self.long_prefill_token_threshold
        if cap and num_uncomputed > cap:
            return max(min(cap, budget - self.reserve), 0)
        return min(num_uncomputed, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        drafting = len(self.running) <= self.max_drafting_seqs
        for request in sorted(self.running, key=self._key):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                continue  # a long prefill while others hold the long share: next step
            drafts = self._drafts(request, budget) if drafting else []
            if drafts and self.kv.allocate_slots(request, num_new + len(drafts)):
                out.drafts[request] = drafts
                out.num_scheduled[request] = num_new + len(drafts)
                budget -= num_new + len(drafts)
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = max(self.running, key=self._key)
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.num_scheduled[request] = num_new
                budget -= num_new

        if out.preempted:
            return out  # blocks are short: admitting newcomers would only preempt again
        i = 0  # waiting[:i] are long prefills passed over in this step
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[i]
            computed, num_hit = self.kv.get_computed_blocks(request)
            num_new = self._chunk(request.num_tokens - num_hit, budget)
            if num_new == 0 or self._prefix_pending(request, len(computed)):
                i += 1
                continue
            if not self.kv.allocate_slots(request, num_new, computed):
                # fcfs never preempts for a newcomer; under priority a more urgent arrival may
                # preempt less urgent running requests.
                victim = max(self.running, key=self._key, default=None)
                if (
                    self.policy != "priority"
                    or victim is None
                    or self._key(victim) <= self._key(request)
                ):
                    break
                budget += self._preempt(victim, out)
                continue
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:  # first admission: preemption's re-prefills
                request.num_cached_tokens = num_hit  # would count their own blocks as hits
                self.kv.record_prefix_hits(request, num_hit)
            self.running.append(request)
            out.num_scheduled[request] = num_new
            budget -= num_new
        return out

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Drafted tokens to verify after a request's one uncomputed token, within the step's
        `budget` and leaving room for the model's own token after them (`num_tokens_left` is
        within max_model_len too: `LLMEngine.validate` keeps prompt + max_tokens within it)."""
        if self.proposer is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(budget, request.num_tokens_left) - 1
        return grammar_prefix(request, self.proposer.propose(request.all_token_ids, room))

    def _prefix_pending(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether the block after a waiting request's cache hits is one that a running
        request's prefill computes in a later step. The request then waits for it to become a
        hit instead of computing a private copy: RAG prompts queued behind a first one with the
        same long context (whose prefill runs in chunks) would otherwise each compute the part
        not yet cached, and would no longer share it (a shared prefix is attended once for all
        the sequences that hold the same blocks). Not one that computes its prompt's rows for
        their logprobs: it would not take the hit."""
        hashes = request.block_hashes if self.kv.enable_caching else ()
        if num_hit_blocks >= len(hashes) or request.prompt_logprob_row is not None:
            return False
        wanted = hashes[num_hit_blocks]
        bs = self.kv.block_size
        return any(
            wanted in r.block_hashes[r.num_hashed_blocks : r.num_prompt_tokens // bs]
            for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Free a running request's blocks and requeue it; returns the budget it gave back.
        A request admitted earlier in this step on cache hits of blocks this one was to write
        in this step is requeued with it (it would read K/V that is never written)."""
        self.running.remove(request)
        stale = self.kv.free(request)
        request.num_computed_tokens = 0
        self.add(request)
        self.num_preemptions += 1
        out.preempted.append(request)
        budget = out.num_scheduled.pop(request, 0)
        out.drafts.pop(request, None)
        if stale:
            for other in [r for r in self.running if self.kv.holds_any(r, stale)]:
                budget += self._preempt(other, out)
        return budget

    def update(self, out: SchedulerOutput, num_rejected: dict[Request, int] | None = None) -> None:
        """Advance progress after the model ran the scheduled tokens, of which drafts rejected by
        verification (`num_rejected`) do not count: their slots are overwritten later, and the
        blocks that hold nothing else go back to the pool."""
        for request, num_new in out.num_scheduled.items():
            request.num_computed_tokens += num_new - (num_rejected or {}).get(request, 0)
            if request in out.drafts:
                # Known tokens: the computed ones and the one the model gives in this step.
                self.kv.trim(request, request.num_computed_tokens + 1)

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request wherever it is and free its blocks. Idempotent."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
