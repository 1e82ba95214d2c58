"""Fixed-size KV blocks, their reference counts, and the prefix cache index.

Invariants (asserted by tests/test_block_pool.py):
- a block's `ref_cnt` equals the number of live requests whose block table holds it;
- a block is in the free queue iff `ref_cnt == 0`;
- the free queue order is the eviction order: allocation takes the head (and drops the block's
  hash if it had one), freed blocks join the tail;
- `cached[h]` is a block whose `block_hash == h`, and every hashed block is in `cached`;
- a block is findable through `cached` only once its K/V is written, or is written in the same
  step before anything reads it (see `KVCacheManager.free` for requests that never ran).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes
# Kinds of extra keys a block hash may carry, each with its own tag byte: a value of one kind
# can never be read as another (later kinds: LoRA adapters, multimodal inputs).
EXTRA_KEY_TAGS = {"cache_salt": 1, "rope": 2}
_ROOT = bytes(32)
# A block table entry that names no block: a block freed because no layer's window reaches it any
# more, or padding past a sequence's last block. No kernel may read through it: those that take
# block ids from the host check the entries they will read (`attention.check_block_tables`), and an
# index of -1 fails in torch's gathers, rather than reading another request's K/V as block 0 did.
FREED_BLOCK = -1


def hash_block_tokens(
    parent: BlockHash | None, tokens: Sequence[int], extra_keys: Sequence[tuple[str, str]] = ()
) -> BlockHash:
    """SHA-256 over a canonical encoding of (parent digest, token ids, extra keys), so one
    digest stands for the whole prefix. A collision would hand one request another's K/V, so
    no 64-bit `hash()`: finding one must be as hard as breaking SHA-256. The encoding is
    unambiguous: a 32-byte parent (zeros for a first block), the token count and ids, then
    each extra key tagged by kind and length-prefixed."""
    data = (parent or _ROOT) + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
    for kind, value in extra_keys:
        raw = value.encode("utf-8", "surrogatepass")
        data += struct.pack("<BI", EXTRA_KEY_TAGS[kind], len(raw)) + raw
    return hashlib.sha256(data).digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each, in the given order (callers pass tail blocks first, so a
        request's last blocks are evicted before its prefix)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block. If an equal block is cached already, this one stays private."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated), e.g. for a cold benchmark."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def uncache(self, block: KVCacheBlock) -> None:
        """Make a block unfindable (its K/V will never be written); it stays allocated."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
