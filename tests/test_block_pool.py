"""Property tests: random add / step / abort / finish sequences keep the KV cache invariants."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_backend.kv_cache_manager import KVCacheManager
from paged_backend.request import Request, RequestStatus
from paged_backend.sampling_params import SamplingParams
from paged_backend.scheduler import Scheduler

BLOCK = 16


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    holders = Counter(b.block_id for table in kv.block_tables.values() for b in table)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0), block
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert all(b.block_hash == h for h, b in pool.cached.items())
    for table in kv.block_tables.values():
        assert len(set(map(id, table))) == len(table)  # no block twice in one table


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the real Scheduler and KVCacheManager with a fake model (tokens drawn by data).

    The fake model keeps a shadow of what each KV slot holds: the whole token prefix whose K/V
    it would contain. Within a step it models when each slot is written, as the kernels'
    contract says: every scheduled slot first, then every row's reads. Each scheduled request
    must find, in each slot of its context, exactly its own prefix: a cache hit on a block that
    was never written (or written for other tokens) fails here. `cross_reads` counts the reads
    of a slot that another request writes in the same step: they are correct only because all
    writes come first (see `_run_model`'s `writes_first`)."""

    def __init__(self, long_prefill_token_threshold: int = 0) -> None:
        super().__init__()
        self.policy = "fcfs"
        self.kv = KVCacheManager(num_blocks=12, block_size=BLOCK, enable_caching=True)
        self.scheduler = Scheduler(
            self.kv, 4, 32, self.policy, long_prefill_token_threshold=long_prefill_token_threshold
        )
        self.live: list[Request] = []
        self.count = 0
        self.shadow: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> prefix
        self.cross_reads = 0

    @rule(
        prefix=st.sampled_from([0, 1, 2]),
        length=st.integers(1, 80),
        max_tokens=st.integers(1, 40),
        priority=st.integers(0, 3),
        policy=st.sampled_from(["fcfs", "priority"]),
    )
    def add(self, prefix, length, max_tokens, priority, policy):
        if not self.live:  # switch policy only while idle, like a fresh engine
            self.scheduler.policy = policy
        # A few shared prefixes make cache hits (and hits on free, evictable blocks) common.
        tokens = [prefix * 100 + (i % 7) for i in range(length)]
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if self.kv.blocks_needed(length + max_tokens) > self.kv.num_blocks:
            return
        req = Request(f"r{self.count}", tokens, params, priority=priority)
        self.scheduler.add(req)
        self.live.append(req)

    def _run_model(self, out, writes_first: bool = True) -> None:
        """One step of the model: the step's writes, then every scheduled request's reads of
        its context. With `writes_first=False` it models a kernel that writes and reads one
        sequence at a time, on threads in any order (as the C decode kernel did): a row may then
        read before any other row of the step has written, so each read sees the step's writes
        of its own request only."""
        writes: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}  # slot -> writer, prefix
        for req, n in out.num_scheduled.items():
            table = self.kv.block_tables[req.request_id]
            assert len(table) * BLOCK >= req.num_computed_tokens + n
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                slot = (table[pos // BLOCK].block_id, pos % BLOCK)
                writes[slot] = (req.request_id, tuple(req.all_token_ids[: pos + 1]))
        for req, n in out.num_scheduled.items():
            table = self.kv.block_tables[req.request_id]
            for pos in range(req.num_computed_tokens + n):
                slot = (table[pos // BLOCK].block_id, pos % BLOCK)
                held = self.shadow.get(slot)
                writer, prefix = writes.get(slot, (None, None))
                if writer is not None and writer != req.request_id:
                    self.cross_reads += 1
                if writer is not None and (writes_first or writer == req.request_id):
                    held = prefix
                assert held == tuple(req.all_token_ids[: pos + 1]), (
                    f"{req.request_id} reads K/V never written for its tokens at {pos}"
                )
        self.shadow.update((slot, prefix) for slot, (_, prefix) in writes.items())

    @rule(token=st.integers(0, 9))
    def step(self, token):
        out = self.scheduler.schedule()
        assert out.num_tokens <= self.scheduler.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        self._run_model(out)
        self.scheduler.update(out)
        for req in list(out.num_scheduled):
            if req.num_computed_tokens == req.num_tokens:
                req.append_output(token)
                if len(req.output_token_ids) >= req.max_tokens:
                    self.scheduler.finish(req, "length")
                    self.live.remove(req)

    @rule()
    def failed_step(self):
        """The model raised: the step's requests fail (the engine finishes them, without
        `update`); nothing they were to write may be found by later requests."""
        out = self.scheduler.schedule()
        for req in out.num_scheduled:
            self.scheduler.finish(req, "error")
            self.live.remove(req)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        req = self.live.pop(index % len(self.live))
        self.scheduler.finish(req, "abort")
        self.scheduler.finish(req, "abort")  # a second finish is a no-op, never a double free
        assert req.status is RequestStatus.FINISHED

    @invariant()
    def invariants_hold(self):
        check_invariants(self.kv)

    def teardown(self):
        for req in self.live:
            self.scheduler.finish(req, "abort")
        check_invariants(self.kv)
        assert self.kv.pool.num_free == self.kv.num_blocks
        assert not self.kv.block_tables


TestSchedulerMachine = SchedulerMachine.TestCase


@pytest.mark.parametrize("threshold", [0, 8])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_seeded_interleavings_never_read_unwritten_kv(policy, threshold):
    """The machine's rules on seeded random workloads biased toward what makes a request read
    K/V nobody wrote: long prompts over two shared prefixes, chunked prefill, tight blocks,
    urgent arrivals that preempt, aborts and failed steps; also with long prefills capped
    (`threshold`), which passes long waiting requests over for shorter ones."""
    cross_reads = 0
    for seed in range(150):
        rng = random.Random(seed)
        machine = SchedulerMachine(threshold)
        for _ in range(60):
            roll = rng.random()
            if roll < 0.4:
                machine.add(
                    prefix=rng.randrange(2),
                    length=rng.randint(17, 100),
                    max_tokens=rng.randint(1, 8),
                    priority=rng.randrange(4),
                    policy=policy,
                )
            elif roll < 0.9:
                machine.step(token=rng.randrange(10))
            elif roll < 0.95 and machine.live:
                machine.abort(rng.randrange(100))
            else:
                machine.failed_step()
            machine.invariants_hold()
        machine.teardown()
        cross_reads += machine.cross_reads
    assert cross_reads > 0  # the workloads do read, in a step, slots that step writes


def test_a_hit_on_a_block_its_owner_fills_in_the_same_step_needs_every_write_first():
    """V decodes the token that fills its second block; W, whose prompt is V's tokens so far
    plus one, arrives then and is admitted on a hit of that block in the same step. Its read is
    right only if the kernels write every row's K/V before any row reads: the shadow model run
    one sequence at a time (the old C decode kernel's order) fails on it."""
    for writes_first in (True, False):
        machine = SchedulerMachine()
        v = Request("v", list(range(2 * BLOCK - 1)), SamplingParams(max_tokens=4))
        machine.scheduler.add(v)
        machine.live.append(v)
        machine.step(token=7)  # V's prompt; its first token is the block's last
        assert v.num_tokens == 2 * BLOCK and v.num_computed_tokens == 2 * BLOCK - 1
        w = Request("w", [*v.all_token_ids, 9], SamplingParams(max_tokens=2))
        machine.scheduler.add(w)
        machine.live.append(w)
        out = machine.scheduler.schedule()
        assert out.num_scheduled == {v: 1, w: 1}  # W hit both of V's blocks, the second unwritten
        if writes_first:
            machine._run_model(out)
            assert machine.cross_reads == 1
        else:
            with pytest.raises(AssertionError, match="w reads K/V never written"):
                machine._run_model(out, writes_first=False)


TestSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_all_requests_finish_and_free_everything():
    """Stepping until done serves every request, however tight the cache."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, policy="fcfs")
    reqs = [
        Request(f"r{i}", [i % 3] * (20 + 7 * i), SamplingParams(max_tokens=30)) for i in range(8)
    ]
    for r in reqs:
        scheduler.add(r)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        scheduler.update(out)
        for req in list(out.num_scheduled):
            if req.num_computed_tokens == req.num_tokens:
                req.append_output(5)
                if len(req.output_token_ids) >= req.max_tokens:
                    scheduler.finish(req, "length")
        check_invariants(kv)
    assert all(len(r.output_token_ids) == 30 for r in reqs)
    assert scheduler.num_preemptions > 0
    assert kv.pool.num_free == kv.num_blocks


def test_lru_eviction_order_and_hash_drop():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    a = Request("a", list(range(33)), SamplingParams())
    assert kv.allocate_slots(a, 33)
    a.num_computed_tokens = 33  # the step ran: its K/V is written, so its blocks stay cached
    kv.free(a)
    # Freed tail-first: the partial last block is evicted before the prefix blocks.
    order = [b.block_id for b in kv.pool.free_queue.values()]
    table_ids = [0, 1, 2]
    assert order[-3:] == list(reversed(table_ids))
    b = Request("b", list(range(33)), SamplingParams())
    hits, n = kv.get_computed_blocks(b)
    assert n == 32 and [h.block_id for h in hits] == [0, 1]
    c = Request("c", [7] * 64, SamplingParams())
    assert kv.allocate_slots(c, 64)  # takes every free block: a's cached ones lose their hash
    assert kv.get_computed_blocks(b)[1] == 0
    assert set(map(id, kv.pool.cached.values())) == set(map(id, kv.block_tables["c"]))


def test_blocks_hashed_but_never_written_are_not_found():
    """A request freed before its scheduled tokens ran (preempted in the same step, or its step
    failed) leaves none of those blocks findable; computed ones stay cached."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True)
    a = Request("a", list(range(40)), SamplingParams())
    assert kv.allocate_slots(a, 40)
    a.num_computed_tokens = 16  # only the first block's tokens ran
    assert kv.free(a) == []
    b = Request("b", list(range(40)), SamplingParams())
    assert kv.get_computed_blocks(b)[1] == 16


def test_priority_preemption_in_the_same_step_leaves_no_unwritten_hit():
    """The repro: A (priority 5) is chunk-prefilled; in the step that schedules A's second
    chunk, B (priority 0, sharing A's first 48 tokens) cannot fit and preempts A. B may reuse
    A's two written blocks, never the third one A was to finish writing in that step."""
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=40, policy="priority")
    a = Request("a", list(range(64)), SamplingParams(max_tokens=1), priority=5)
    scheduler.add(a)
    scheduler.update(scheduler.schedule())  # A's first 40 tokens run: blocks 0 and 1 written
    b = Request("b", list(range(48)) + [99] * 12, SamplingParams(max_tokens=1), priority=0)
    scheduler.add(b)
    out = scheduler.schedule()  # A's second chunk is scheduled, then B preempts A
    assert a in out.preempted and b in out.num_scheduled
    assert b.num_computed_tokens == 32, "B counted blocks as cached that were never written"
    check_invariants(kv)
