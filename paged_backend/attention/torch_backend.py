"""The torch attention backend (CPU and reference): plans a step once for all layers
(`planner`), then attends each layer through block tables, with the C kernels of
`paged_backend.cpu.ops` where they run (decode steps, shared prefixes, prefill chunks in bf16).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from paged_backend.attention.backend import AttentionMetadata, KVCache
from paged_backend.attention.planner import (
    CDecodePlan,
    DecodeBatch,
    PrefillChunk,
    SharedPrefix,
    additive,
    plan_step,
)
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.memory import zeros_on_huge_pages

_PREFIX_COPY_MAX_BYTES = 128 << 20  # fp32 copies of a shared prefix's K/V kept across steps


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
):
    """Softmax attention of fp32 `q` [B, H, R, D] over `k`, `v` [B, H, L, D] (`mask`: additive,
    broadcast to [B, H, R, L]; `softcap`: see `AttentionBackend.forward`) and its log-sum-exp
    [B, H, R], by which partial results merge. On CPU this is torch's flash kernel: 1.3x
    (decode) to 2x (prefill) faster than bmm-softmax-bmm over a shared prefix, and it never
    materialises the scores; it cannot soft-cap."""
    if q.device.type != "cpu" or softcap is not None:
        return _attend_matmul(q, k, v, mask, scale, softcap)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )


def _attend_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
):
    """`_attend` in plain matmuls, for devices without torch's CPU flash kernel and soft-capped
    scores."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores += mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp_(scores.sub_(lse.unsqueeze(-1))), v), lse


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over the union of two key sets, from the results over each (o [..., D],
    lse [...])."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse).unsqueeze(-1) + o2 * torch.exp(lse2 - lse).unsqueeze(-1)


def _rows_first(q_rows: torch.Tensor) -> torch.Tensor:
    """[n, kvh, g, d] token rows -> [1, kvh, n * g, d]: one KV head's queries together."""
    _, kvh, _, d = q_rows.shape
    return q_rows.permute(1, 0, 2, 3).reshape(1, kvh, -1, d)


class TorchAttention:
    """Reference backend in plain torch, laid out for CPU matmuls.

    The cache of a layer is `[num_blocks, num_kv_heads, block_size, head_dim]` (block-major: a
    block's heads side by side). A step reads each sequence's blocks wherever the pool put them;
    block-major, a block is one stretch of memory (at the CPU's 4-token blocks, 8 kv heads of 64
    in bf16 fill one 4 KiB page, where head-major gave each head's 512 bytes a page of its own)
    and a 2 MiB page holds every kv head of a layer's K or V, so huge pages commit one a layer's
    K or V at first, not one a kv head. The C kernels address it through scaled block ids
    (`cpu.ops.kernel_blocks`). Gathering a sequence's blocks gives `[kv_heads, tokens, head_dim]`
    operands with the query heads of one KV head stacked as rows (GQA without repeating K/V).
    Blocks that many sequences share (a RAG system prompt and context) are attended once for all
    of them (cascade attention) and merged with each sequence's own tail by log-sum-exp.
    """

    name = "torch"

    def allocate_kv_cache(
        self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device
    ) -> list[KVCache]:
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        if torch.device(device).type == "cpu":
            cache = zeros_on_huge_pages(shape, dtype, advise=False)  # see ModelRunner
        else:
            cache = torch.zeros(shape, dtype=dtype, device=device)
        return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        c_decode: bool = False,
        c_prefix: bool = False,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """For bf16 or fp32 caches, C kernels (`paged_backend.cpu.ops`): with `c_prefix`, a
        shared prefix is attended by `prefix_attention`; with `c_decode`, `decode_attention` runs
        the decodes of every step, and whole steps of up to `meta.c_decode_rows` rows a sequence
        (where a shared prefix takes part, only with `c_prefix` too). `windows`: the layers'
        windows (None: global), one step plan each."""
        self.group = num_heads // num_kv_heads
        self.windows = tuple(dict.fromkeys(windows)) or (None,)
        self.c_decode = c_decode
        self.c_prefix = c_prefix
        # A RAG batch rereads the same shared prefix every decode step: its K/V, gathered and
        # cast to fp32 (or packed for the C kernel), are kept per layer (keyed by the layer's
        # cache tensor) for the blocks `prefix_blocks`, and dropped as soon as a step writes
        # into any of those blocks.
        self.prefix_blocks: np.ndarray | None = None
        self.prefix_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _track_prefix(self, meta: AttentionMetadata, blocks: np.ndarray | None) -> None:
        """Keep the prefix copies only while they equal the cache: same blocks, none written."""
        kept = self.prefix_blocks
        if kept is not None and (
            blocks is None
            or not np.array_equal(blocks, kept)
            or np.isin(meta.slot_mapping.numpy() // meta.block_size, kept).any()
        ):
            self.prefix_kv.clear()
            kept = None
        self.prefix_blocks = blocks if kept is None else kept

    def prefix_copy(self, k_cache: torch.Tensor, make) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix's K/V copy for this layer (fp32, or packed for
        `cpu_ops.prefix_attention`), from the kept copies when there are some, else `make()`."""
        kv = self.prefix_kv.get(k_cache.data_ptr())
        if kv is None:
            kv = make()
            size = sum(t.numel() * t.element_size() for t in kv)
            kept = size * len(self.prefix_kv)  # every layer's copies are the same size
            if self.prefix_blocks is not None and kept + size <= _PREFIX_COPY_MAX_BYTES:
                self.prefix_kv[k_cache.data_ptr()] = kv
        return kv

    def _c_prefix(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        shared: SharedPrefix,
        block_size: int,
        softcap: float | None,
    ):
        """`cpu_ops.prefix_attention` of the shared rows' bf16 queries over the packed prefix:
        (out [kv_heads, rows * group, dim], lse [kv_heads, rows * group]), rows kv-head-major."""
        _, kvh, _, d = kv_cache[0].shape
        packed = self.prefix_copy(
            kv_cache[0], lambda: cpu_ops.pack_prefix(kv_cache, shared.blocks, block_size)
        )
        q_rows = q.view(q.shape[0], kvh, self.group, d).index_select(0, shared.rows)
        return cpu_ops.prefix_attention(
            _rows_first(q_rows)[0], packed, len(shared.blocks) * block_size, softcap=softcap
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.block_tables_cpu is None:
            meta.block_tables_cpu = meta.block_tables.cpu().numpy()
        meta.prepared = {}
        for window in self.windows:
            plan = plan_step(meta, window, self.group, self.c_decode, self.c_prefix)
            if meta.block_tables.device.type == "cpu" and window is None:
                shared = plan.shared
                self._track_prefix(meta, None if shared is None else shared.blocks.numpy())
            meta.prepared[window] = plan

    def forward(
        self,
        q,
        k,
        v,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        prep = meta.prepared[window]
        if isinstance(prep, CDecodePlan):
            return self._c_decode(q, k, v, kv_cache, meta.block_size, prep, softcap)
        if k.dtype != kv_cache[0].dtype:  # fp16 caches of an fp32 model: every path attends
            k, v = k.to(kv_cache[0].dtype), v.to(kv_cache[0].dtype)  # the values they hold
        if self.c_decode or self.c_prefix:  # bf16 caches, the C ops loaded
            cpu_ops.store_kv(k, v, kv_cache, meta.slot_mapping)
        else:
            bs = meta.block_size
            blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
            kv_cache[0][blocks, :, offsets] = k
            kv_cache[1][blocks, :, offsets] = v
        layer = _Layer(q, k, v, kv_cache, meta.block_size, softcap)
        # fp32 queries for the torch paths; with `c_prefix` only decodes on torch take one (the
        # C kernels read bf16), so no row is cast for nothing
        if not self.c_prefix:
            layer.qf = q.float().view(-1, layer.kvh, layer.group, layer.d)
        elif prep.decodes is not None:
            layer.qf = q[: meta.num_decodes].float().view(-1, layer.kvh, layer.group, layer.d)
        if prep.shared is not None:
            layer.shared = self._shared(layer, prep.shared)
        if prep.c_decodes is not None:
            # (the kernel writes the decodes' k/v again: `store_kv` wrote every row first, as the
            # shared prefix read above may hold a slot that a decode writes now)
            nd = meta.num_decodes
            o = self._c_decode(
                q[:nd],
                k[:nd],
                v[:nd],
                kv_cache,
                meta.block_size,
                prep.c_decodes,
                softcap,
                layer.shared_raw,
            )
            layer.out[:nd] = o.view(nd, layer.kvh, layer.group, layer.d)
        elif prep.decodes is not None:
            self._decodes(layer, prep.decodes)
        for chunk in prep.prefills:
            if self.c_prefix:
                self._c_prefill(layer, chunk, prep.window)
            else:
                self._prefill(layer, chunk)
        return layer.out.view(q.shape)

    def _c_decode(
        self, q, k, v, kv_cache, bs: int, plan: CDecodePlan, softcap, prefix_result=None
    ) -> torch.Tensor:
        """`cpu_ops.decode_attention` of the plan's rows, merged with its shared prefix's result
        (`prefix_result`, `_c_prefix`'s; computed here when not given)."""
        prefix = None
        if plan.shared is not None:
            o, lse = prefix_result or self._c_prefix(q, kv_cache, plan.shared, bs, softcap)
            prefix = (plan.prefix_pos, len(plan.shared.blocks) * bs, o, lse)
        return cpu_ops.decode_attention(
            *(q, k, v, kv_cache, plan.block_tables, plan.seq_lens, bs),
            *(plan.scratch, prefix, plan.window, softcap, plan.query_start),
        )

    def _shared(self, layer: _Layer, shared: SharedPrefix):
        """The shared prefix's attention for its member rows, as token rows [n, kvh, g, *]."""
        if self.c_prefix:
            o, lse = self._c_prefix(layer.q, layer.kv_cache, shared, layer.bs, layer.softcap)
            layer.shared_raw = (o, lse)
            return layer.by_token(o[None], lse[None], len(shared.rows))
        keys, vals = self.prefix_copy(
            layer.kv_cache[0],
            lambda: tuple(layer.gather(c, shared.blocks)[None] for c in layer.kv_cache),
        )
        q_rows = _rows_first(layer.qf.index_select(0, shared.rows))
        o, lse = _attend(q_rows, keys, vals, None, layer.scale, layer.softcap)
        return layer.by_token(o, lse, len(shared.rows))

    def _decodes(self, layer: _Layer, dec: DecodeBatch) -> None:
        """The decodes as one batch of sequences over their gathered, masked keys."""
        nd, kvh, d = dec.mask.shape[0], layer.kvh, layer.d
        keys, vals = (
            layer.gather(c, dec.blocks).view(kvh, nd, -1, d).transpose(0, 1) for c in layer.kv_cache
        )
        o, lse = _attend(layer.qf[:nd], keys, vals, dec.mask, layer.scale, layer.softcap)
        if dec.members is not None:
            sel = dec.members
            o[sel] = layer.with_shared(o[sel], lse[sel], dec.shared_pos)
        layer.out[:nd] = o

    def _c_prefill(self, layer: _Layer, p: PrefillChunk, window: int | None) -> None:
        """bf16 queries over the chunk's packed keys, causal, in C."""
        n, kvh, group, d = p.end - p.start, layer.kvh, layer.group, layer.d
        packed = cpu_ops.pack_prefix(layer.kv_cache, p.blocks, layer.bs, p.num_keys)
        q = layer.q[p.start : p.end]
        if p.shared_pos is None:  # nothing to merge: straight into `out`, in bf16
            out = layer.out[p.start : p.end].view(n, kvh * group, d)
            cpu_ops.prefill_attention(q, packed, p.num_keys, p.offset, out, window, layer.softcap)
            return
        causal = (group, p.offset, window or 0)
        q_rows = _rows_first(q.view(n, kvh, group, d))[0]
        o, lse = cpu_ops.prefix_attention(q_rows, packed, p.num_keys, causal, layer.softcap)
        o, lse = layer.by_token(o[None], lse[None], n)
        layer.out[p.start : p.end] = layer.with_shared(o, lse, p.shared_pos)

    def _prefill(self, layer: _Layer, p: PrefillChunk) -> None:
        """A chunk on the torch path: the flash kernel over its own k/v where nothing is cached
        before it and nothing caps the scores, else `_attend` over its gathered keys."""
        n, kvh, group, d = p.end - p.start, layer.kvh, layer.group, layer.d
        if p.blocks is None and layer.softcap is None:
            # 4-D strided views take torch's flash kernel (3-D inputs fall back to math); fp32
            # costs no more there than bf16 and keeps bf16 models on the reference.
            o = F.scaled_dot_product_attention(
                layer.qf[p.start : p.end].view(n, -1, d).transpose(0, 1).unsqueeze(0),
                *(t[p.start : p.end].float().transpose(0, 1).unsqueeze(0) for t in layer.kv),
                is_causal=True,
                enable_gqa=group > 1,
            )
            layer.out[p.start : p.end] = o[0].transpose(0, 1).reshape(-1, kvh, group, d)
            return
        if p.blocks is None:  # soft-capped, no context: over the chunk's own k/v
            if p.mask is None:
                causal = torch.ones(n, n, dtype=torch.bool, device=layer.q.device).tril_()
                p.mask = additive(causal.repeat_interleave(group, dim=0))[None, None]
            keys, vals = (t[p.start : p.end].float().transpose(0, 1)[None] for t in layer.kv)
        else:
            keys, vals = (layer.gather(c, p.blocks)[None] for c in layer.kv_cache)
        q_rows = _rows_first(layer.qf[p.start : p.end])
        o, lse = _attend(q_rows, keys, vals, p.mask, layer.scale, layer.softcap)
        o, lse = layer.by_token(o, lse, n)
        layer.out[p.start : p.end] = (
            o if p.shared_pos is None else layer.with_shared(o, lse, p.shared_pos)
        )


class _Layer:
    """One layer's attention over a `TorchPlan`: the tensors every part reads, the shared
    prefix's result once computed, and `out`, token rows [T, kvh, g, d] in the model's dtype
    (fp32 results round here)."""

    def __init__(self, q, k, v, kv_cache: KVCache, bs: int, softcap: float | None) -> None:
        self.q, self.kv, self.kv_cache, self.bs, self.softcap = q, (k, v), kv_cache, bs, softcap
        _, self.kvh, _, self.d = kv_cache[0].shape
        self.group = q.shape[1] // self.kvh
        self.scale = self.d**-0.5
        self.qf: torch.Tensor | None = None
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_raw: tuple[torch.Tensor, torch.Tensor] | None = None  # `_c_prefix`'s form
        self.out = torch.empty(q.shape[0], self.kvh, self.group, self.d, dtype=q.dtype)

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The keys (or values) of `blocks` in fp32, [kv_heads, len(blocks) * block_size, dim]."""
        picked = cache.index_select(0, blocks)  # (on a transposed view it copied the cache)
        out = torch.empty(self.kvh, len(blocks), self.bs, self.d, device=cache.device)
        return out.copy_(picked.transpose(0, 1)).view(self.kvh, -1, self.d)

    def by_token(self, o: torch.Tensor, lse: torch.Tensor, n: int):
        """`_attend`'s [1, kvh, n * g, *] results back to token rows [n, kvh, g, *]."""
        o = o.view(self.kvh, n, self.group, self.d).permute(1, 0, 2, 3)
        return o, lse.view(self.kvh, n, self.group).permute(1, 0, 2)

    def with_shared(self, o, lse, pos: torch.Tensor) -> torch.Tensor:
        """Merge a result [n, kvh, g, *] with the shared prefix's at its rows `pos`."""
        so, slse = self.shared
        return _merge(o, lse, so.index_select(0, pos), slse.index_select(0, pos))
