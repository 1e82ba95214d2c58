"""A decode step through every layer in one C call (`decode_layers` in `csrc/decode_layers.c`,
on the fp32 or the bf16 C ops).

At one row a step of the default model runs ~270 ops (norms, four linears, rotary, attention and
SiLU per layer), each a Python call of 10-20 us: ~5 ms of overhead beside ~8 ms of weight reads.
Steps of decodes only (with their drafts being verified: up to 1 + `num_speculative_tokens` rows
a sequence), whose linears all run in C (GGUF blocks, the C fp32 linear, or bf16's C GEMM on
AVX512-BF16), call the same C ops in the same order from C instead, with the same arguments: the
outputs are the same bits. A shared prefix's cascade runs as `TorchAttention` runs it (its
packed K/V copies come from the backend, kept across steps; bf16 on AVX512-BF16 only: other
steps with one run the modules). Everything else (longer prefill chunks, steps too large for
the C linears, torch's elementwise ops) runs the modules. Llama's
layers and those of the families built on them take it (Qwen3's q/k norms, Gemma's sandwich
norms, GeGLU and local rope tables), where each elementwise op is a C op the step knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_backend import cpu
from paged_backend.attention.backend import AttentionMetadata
from paged_backend.attention.planner import CDecodePlan
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.quant import ROW_SCALES, QuantLinear, activation_stride, dequantize_work

if TYPE_CHECKING:
    from paged_backend.attention.torch_backend import TorchAttention


MAX_PARTS = 3  # weights side by side in one fp32 linear descriptor (q, k, v)
# Steps of up to this many rows (the default max_num_seqs) run fused through quantized linears:
# the 1B Q4_K_M file's decode step on an AMX Xeon at 96 rows 224-260 -> 197-215 ms, at 128
# 261-281 -> 227-254 with the cap raised from 64 (docs/benchmark.md, ninth of 12-07).
QUANT_MAX_ROWS = 128
# The C ops the step runs, and its arguments for them: each norm's weight offset, GeGLU or not.
NORM_OFFSETS = {cpu_ops.rms_norm: 0.0, cpu_ops.gemma_rms_norm: 1.0}
HEAD_NORM_OFFSETS = {cpu_ops.head_norm: 0.0, cpu_ops.gemma_head_norm: 1.0}


class FusedDecode:
    """Built once per model (`build`); `plan` says whether a step can run fused."""

    def __init__(self, model: nn.Module, f32: bool) -> None:
        config = model.config
        self.f32 = f32
        self.layers = model.layers
        self.hidden = config.hidden_size
        self.intermediate = config.intermediate_size
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim
        self.eps = config.rms_norm_eps
        self.bias_copies: list[torch.Tensor] = []  # (`_fp32_bias`) alive as long as the words
        linears = [self._linears(layer) for layer in model.layers]
        self.max_rows = min(self._rows(lin) for layer in linears for lin in layer)
        words = [self._layer_words(*pair) for pair in zip(model.layers, linears, strict=True)]
        self.weights = torch.tensor(words, dtype=torch.int64)
        # Steps of up to block_rows rows read an fp32 model's GGUF blocks where every layer
        # linear has them (`Linear.blocks`: the same bits, fewer bytes).
        self.block_rows = min(getattr(lin, "block_rows", 0) for layer in linears for lin in layer)
        self.block_weights = None
        if self.block_rows:
            words = [
                self._layer_words(*pair, blocks=True)
                for pair in zip(model.layers, linears, strict=True)
            ]
            self.block_weights = torch.tensor(words, dtype=torch.int64)
        first = model.layers[0]
        self.norm_offset = NORM_OFFSETS[first.input_layernorm.norm]
        self.gelu = cpu_ops.GELU[first.mlp.act_and_mul]
        attn = first.self_attn
        self.q_scale, self.softcap = attn.q_scale, attn.softcap or 0.0
        # floats a row of the fused step's quantized activations takes (a byte a level of the
        # widest input's row, a float scale a 32, an int16 level sum a 16)
        self.widest = max(self.hidden, config.num_heads * self.head_dim, self.intermediate)
        self.act_per_row = activation_stride(self.widest) * 5 // 16
        windows = [layer.self_attn.window or 0 for layer in model.layers]
        self.windows = torch.tensor(windows, dtype=torch.int64)
        self.caches: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _layer_words(self, layer: nn.Module, linears: tuple, blocks: bool = False) -> list[int]:
        """A layer's words for `decode_layers` (`LAYER_WORDS` in `csrc/decode_layers.c`)."""

        def address(norm: nn.Module | None) -> int:
            return 0 if norm is None else norm.weight.data_ptr()

        qkv, o, gate_up, down = linears
        attn_out, mlp_in, mlp_out = layer.sublayer_norms()
        return [
            address(layer.input_layernorm),
            address(layer.self_attn.q_norm),
            address(layer.self_attn.k_norm),
            *self._pointers(qkv, blocks),
            *self._pointers(o, blocks),
            address(attn_out),
            address(mlp_in),
            *self._pointers(gate_up, blocks),
            *self._pointers(down, blocks),
            address(mlp_out),
            layer.mlp.down_hadamard,
        ]

    @staticmethod
    def _linears(layer: nn.Module) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def _rows(self, linear: nn.Module) -> int:
        if isinstance(linear, QuantLinear):  # past its int8 rows, the dequantized GEMM
            return QUANT_MAX_ROWS
        return linear.c_rows if self.f32 else linear.gemm_rows

    def _pointers(self, linear: nn.Module, blocks: bool = False) -> list[int]:
        """The linear's descriptor for `fused_linear` in `csrc/decode_layers.c`: parts, bias, the
        most rows a quantized linear's int8 product takes (`QuantLinear.int8_max_rows`; more bf16
        rows dequantize), each part's type, address, outputs and row bytes; type 0 a float weight
        (fp32: the weight; bf16: the C GEMM's packed copy), a GGUF block type for a quantized
        linear (with `ROW_SCALES` for `row_scales` weights), minus one for an fp32 linear's
        blocks (`blocks`: `Linear.blocks`)."""
        if isinstance(linear, QuantLinear) or blocks:
            sign = -1 if blocks else 1
            parts = [
                (
                    sign * w.type_id | (ROW_SCALES if w.row_scales else 0),
                    w.data.data_ptr(),
                    w.out_features,
                    w.data.stride(0),
                )
                for w in (linear.blocks if blocks else linear.weights)
            ]
        elif self.f32:
            weight = linear.weight
            parts = [(0, weight.data_ptr(), weight.shape[0], weight.stride(0) * 4)]
        else:
            parts = [(0, linear.gemm.data_ptr(), linear.gemm.shape[0] * 16, 0)]
        bias = 0 if linear.bias is None else self._fp32_bias(linear).data_ptr()
        int8_rows = getattr(linear, "int8_max_rows", None)
        words = [len(parts), bias, QUANT_MAX_ROWS if int8_rows is None else int8_rows]
        for part in parts + [(0, 0, 0, 0)] * (MAX_PARTS - len(parts)):
            words.extend(part)
        return words

    def _fp32_bias(self, linear: nn.Module) -> torch.Tensor:
        """The linear's bias in fp32, as `fused_linear` reads it (a bf16 model's: a copy, kept
        here; the same values)."""
        bias = linear.bias.detach()
        if bias.dtype != torch.float32:
            bias = bias.float()
            self.bias_copies.append(bias)
        return bias

    @staticmethod
    def _fits(linear: nn.Module, f32: bool) -> bool:
        """Whether the fused step can run this linear: quantized weights of up to `MAX_PARTS`
        parts, an fp32 weight the C fp32 linear serves, or a bf16 one with a C GEMM copy
        (AVX512-BF16)."""
        if isinstance(linear, QuantLinear):
            return len(linear.weights) <= MAX_PARTS
        if f32:
            return bool(getattr(linear, "c_rows", 0))
        return getattr(linear, "gemm", None) is not None

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode | None:
        """For a model whose elementwise ops are the C ones the step knows (`NORM_OFFSETS`,
        `HEAD_NORM_OFFSETS`, `cpu_ops.GELU`) and whose layer linears all run in C: an fp32
        model's on the C fp32 linear or on GGUF blocks, a bf16 one's on C GEMM copies
        (AVX512-BF16) or GGUF blocks, biases or not; else None."""
        f32 = model.norm.weight.dtype == torch.float32
        for layer in model.layers:
            norms = [layer.input_layernorm, *filter(None, layer.sublayer_norms())]
            offsets = [NORM_OFFSETS.get(norm.norm) for norm in norms]
            attn = layer.self_attn
            for head in filter(None, (attn.q_norm, attn.k_norm)):
                offsets.append(HEAD_NORM_OFFSETS.get(head.norm))
            if (
                None in offsets
                or len(set(offsets)) != 1
                or layer.mlp.act_and_mul not in cpu_ops.GELU
                or not all(cls._fits(linear, f32) for linear in cls._linears(layer))
            ):
                return None
        return cls(model, f32)

    def plan(self, meta: AttentionMetadata, rows: int) -> CDecodePlan | None:
        """The step's decode plan when every layer's is the C decode kernel's (decodes only)
        and the GEMM copies serve this many rows: the global layers' (which holds the shared
        prefix, if any) where there are some."""
        if rows > self.max_rows:
            return None
        # (another backend's step, the Triton one's under the interpreter, has no per-window
        # plans at all)
        plans = meta.prepared
        if not isinstance(plans, dict) or not all(
            isinstance(p, CDecodePlan) for p in plans.values()
        ):
            return None
        return plans.get(None) or next(iter(plans.values()))

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        local: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        plan: CDecodePlan,
        backend: TorchAttention,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream before it) for embeddings `x`
        [rows, hidden] (the model's dtype, contiguous, overwritten), and the rows' cos/sin
        tables: `rope`, and `local` for the sliding-window layers."""
        rows = x.shape[0]
        k_ptrs, v_ptrs = self._cache_pointers(kv_caches)
        q_size = self.num_heads * self.head_dim
        qkv_width = q_size + 2 * self.num_kv_heads * self.head_dim
        work = torch.empty(
            rows * (self.hidden + qkv_width + q_size + 3 * self.intermediate), dtype=x.dtype
        )
        residual = torch.empty_like(x)
        act = torch.empty(rows * self.act_per_row)
        threads = plan.scratch.shape[0]
        starts = plan.query_start
        if starts is None:
            starts = torch.arange(rows + 1, dtype=torch.int32)
        cos, sin, local_cos, local_sin = (t.reshape(rows, -1).contiguous() for t in rope + local)
        cascade, _alive = self._cascade(plan, backend, kv_caches, meta.block_size)
        tables = cpu_ops.kernel_blocks(plan.block_tables, self.num_kv_heads)
        cpu.load_library().decode_layers(
            x=x.data_ptr(),
            residual=residual.data_ptr(),
            bf16_io=int(not self.f32),
            rows=rows,
            hidden=self.hidden,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            local_cos=local_cos.data_ptr(),
            local_sin=local_sin.data_ptr(),
            num_layers=len(self.layers),
            weights=(self.block_weights if rows <= self.block_rows else self.weights).data_ptr(),
            k_caches=k_ptrs.data_ptr(),
            v_caches=v_ptrs.data_ptr(),
            kv_half=int(kv_caches[0][0].dtype == torch.float16),
            cache_head_stride=kv_caches[0][0].stride(1),
            windows=self.windows.data_ptr(),
            block_tables=tables.data_ptr(),
            max_blocks=tables.shape[1],
            seq_lens=plan.seq_lens.data_ptr(),
            query_start=starts.data_ptr(),
            num_seqs=len(plan.seq_lens),
            block_size=meta.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rot_dim=self.rotary_dim,
            intermediate=self.intermediate,
            eps=self.eps,
            norm_offset=self.norm_offset,
            gelu=int(self.gelu),
            q_scale=self.q_scale,
            scale=self.head_dim**-0.5,
            softcap=self.softcap,
            work=work.data_ptr(),
            act=act.data_ptr(),
            dequantized=0 if self.f32 else dequantize_work(threads, self.widest).data_ptr(),
            scores=plan.scratch.data_ptr(),
            scores_stride=plan.scratch.shape[1],
            threads=threads,
            **cascade,
        )
        return x, residual

    def _cascade(
        self, plan: CDecodePlan, backend, kv_caches, block_size: int
    ) -> tuple[dict, tuple]:
        """The cascade's arguments for `decode_layers` (and the tensors they point into, kept
        alive by the caller): each global layer's packed prefix from the backend's kept
        copies, the shared rows, and work space; nothing without a shared prefix."""
        shared = plan.shared
        if shared is None:
            args = dict(prefix_k=None, prefix_v=None, prefix_len=0, shared_rows=None)
            return dict(args, num_shared=0, prefix_pos=None, prefix_work=None), ()
        packs = [
            None
            if layer.self_attn.window
            else backend.prefix_copy(
                kv[0], lambda kv=kv: cpu_ops.pack_prefix(kv, shared.blocks, block_size)
            )
            for layer, kv in zip(self.layers, kv_caches, strict=True)
        ]
        k = torch.tensor([0 if p is None else p[0].data_ptr() for p in packs], dtype=torch.int64)
        v = torch.tensor([0 if p is None else p[1].data_ptr() for p in packs], dtype=torch.int64)
        length = len(shared.blocks) * block_size
        num_shared = len(shared.rows)
        rows4 = -(-num_shared * (self.num_heads // self.num_kv_heads) // 4) * 4
        per_head = rows4 * self.head_dim
        floats = self.num_kv_heads * (per_head + rows4 + per_head // 2)  # q rows as bf16 pairs
        floats += torch.get_num_threads() * cpu_ops.PREFIX_WORK * cpu_ops.padded_length(length)
        work = torch.empty(floats)
        rows = shared.rows.to(torch.int64).contiguous()
        args = dict(
            prefix_k=k.data_ptr(),
            prefix_v=v.data_ptr(),
            prefix_len=length,
            shared_rows=rows.data_ptr(),
            num_shared=num_shared,
            prefix_pos=plan.prefix_pos.data_ptr(),
            prefix_work=work.data_ptr(),
        )
        return args, (packs, k, v, rows, work)

    def _cache_pointers(self, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's K and V cache addresses, computed once: the caches never move."""
        key = kv_caches[0][0].data_ptr()
        if self.caches is None or self.caches[0] != key:
            k = torch.tensor([kc.data_ptr() for kc, _ in kv_caches], dtype=torch.int64)
            v = torch.tensor([vc.data_ptr() for _, vc in kv_caches], dtype=torch.int64)
            self.caches = (key, k, v)
        return self.caches[1], self.caches[2]
