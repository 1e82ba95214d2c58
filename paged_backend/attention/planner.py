"""A step's attention plan, made once for all layers of one window (`plan_step`): which
sequences share a cached prefix (attended once for all of them: cascade attention), which
blocks and masks the torch path gathers for the decodes and for each prefill chunk, or, for a
step of decodes only on the C kernel, its `CDecodePlan` (a mixed step's decodes take one too)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.block_pool import FREED_BLOCK

MIN_SHARED_BLOCKS = 2  # shorter shared prefixes are not worth a separate pass
# the most rows of a sequence whose scores a thread holds at once in the C decode kernel (fp32's
# reads the keys once for them: a prompt's chunk takes several passes)
SCRATCH_ROWS = 64


@dataclass
class SharedPrefix:
    """Cascade attention: a prefix of blocks every member sequence holds and has fully in its
    context, attended once for all their query rows."""

    rows: torch.Tensor  # flattened token rows of the member sequences
    blocks: torch.Tensor  # the shared block ids


@dataclass
class DecodeBatch:
    blocks: torch.Tensor  # [nd * n] block ids (each sequence's blocks after its shared prefix, or
    # from the first block its window reaches)
    mask: torch.Tensor  # [nd, 1, 1, n * block_size] additive: 0 where the key is in context
    members: torch.Tensor | None  # decode indices that take part in the shared prefix
    shared_pos: torch.Tensor | None  # ... and the positions of their rows in `SharedPrefix.rows`


@dataclass
class PrefillChunk:
    start: int
    end: int
    blocks: torch.Tensor | None  # blocks from `first_key` on; None: attend to the new k/v only
    mask: torch.Tensor | None  # [1, 1, q_len * group, keys] additive causal (and window) mask;
    # without `blocks`, built by the first soft-capped layer (SDPA cannot soft-cap)
    shared_pos: torch.Tensor | None  # positions of this sequence's rows in `SharedPrefix.rows`
    num_keys: int = 0  # tokens from `first_key` to the end of the chunk
    offset: int = 0  # keys before the chunk's first token, from `first_key` (its cached context)


@dataclass
class CDecodePlan:
    """A step of decodes only, for `cpu.ops.decode_attention` (and `cpu.ops.prefix_attention`
    for a shared prefix)."""

    block_tables: torch.Tensor  # int32 [S, width], contiguous
    seq_lens: torch.Tensor  # int32 [S]
    scratch: torch.Tensor  # fp32 scores of one kv head's queries over the longest context, a
    # row for each thread
    shared: SharedPrefix | None
    prefix_pos: torch.Tensor | None  # int32 [rows]: each row's position in `shared.rows`, or -1
    window: int | None
    query_start: torch.Tensor | None = None  # int32 [S + 1] where a sequence has several rows
    # (drafts being verified, short chunks); None: one row each


@dataclass
class TorchPlan:
    shared: SharedPrefix | None
    decodes: DecodeBatch | None
    prefills: list[PrefillChunk]
    window: int | None
    # A step's decodes on the C kernel instead of `decodes` (a step with prefills too): its
    # first sequences, merged with `shared`'s result where they share the prefix.
    c_decodes: CDecodePlan | None = None


def window_start(position: int, window: int | None) -> int:
    """The first key position the query at `position` sees."""
    return 0 if window is None else max(0, position - window + 1)


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def shared_prefix(meta: AttentionMetadata, before_writes: bool) -> tuple[list[int], int]:
    """The sequences that share the most common leading block, and how many leading blocks they
    all share within their cached context (0 when cascading is not worth it). A request admitted
    on a cache hit may hold, in its context, a block that another request writes in this step.
    Where the cascade runs `before_writes` (the C decode kernel writes the step's K/V, the
    cascade has run by then), the prefix stops before the first block this step writes into."""
    tables = meta.block_tables_cpu
    bs = meta.block_size
    qsl = meta.query_start_loc
    context_blocks = [
        (seq_len - (qsl[i + 1] - qsl[i])) // bs for i, seq_len in enumerate(meta.seq_lens)
    ]
    firsts = Counter(tables[i, 0] for i, c in enumerate(context_blocks) if c > 0)
    firsts.pop(FREED_BLOCK, None)
    if not firsts:
        return [], 0
    first, count = firsts.most_common(1)[0]
    if count < 2:
        return [], 0
    members = [i for i, c in enumerate(context_blocks) if c > 0 and tables[i, 0] == first]
    limit = min(context_blocks[i] for i in members)
    sub = tables[members, :limit]
    same = (sub == sub[0]).all(axis=0)
    if before_writes:
        slots = meta.slot_mapping.cpu().numpy()
        same &= ~np.isin(sub[0], slots[slots >= 0] // bs)
    num = int(limit if same.all() else same.argmin())
    return (members, num) if num >= MIN_SHARED_BLOCKS else ([], 0)


def plan_step(
    meta: AttentionMetadata,
    window: int | None,
    group: int,
    c_decode: bool,
    c_prefix: bool,
) -> CDecodePlan | TorchPlan:
    """The step's plan for the layers with this `window` (None: global). Windowed layers read
    only their window's blocks and take no cascade: a shared prefix soon leaves it. `group`:
    query heads a kv head; `c_decode`/`c_prefix`: the C decode and prefix kernels run, the
    decode one for steps whose sequences have up to `meta.c_decode_rows` rows each (its
    `CDecodePlan`), and for the decodes of any other step (`TorchPlan.c_decodes`)."""
    device = meta.block_tables.device
    qsl = meta.query_start_loc
    tables = meta.block_tables_cpu
    nd = meta.num_decodes
    most_rows = max(b - a for a, b in itertools.pairwise(qsl))
    rows = meta.c_decode_rows
    num_seqs = len(meta.seq_lens)
    # the C decode kernel runs the whole step (else, where it runs, the step's decodes)
    whole_step = c_decode and (nd == num_seqs if rows == 1 else most_rows <= rows)
    # No cascade where fp32's C kernel runs the step (there is no fp32 C prefix kernel): it
    # gives each row the bits it has alone, and its sequences reread a shared prefix from cache.
    cascade = window is None and (c_prefix or not whole_step)
    members, num_shared = shared_prefix(meta, whole_step) if cascade else ([], 0)
    shared = None
    row_pos: dict[int, list[int]] = {}  # member -> positions of its rows in `shared.rows`
    if num_shared:
        rows: list[int] = []
        for i in members:
            row_pos[i] = list(range(len(rows), len(rows) + qsl[i + 1] - qsl[i]))
            rows.extend(range(qsl[i], qsl[i + 1]))
        shared = SharedPrefix(
            torch.tensor(rows, device=device),
            torch.from_numpy(tables[members[0], :num_shared]).to(device),
        )
    # (the kernel merges a shared prefix's result from `prefix_attention`: c_prefix)
    on_kernel = c_prefix or not num_shared
    if whole_step and on_kernel:
        return _c_decode_plan(meta, num_seqs, group, shared, row_pos, window)
    skip = [num_shared if i in row_pos else 0 for i in range(num_seqs)]
    c_decodes = decodes = None
    if nd and c_decode and on_kernel:
        c_decodes = _c_decode_plan(meta, nd, group, shared, row_pos, window)
    elif nd:
        decodes = _decode_batch(meta, window, skip, row_pos)
    prefills = [
        _prefill_chunk(meta, i, window, group, c_prefix, skip[i], row_pos)
        for i in range(nd, num_seqs)
    ]
    return TorchPlan(shared, decodes, prefills, window, c_decodes)


def _c_decode_plan(meta, seqs: int, group: int, shared, row_pos, window) -> CDecodePlan:
    """The C decode kernel's plan for the step's first `seqs` sequences (all of them, or a
    step's decodes)."""
    qsl = meta.query_start_loc[: seqs + 1]
    counts = np.diff(qsl)
    most_rows = int(counts.max())
    lens = meta.seq_lens[:seqs]
    positions = None
    if shared is not None:
        positions = [p for i, n in enumerate(counts) for p in row_pos.get(i, [-1] * n)]
    return CDecodePlan(
        torch.from_numpy(np.ascontiguousarray(meta.block_tables_cpu[:seqs], dtype=np.int32)),
        torch.tensor(lens, dtype=torch.int32),
        torch.empty(torch.get_num_threads(), group * min(most_rows, SCRATCH_ROWS) * max(lens)),
        shared,
        None if positions is None else torch.tensor(positions, dtype=torch.int32),
        window,
        None if most_rows == 1 else torch.tensor(qsl, dtype=torch.int32),
    )


def _positions(row_pos: dict[int, list[int]], seqs: list[int], device) -> torch.Tensor:
    return torch.tensor([p for i in seqs for p in row_pos[i]], device=device)


def _decode_batch(meta, window, skip: list[int], row_pos) -> DecodeBatch:
    """The decodes' keys (from `skip` leading blocks, or their window's first, on) gathered as
    one batch, masked to each sequence's context."""
    bs, nd, tables = meta.block_size, meta.num_decodes, meta.block_tables_cpu
    device = meta.block_tables.device
    lens = np.array(meta.seq_lens[:nd])
    lows = np.array([window_start(n - 1, window) for n in lens])  # first key seen
    first = np.array(skip[:nd]) if window is None else lows // bs
    n = int(((lens + bs - 1) // bs - first).max())
    cols = first[:, None] + np.arange(n)[None, :]
    blocks = np.take_along_axis(tables[:nd], np.minimum(cols, tables.shape[1] - 1), 1)
    # Columns past a sequence's last block are masked out: gather block 0 there. A freed entry
    # inside the range stays -1 and fails the gather.
    blocks[cols >= ((lens + bs - 1) // bs)[:, None]] = 0
    key_pos = (cols[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(nd, -1)
    mask = ((key_pos < lens[:, None]) & (key_pos >= lows[:, None])).reshape(nd, 1, 1, -1)
    members = [i for i in range(nd) if i in row_pos]
    return DecodeBatch(
        torch.from_numpy(blocks.reshape(-1)).to(device),
        additive(torch.from_numpy(mask).to(device)),
        torch.tensor(members, device=device) if members else None,
        _positions(row_pos, members, device) if members else None,
    )


def _prefill_chunk(meta, i: int, window, group, c_prefix: bool, skip: int, row_pos):
    """Sequence i's chunk: its blocks from `skip` (or its window's first) on and, for the torch
    path, its causal (and window) mask; none for a chunk with nothing cached before it."""
    bs, qsl, tables = meta.block_size, meta.query_start_loc, meta.block_tables_cpu
    device = meta.block_tables.device
    start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens[i]
    context = seq_len - (end - start)
    if context == 0 and not c_prefix and (window is None or end - start <= window):
        return PrefillChunk(start, end, None, None, None)  # plain causal
    first_block = skip if window is None else window_start(context, window) // bs
    first_key = first_block * bs
    blocks = torch.from_numpy(tables[i, first_block : (seq_len + bs - 1) // bs]).to(device)
    mask = None
    if not c_prefix:  # the C kernel masks by position
        q_pos = torch.arange(context, seq_len, device=device)[:, None]
        k_pos = torch.arange(first_key, first_key + len(blocks) * bs, device=device)
        allowed = k_pos[None, :] <= q_pos
        if window is not None:
            allowed &= k_pos[None, :] > q_pos - window
        mask = additive(allowed.repeat_interleave(group, dim=0))[None, None]
    shared_pos = _positions(row_pos, [i], device) if i in row_pos else None
    return PrefillChunk(
        start, end, blocks, mask, shared_pos, seq_len - first_key, context - first_key
    )
