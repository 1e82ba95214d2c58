"""Per-request block tables on top of the `BlockPool`, with automatic prefix caching.

When every layer attends through a sliding window (`window`: the largest), the leading blocks
no layer will read again are freed as a request advances; its table keeps None in their place,
so entry i still holds tokens i * block_size on. Freed blocks keep their hashes (LRU eviction,
as any freed block) and stay findable by later prompts with the same prefix.
"""

from __future__ import annotations

from paged_backend.block_pool import FREED_BLOCK, BlockPool, KVCacheBlock
from paged_backend.request import Request


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, window: int | None = None
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.block_tables: dict[str, list[KVCacheBlock | None]] = {}
        self.prefix_queries = 0  # prompt tokens of requests admitted for the first time
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, computed `step_tokens` at a
        time at most: all of them, or under a window the blocks from the first one a step's
        queries see to the last one it writes."""
        need = self.blocks_needed(num_tokens)
        if self.window is None:
            return need
        reach = self.window - 1 + min(step_tokens, num_tokens)
        return min(need, reach // self.block_size + 2)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. Never the whole prompt: the last token is always
        computed so that there are logits to sample from (and every row that gives a prompt
        logprob still missing, `Request.prompt_logprob_row`). Counts nothing: a waiting request is
        looked up again each step until it is admitted (`record_prefix_hits`)."""
        if not self.enable_caching:
            return [], 0
        hashes = request.update_block_hashes(self.block_size)
        last = request.num_tokens - 1
        if request.prompt_logprob_row is not None:  # those rows must run
            last = min(last, request.prompt_logprob_row)
        max_blocks = last // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_hits(self, request: Request, num_hit_tokens: int) -> None:
        """Count a request's prompt and its cache hits once, when it is first admitted (vLLM's
        hit rate, which also leaves out the re-prefills after preemption)."""
        if self.enable_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] = ()
    ) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens after its computed ones (and
        after the cache hits `computed`, which it takes a reference on). False if too few free."""
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        dead = self._num_dead_blocks(num_computed)
        self._free_leading(table, dead)
        skipped = min(max(dead - len(table), 0), len(computed))  # hits no layer will read
        live_hits = list(computed[skipped:])
        need = self.blocks_needed(total) - len(table) - len(computed)
        hits_in_free_queue = sum(1 for b in live_hits if b.ref_cnt == 0)
        if need > self.pool.num_free - hits_in_free_queue:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(live_hits)
        table.extend([None] * skipped + live_hits)
        if need > 0:
            table.extend(self.pool.allocate(need))
        if self.enable_caching:
            # Tokens scheduled now are known, so their full blocks can be found by later requests
            # (also ones scheduled in this same step: K/V are written before attention reads).
            hashes = request.update_block_hashes(self.block_size)
            num_full = min(total // self.block_size, len(hashes))
            for i in range(request.num_hashed_blocks, num_full):
                if table[i] is not None:  # a skipped hit is cached already
                    self.pool.cache(table[i], hashes[i])
            request.num_hashed_blocks = max(request.num_hashed_blocks, num_full)
        return True

    def _num_dead_blocks(self, num_computed: int) -> int:
        """Leading blocks that no query from position `num_computed` on can see."""
        if self.window is None:
            return 0
        return max(num_computed - self.window + 1, 0) // self.block_size

    def _free_leading(self, table: list[KVCacheBlock | None], dead: int) -> None:
        """Free the table's first `dead` blocks (those still held), last first. Freed entries
        always form a prefix of the table, so only the ones freed now are visited."""
        end = min(dead, len(table))
        start = end
        while start > 0 and table[start - 1] is not None:
            start -= 1
        if start < end:
            freed = table[start:end]
            table[start:end] = [None] * (end - start)
            self.pool.free(reversed(freed))

    def free(self, request: Request) -> list[KVCacheBlock]:
        """Release a request's blocks, tail first. The blocks it hashed when their tokens were
        scheduled but that its step never computed (preempted in the same step, or the step
        failed) stop being findable first. Returns those of them that another request still
        holds: it took them as cached K/V in this same step and must not read them."""
        table = self.block_tables.pop(request.request_id, [])
        written = request.num_computed_tokens // self.block_size
        unwritten = table[written : request.num_hashed_blocks]
        for block in unwritten:
            self.pool.uncache(block)
        self.pool.free(b for b in reversed(table) if b is not None)
        request.num_hashed_blocks = 0
        return [b for b in unwritten if b.ref_cnt > 0]

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free a request's blocks past its first `num_tokens` tokens, tail first: blocks that
        held rejected drafts only. Drafts are never hashed, so none of them is findable."""
        table = self.block_tables[request.request_id]
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            assert all(b.block_hash is None for b in tail), "a drafted block was hashed"
            self.pool.free(reversed(tail))

    def holds_any(self, request: Request, blocks: list[KVCacheBlock]) -> bool:
        table = self.block_tables.get(request.request_id, ())
        return any(b is block for b in table for block in blocks)

    def usage(self, requests: list[Request]) -> tuple[int, int]:
        """(token slots in blocks some request holds, of which hold a computed token). Only a
        request's private tail block has empty slots; shared blocks are full by construction."""
        allocated = (self.num_blocks - self.pool.num_free) * self.block_size
        empty = sum(
            len(self.block_tables.get(r.request_id, ())) * self.block_size - r.num_computed_tokens
            for r in requests
            if r.request_id in self.block_tables
        )
        return allocated, allocated - empty

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table; freed leading entries read FREED_BLOCK, which no kernel
        reads (an off-by-one in a window then fails instead of reading another request's K/V)."""
        table = self.block_tables[request.request_id]
        return [FREED_BLOCK if b is None else b.block_id for b in table]
