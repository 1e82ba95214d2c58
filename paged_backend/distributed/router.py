"""Which replica gets a request: pure Python, no Ray, so that the policy is testable alone.

`prefix_affinity` keeps each shared prefix (a RAG context, a system prompt, a conversation so
far) on the replica that already holds its KV blocks, as SGLang's and vllm-router's
`cache_aware` policies do. It hashes the prompt's full blocks exactly as the replicas' prefix
caches do (`Request.update_block_hashes`: same block size, `cache_salt` in the first block) and
keeps an approximate LRU index of which replicas were sent which block hashes. The index does
not see the replicas' own evictions: a stale entry costs one recomputed prefix, never a wrong
answer, since each replica still checks its own cache.

The rule, for a prompt of P tokens whose longest indexed prefix on replica R is M tokens:
- affinity: R when M >= one block and M >= `min_match` (half) of P;
- guard: not R when R has more than `imbalance_abs` (8) requests in flight beyond the least
  loaded replica and more than `imbalance_rel` (1.5x) its count; the least loaded one then
  gets the request (and the prefix, which it caches from then on);
- otherwise the least loaded replica (fewest requests in flight from this engine, ties taken
  in turn).
"""

from __future__ import annotations

import itertools
import struct
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence

from paged_backend.block_pool import BlockHash
from paged_backend.request import Request
from paged_backend.sampling_params import SamplingParams

ROUTING_POLICIES = ("prefix_affinity", "least_loaded", "round_robin")


class NoReplicaError(RuntimeError):
    """Every replica is down or was already tried for this request."""


def check_routing(policy: str, num_replicas: int) -> None:
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")


class Router:
    """Chooses a replica index per request and counts each replica's requests in flight.
    Not thread-safe: the engine calls it under its lock."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "prefix_affinity",
        *,
        min_match: float = 0.5,
        imbalance_abs: int = 8,
        imbalance_rel: float = 1.5,
        index_capacity: int = 65536,
    ) -> None:
        check_routing(policy, num_replicas)
        self.policy, self.block_size = policy, block_size
        self.min_match = min_match
        self.imbalance_abs, self.imbalance_rel = imbalance_abs, imbalance_rel
        self.index_capacity = index_capacity
        self.load = [0] * num_replicas
        self.up = [True] * num_replicas
        self.decisions: Counter[str] = Counter()  # how requests were placed, for stats()
        self._index: OrderedDict[BlockHash, set[int]] = OrderedDict()
        self._turn = itertools.count()

    # ---- choosing --------------------------------------------------------------------------
    def route(
        self, prompt_ids: Sequence[int], params: SamplingParams, exclude: Collection[int] = ()
    ) -> int:
        """The replica for this prompt; counts it as in flight there until `done`."""
        candidates = [i for i, up in enumerate(self.up) if up and i not in exclude]
        if not candidates:
            raise NoReplicaError("no replica is available (all are down or were tried)")
        hashes = self.block_hashes(prompt_ids, params) if self.policy == "prefix_affinity" else []
        choice, how = self._choose(candidates, hashes, len(prompt_ids))
        self.decisions[how] += 1
        self.load[choice] += 1
        self._remember(hashes, choice)
        return choice

    def _choose(self, candidates: list[int], hashes: list[BlockHash], num_tokens: int):
        turn = next(self._turn)
        if self.policy == "round_robin":
            return candidates[turn % len(candidates)], "round_robin"
        n = len(self.load)
        least = min(candidates, key=lambda i: (self.load[i], (i - turn) % n))
        matched = self._matched_blocks(hashes, candidates)
        if not matched:
            return least, "least_loaded"
        best = max(matched, key=lambda i: (matched[i], -self.load[i]))
        if matched[best] * self.block_size < self.min_match * num_tokens:
            return least, "least_loaded"
        if self._imbalanced(self.load[best], self.load[least]):
            return least, "guard"
        return best, "affinity"

    def _imbalanced(self, chosen: int, least: int) -> bool:
        return chosen > least + self.imbalance_abs and chosen > self.imbalance_rel * least

    def _matched_blocks(self, hashes: list[BlockHash], candidates: list[int]) -> dict[int, int]:
        """Per candidate, how many leading blocks of the prompt it was sent before."""
        matched: dict[int, int] = {}
        alive = set(candidates)
        for i, block_hash in enumerate(hashes):
            alive &= self._index.get(block_hash, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = i + 1
        return matched

    def block_hashes(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[BlockHash]:
        """The prompt's full-block hashes, computed by the engine's own code. A prompt they
        cannot encode (ids out of range) gets none: its replica refuses it with the reason."""
        request = Request("route", list(prompt_ids), params)
        try:
            return request.update_block_hashes(self.block_size)
        except struct.error:
            return []

    # ---- bookkeeping -----------------------------------------------------------------------
    def _remember(self, hashes: list[BlockHash], replica: int) -> None:
        for block_hash in hashes:
            self._index.setdefault(block_hash, set()).add(replica)
            self._index.move_to_end(block_hash)
        while len(self._index) > self.index_capacity:
            self._index.popitem(last=False)

    def done(self, replica: int) -> None:
        """A request routed to `replica` ended (finished, failed or aborted)."""
        self.load[replica] -= 1

    def mark_down(self, replica: int) -> None:
        """Skip a replica until `mark_up`; its cache is lost, so forget what it held."""
        self.up[replica] = False
        for block_hash, replicas in list(self._index.items()):
            replicas.discard(replica)
            if not replicas:
                del self._index[block_hash]

    def mark_up(self, replica: int) -> None:
        self.up[replica] = True
