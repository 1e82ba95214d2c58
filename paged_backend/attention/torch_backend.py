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

    The cache of a layer is `[num_kv_heads, num_blocks * block_size, head_dim]` (head-major), so
    gathering a sequence's blocks gives contiguous `[kv_heads, tokens, head_dim]` operands with
    the query heads of one KV head stacked as rows (GQA without repeating K/V). Blocks that many
    sequences share (a RAG system prompt and context) are attended once for all of them
    (cascade attention) and merged with each sequence's own tail by log-sum-exp.
    """

    name = "torch"

    def allocate_kv_cache(
        self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device
    ) -> list[KVCache]:
        shape = (num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim)
        if torch.device(device).type == "cpu":
            cache = zeros_on_huge_pages(shape, dtype)
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
        """For bf16 caches, C kernels (`paged_backend.cpu_ops`): with `c_prefix`, a shared prefix
        is attended by `prefix_attention`; with `c_decode`, steps of decodes only run
        `decode_attention` (those with a shared prefix only with `c_prefix` too). `windows`: the
        layers' windows (None: global), one step plan each."""
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
        kvh, _, d = kv_cache[0].shape
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
            prefix = None
            if prep.shared is not None:
                o, lse = self._c_prefix(q, kv_cache, prep.shared, meta.block_size, softcap)
                prefix = (prep.prefix_pos, len(prep.shared.blocks) * meta.block_size, o, lse)
            return cpu_ops.decode_attention(
                *(q, k, v, kv_cache, prep.block_tables, prep.seq_lens, meta.block_size),
                *(prep.scratch, prefix, prep.window, softcap),
            )
        k_cache, v_cache = kv_cache
        kvh, _, d = k_cache.shape
        bs = meta.block_size
        if self.c_decode or self.c_prefix:  # bf16 caches, the C ops loaded
            cpu_ops.store_kv(k, v, kv_cache, meta.slot_mapping)
        else:
            k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        num_tokens, num_heads, _ = q.shape
        group = num_heads // kvh
        scale = d**-0.5
        # fp32 queries for the torch paths; with `c_prefix` only the decodes take one (the C
        # kernels read bf16), so a prefill's rows are not cast for nothing
        qf = (q[: meta.num_decodes] if self.c_prefix else q).float().view(-1, kvh, group, d)
        out = torch.empty(num_tokens, kvh, group, d, dtype=q.dtype)  # fp32 results round here

        def gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
            picked = cache.view(kvh, -1, bs, d).index_select(1, blocks)
            return picked.view(kvh, -1, d).float()

        def by_token(o: torch.Tensor, lse: torch.Tensor, n: int):
            """`_attend`'s [1, kvh, n * g, *] results back to token rows [n, kvh, g, *]."""
            o = o.view(kvh, n, group, d).permute(1, 0, 2, 3)
            return o, lse.view(kvh, n, group).permute(1, 0, 2)

        shared = None
        if prep.shared is not None:
            s = prep.shared
            if self.c_prefix:
                o, lse = (t[None] for t in self._c_prefix(q, kv_cache, s, bs, softcap))
            else:
                keys, vals = self.prefix_copy(
                    k_cache,
                    lambda: (gather(k_cache, s.blocks)[None], gather(v_cache, s.blocks)[None]),
                )
                q_rows = _rows_first(qf.index_select(0, s.rows))
                o, lse = _attend(q_rows, keys, vals, None, scale, softcap)
            shared = by_token(o, lse, len(s.rows))

        def with_shared(o, lse, pos: torch.Tensor) -> torch.Tensor:
            """Merge a result [n, kvh, g, *] with the shared prefix's at its rows `pos`."""
            return _merge(o, lse, shared[0].index_select(0, pos), shared[1].index_select(0, pos))

        if prep.decodes is not None:
            dec = prep.decodes
            nd = dec.mask.shape[0]
            keys = gather(k_cache, dec.blocks).view(kvh, nd, -1, d).transpose(0, 1)
            vals = gather(v_cache, dec.blocks).view(kvh, nd, -1, d).transpose(0, 1)
            o, lse = _attend(qf[:nd], keys, vals, dec.mask, scale, softcap)  # batch: sequences
            if dec.members is not None:
                sel = dec.members
                o[sel] = with_shared(o[sel], lse[sel], dec.shared_pos)
            out[:nd] = o
        for p in prep.prefills:
            n = p.end - p.start
            if self.c_prefix:  # bf16 queries over the chunk's packed keys, causal
                packed = cpu_ops.pack_prefix(kv_cache, p.blocks, bs, p.num_keys)
                if p.shared_pos is None:  # nothing to merge: straight into `out`, in bf16
                    cpu_ops.prefill_attention(
                        q[p.start : p.end],
                        packed,
                        p.num_keys,
                        p.offset,
                        out[p.start : p.end].view(n, num_heads, d),
                        prep.window,
                        softcap,
                    )
                    continue
                q_rows = _rows_first(q[p.start : p.end].view(n, kvh, group, d))[0]
                causal = (group, p.offset, prep.window or 0)
                o, lse = cpu_ops.prefix_attention(q_rows, packed, p.num_keys, causal, softcap)
                o, lse = by_token(o[None], lse[None], n)
            elif p.blocks is None and softcap is None:
                # 4-D strided views take torch's flash kernel (3-D inputs fall back to math);
                # fp32 costs no more there than bf16 and keeps bf16 models on the reference.
                o = F.scaled_dot_product_attention(
                    qf[p.start : p.end].view(-1, num_heads, d).transpose(0, 1).unsqueeze(0),
                    k[p.start : p.end].float().transpose(0, 1).unsqueeze(0),
                    v[p.start : p.end].float().transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    enable_gqa=group > 1,
                )
                out[p.start : p.end] = o[0].transpose(0, 1).reshape(-1, kvh, group, d)
                continue
            else:
                if p.blocks is None:  # soft-capped, no context: over the chunk's own k/v
                    if p.mask is None:
                        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
                        p.mask = additive(causal.repeat_interleave(group, dim=0))[None, None]
                    keys = k[p.start : p.end].float().transpose(0, 1).unsqueeze(0)
                    vals = v[p.start : p.end].float().transpose(0, 1).unsqueeze(0)
                else:
                    keys = gather(k_cache, p.blocks).unsqueeze(0)
                    vals = gather(v_cache, p.blocks).unsqueeze(0)
                q_rows = _rows_first(qf[p.start : p.end])
                o, lse = by_token(*_attend(q_rows, keys, vals, p.mask, scale, softcap), n)
            out[p.start : p.end] = o if p.shared_pos is None else with_shared(o, lse, p.shared_pos)
        return out.view(num_tokens, num_heads, d)
