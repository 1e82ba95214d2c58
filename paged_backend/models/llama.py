"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, SmolLM) over a flattened
batch; its pieces also build Gemma (`paged_backend.models.gemma`).

Every step runs one forward over the concatenated new tokens of all scheduled requests; the
attention backend reads earlier tokens from the paged KV cache. Projections are fused (qkv,
gate/up) to keep the op count per layer low: at this model size dispatch overhead dominates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.attention import AttentionBackend, FusedDecode
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.linear import (
    CpuLinear,
    GemmPrefill,
    GemmRows,
    Int4Weight,
    linear_shapes,
    replace_linears_,
)
from paged_backend.cpu.ops import apply_rotary, torch_rms_norm, torch_silu_and_mul
from paged_backend.cpu.quant import QuantLinear, QuantWeight, linear_blocks_f32
from paged_backend.models.config import ModelConfig


@dataclass(frozen=True)
class Ops:
    """The elementwise pieces of a layer: torch ops, fused C ops (bf16 on CPU, see
    `paged_backend.cpu.ops`) or fused Triton kernels (GPU). `rms_norm(x, weight, eps, residual)`
    with a residual returns (normed, x + residual); `rotary` rotates the first
    `cos.shape[-1]` dims of each head (all but for a partial rotary), maybe in place;
    `act_and_mul` is the MLP's gated activation, act(gate) * up. `head_norm` normalizes q and k
    heads [T, heads, head_dim] (Qwen3, Gemma 3): the fused norms take rows [T, hidden] only."""

    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    act_and_mul: Callable[[torch.Tensor], torch.Tensor]
    head_norm: Callable[..., torch.Tensor] = torch_rms_norm


def make_ops(kind: str) -> Ops:
    """`kind`: "torch", "cpu" (the C ops) or "triton"."""
    if kind == "torch":
        return Ops(torch_rms_norm, apply_rotary, torch_silu_and_mul)
    if kind == "cpu":
        return Ops(
            cpu_ops.rms_norm, cpu_ops.rotary_embedding, cpu_ops.silu_and_mul, cpu_ops.head_norm
        )
    from paged_backend.attention.triton import rms_norm, rotary_embedding, silu_and_mul

    return Ops(rms_norm, rotary_embedding, silu_and_mul)


class Linear(nn.Linear):
    """`nn.Linear` with its parameters left as allocated (`torch.empty`): every one is loaded
    from the checkpoint (`load_safetensors` checks), so a random init would be wasted work (over
    a second of a start for the default model's 135M). Steps of up to `c_rows` rows run the C
    fp32 linear (`LlamaForCausalLM.use_f32_linears_`), those of up to `block_rows` on the GGUF
    blocks its weight was dequantized from, with the same bits (`use_f32_blocks_`)."""

    c_rows = 0
    block_rows = 0
    blocks: list[QuantWeight] | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_rows and x.shape[0] <= self.block_rows:  # 0: never
            return linear_blocks_f32(x, self.blocks, self.bias)
        if self.c_rows and x.shape[0] <= self.c_rows:  # 0: never (a step may have no rows)
            return cpu_ops.linear_f32(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """`nn.Embedding` left as allocated, as `Linear`. `out_dtype`: the rows' dtype where the
    table is kept in another (`LlamaForCausalLM.half_head_`)."""

    out_dtype: torch.dtype | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, norm: Callable = torch_rms_norm) -> None:
        """`norm`: an `Ops.rms_norm`-like function of (x, weight, eps, residual)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        return self.norm(x, self.weight, self.eps, residual)


def norm_residual(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    """(norm(x + residual), x + residual); at the first layer, with no residual yet, of x."""
    return (norm(x), x) if residual is None else norm(x, residual)


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """The rotated dims' inverse frequencies, scaled as `config.rope_scaling` says; LongRoPE's
    divided by its short factors (its `long` ones)."""
    dim = config.rotary_dim
    powers = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * powers)
    inv_freq = 1.0 / powers
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


ROPE_CHUNK = 2048  # positions the rotary tables start with; they double from there


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the rotated dims, a row for every position; a step indexes them by each
    token's row (`rows`). Rows are computed as positions are first reached, in chunks of
    `ROPE_CHUNK` * 2^k rows (the same chunks, so the same values, in whatever order a process
    reaches them), up to `max_len`: computed at once, a Gemma 3 270M's two tables of 32,768
    positions by 256 dims took 128 MB, half its Q4_K_M file.

    LongRoPE, as transformers runs it (its factors picked per forward call by the sequence
    length, scaled by the attention factor): rows below the original length take the short
    factors, later ones the long factors, so a sequence whose prompt fits switches for the tokens
    past that length only, its earlier keys staying as they were cached. A sequence whose prompt
    is longer (`ModelConfig.long_rope`) takes the long factors from its first token: its
    positions before the original length read extra rows after `max_len` (these tables are
    computed whole at the start, so that those rows stay where `rows` puts them)."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.long_from = config.long_rope_from
        self.inv_freq = rope_inv_freq(config)
        self.long_inv_freq = None
        self.scale = 1.0
        if self.long_from is not None:
            self.long_inv_freq = rope_inv_freq(config, long=True)
            self.scale = config.rope_scaling["attention_factor"]
        # Plain attributes, not buffers: `model.to(bf16)` must not round the tables.
        self.computed = self._tables(0, 0)  # rows of positions 0 .. capacity - 1
        self.extra = None if self.long_from is None else self._tables(0, self.long_from, True)
        self.cos, self.sin = self.computed
        self.reserve(ROPE_CHUNK if self.extra is None else max_len)

    @property
    def capacity(self) -> int:
        return self.computed[0].shape[0]

    def _tables(self, start: int, stop: int, long: bool = False):
        """(cos, sin) of positions start .. stop - 1: LongRoPE's long factors from `long_from`
        on, or for all of them (`long`)."""
        positions = torch.arange(start, stop, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.long_inv_freq if long else self.inv_freq)
        if self.long_from is not None and not long:
            past = (positions >= self.long_from)[:, None]
            freqs = torch.where(past, torch.outer(positions, self.long_inv_freq), freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale

    def reserve(self, positions: int) -> None:
        """Compute the rows of positions up to `positions` (at most `max_len`) if not yet."""
        wanted = min(positions, self.max_len)
        if wanted <= self.capacity:
            return
        parts = [self.computed]
        capacity = self.capacity
        while capacity < wanted:
            grown = min(self.max_len, max(ROPE_CHUNK, 2 * capacity))
            parts.append(self._tables(capacity, grown))
            capacity = grown
        self.computed = tuple(torch.cat(tables) for tables in zip(*parts, strict=True))
        if self.extra is None:
            self.cos, self.sin = self.computed
        else:
            self.cos, self.sin = (torch.cat(t) for t in zip(self.computed, self.extra, strict=True))

    def rows(self, positions: np.ndarray, long: np.ndarray) -> np.ndarray:
        """The table rows of tokens at `positions`, `long` where their sequence runs LongRoPE's
        long factors throughout."""
        if self.long_from is None:
            return positions
        return np.where(long & (positions < self.long_from), positions + self.max_len, positions)

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if rows.numel() and int(rows.max()) >= self.capacity:  # positions not reached yet
            self.reserve(int(rows.max()) + 1)
        # [T, 1, rotary_dim] so they broadcast over heads.
        return self.cos[rows].unsqueeze(1), self.sin[rows].unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, window: int | None = None) -> None:
        super().__init__()
        self.rotary = ops.rotary
        self.window = window  # sliding-window layer: the keys each token sees
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops.head_norm)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops.head_norm)
        else:
            self.q_norm = self.k_norm = None
        # The backends scale scores by head_dim ** -0.5; a model scaling them by
        # query_pre_attn_scalar ** -0.5 instead (Gemma) gets the ratio on its queries.
        scalar = config.query_pre_attn_scalar
        self.q_scale = 1.0 if scalar is None else (config.head_dim / scalar) ** 0.5
        self.softcap = config.attn_logit_softcap  # Gemma 2: the backend caps the scores

    def forward(self, x, cos, sin, kv_cache, backend: AttentionBackend, meta) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # rotate q and k heads together: half the ops
            qk = qkv[:, : self.q_size + self.kv_size].view(
                -1, self.num_heads + self.num_kv_heads, self.head_dim
            )
            q, k = self.rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(
                    -1, self.num_kv_heads, self.head_dim
                )
            )
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = backend.forward(q, k, v, kv_cache, meta, self.window, self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))


# On CPU a step's MLP runs in slices of rows whose gate/up activations take at most this many
# bytes: a 2,048-token prefill of a 1B model held 134 MB of them (fp32) at once, a peak of the
# process's resident memory above its weights and KV cache. Each row's result is the same. 16 MiB
# rather than 32: Gemma 3 270M Q4_K_M, 32 x ~250 tokens, peak -87 MB at 8 (AVX2). 16 rather than
# 8: on an AMX Xeon the default model's 2,048-row forwards ran their MLP in one slice instead of
# two of 1,024 rows, a row count oneDNN runs its down projection at half the rate of 2,048, and
# prefilled 32 distinct prompts 1.07x faster, Qwen2.5-0.5B's bf16 checkpoint 1.06x (with the C
# GEMM taking the row counts where oneDNN is slow: `kernel_choice.gemm_prefill_counts`).
MLP_SLICE_BYTES = 16 << 20


class MLP(nn.Module):
    """`down_hadamard`: 0, or the block size of the Hadamard rotation the down projection's
    inputs take first, where its weight was rotated to match (`models.rotation`)."""

    down_hadamard = 0

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.act_and_mul = ops.act_and_mul
        bias = config.mlp_bias
        self.gate_up_width = 2 * config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, self.gate_up_width, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return self._rows(x, fused=False)
        # quantized gate/up products that never leave their kernel (AMX): a slice's bytes are
        # then its act(gate) * up, half as many
        fused = (
            isinstance(self.gate_up_proj, QuantLinear)
            and self.act_and_mul in cpu_ops.GELU
            and self.gate_up_proj.fuses_act_and_mul(x)
        )
        width = self.gate_up_width // (2 if fused else 1)
        most = max(1, MLP_SLICE_BYTES // (width * x.element_size()))
        if x.shape[0] <= most:
            return self._rows(x, fused)
        # slices of equal size: Qwen2.5-0.5B's 512-token forwards had run as 431 + 81 rows
        size = -(-x.shape[0] // -(-x.shape[0] // most))
        return torch.cat([self._rows(x[i : i + size], fused) for i in range(0, x.shape[0], size)])

    def _rows(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        if fused:
            hidden = self.gate_up_proj.act_and_mul(x, cpu_ops.GELU[self.act_and_mul])
        else:
            hidden = self.act_and_mul(self.gate_up_proj(x))
        if self.down_hadamard:
            cpu_ops.hadamard_(hidden, self.down_hadamard)
        return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.rms_norm)
        self.self_attn = Attention(config, ops, window)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, ops.rms_norm
        )
        self.mlp = MLP(config, ops)

    def forward(self, x, residual, cos, sin, kv_cache, backend, meta):
        """(this layer's output, the residual stream before it): the residual add is left to
        the next norm, which fuses it. `residual` is None at the first layer."""
        h, residual = norm_residual(self.input_layernorm, x, residual)
        x = self.self_attn(h, cos, sin, kv_cache, backend, meta)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual

    def sublayer_norms(self) -> tuple[RMSNorm | None, RMSNorm, RMSNorm | None]:
        """The norm of attention's output (None: none), the MLP's input norm (which adds the
        residual), the norm of the MLP's output (None: none), for `FusedDecode`."""
        return None, self.post_attention_layernorm, None


class LlamaForCausalLM(nn.Module):
    """`ops` ("torch", "cpu" or "triton", see `make_ops`) picks who runs RMSNorm, rotary and
    SiLU-and-mul. A family built from these pieces (Gemma) sets its `layer_class` and
    `family_ops`, and may scale embeddings (`embed`), cap logits (`logits`) and give its
    sliding-window layers their own rope tables (`local_rotary`)."""

    layer_class: type[DecoderLayer] = DecoderLayer

    @staticmethod
    def family_ops(kind: str) -> Ops:
        """The family's elementwise ops of the chosen kind."""
        return make_ops(kind)

    def __init__(self, config: ModelConfig, max_len: int, ops: str = "torch") -> None:
        super().__init__()
        self.config = config
        ops = self.family_ops(ops)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        windows = config.layer_windows or (None,) * config.num_layers
        self.layers = nn.ModuleList(self.layer_class(config, ops, w) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.rms_norm)
        self.rotary = RotaryEmbedding(config, max_len)
        self.local_rotary: RotaryEmbedding | None = None
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cpu_head: CpuLinear | QuantLinear | None = None
        self.head_c_rows = 0  # steps of up to this many rows: `cpu_ops.linear_f32`
        self.head_blocks: list[QuantWeight] | None = None  # and up to head_block_rows: these
        self.head_block_rows = 0
        # set by `use_cpu_linears_` / `use_f32_linears_` where it fits
        self.fused_decode: FusedDecode | None = None
        # (the final norm's weight, a Hadamard block) of a rotated model (`models.rotation`):
        # its final rows x go to the head as H (weight * (H x))
        self.head_rotation: tuple[torch.Tensor, int] | None = None

    def use_cpu_linears_(
        self,
        pack: bool,
        fp16_copy: bool,
        int4: dict[str, Int4Weight] | None = None,
        gemm_rows: GemmRows | None = None,
        gemm_prefill: GemmPrefill | None = None,
    ) -> None:
        """Run every projection and the output head through `CpuLinear` (packed bf16 weights,
        a copy for small steps: fp16, or with `gemm_rows` bf16 for `cpu_ops.gemm` up to that
        many rows per weight shape, and for the layers' prefill steps `gemm_prefill` gives;
        int4 copies of the layers from `quantize_linears_int4(self.layers)`); call after the
        weights are loaded and cast. A tied head gets its own copy: the embedding table stays as
        it is for lookups."""
        replace_linears_(self.layers, pack, fp16_copy, int4, gemm_rows, gemm_prefill)
        weight = self._head_weight()
        rows = None if gemm_rows is None else gemm_rows[tuple(weight.shape)]
        self.cpu_head = CpuLinear(weight, None, pack, fp16_copy, gemm_rows=rows)
        self.lm_head = None  # an untied head's weight lives on in `cpu_head`
        self.fuse_decode_()

    def fuse_decode_(self) -> None:
        """Decode steps through every layer in one C call where `FusedDecode` fits (call once
        the linears are final)."""
        self.fused_decode = FusedDecode.build(self)

    def use_f32_linears_(self, rows: dict[tuple[int, int], int]) -> None:
        """Run steps of up to `rows[shape]` rows of each fp32 projection and of the output head
        through `cpu_ops.linear_f32` (timed against torch by `kernel_choice.f32_max_rows`). The
        weights are used as they are: no copy."""
        for module in self.layers.modules():
            if isinstance(module, Linear) and cpu_ops.linear_f32_fits(module.weight):
                module.c_rows = rows[tuple(module.weight.shape)]
        head = self._head_weight()
        if head is not None and cpu_ops.linear_f32_fits(head):
            self.head_c_rows = rows[tuple(head.shape)]
        self.fuse_decode_()

    def use_f32_blocks_(
        self,
        blocks: dict[str, list[QuantWeight]],
        timed: Callable[[set[tuple[str, int, int]]], dict[tuple[str, int, int], int]],
    ) -> None:
        """Give the fp32 linears that `blocks` holds the GGUF blocks their weights were
        dequantized from (`gguf.weights.exact_f32_blocks`; "lm_head": a tied head's): steps of
        up to `timed(keys)[(format, *shape)]` rows of those that run `cpu_ops.linear_f32` read
        them instead (`quant.linear_blocks_f32`: the same bits from 0.56-1.06 bytes a weight,
        not 4; `kernel_choice.f32_block_max_rows` times them). After `use_f32_linears_`."""

        def key(parts: list[QuantWeight]) -> tuple[str, int, int]:
            return parts[0].format, sum(p.out_features for p in parts), parts[0].in_features

        rows = timed({key(parts) for parts in blocks.values()})
        for name, weights in blocks.items():
            if name == "lm_head" and self._head_weight() is not None:
                self.head_blocks = weights
                self.head_block_rows = min(self.head_c_rows, rows[key(weights)])
            elif name != "lm_head":
                module = self.get_submodule(name)
                if isinstance(module, Linear) and module.c_rows:
                    module.blocks = weights
                    module.block_rows = min(module.c_rows, rows[key(weights)])
        self.fuse_decode_()

    def half_head_(self) -> None:
        """Keep a float head whose values are all fp16's (a GPTQ / AWQ file's, a GGUF file's F16
        tensor) in fp16, read by `cpu_ops.linear_f32` at half the bytes with the bits of its fp32
        values; a tied embedding then looks its rows up in the same fp16 table. For an fp32
        model on the C kernels, before `use_f32_linears_`."""
        weight = self._head_weight()
        if weight is None or weight.dtype != torch.float32 or not cpu_ops.linear_f32_fits(weight):
            return
        half = weight.half()
        step = max(1, (1 << 22) // weight.shape[1])  # rows compared at once
        for start in range(0, len(weight), step):
            if not torch.equal(half[start : start + step].float(), weight[start : start + step]):
                return
        table = self.embed_tokens if self.lm_head is None else self.lm_head
        table.weight = nn.Parameter(half, requires_grad=False)
        if self.lm_head is None:
            self.embed_tokens.out_dtype = torch.float32

    def _head_weight(self) -> torch.Tensor | None:
        """The float weight the head multiplies by (None: `cpu_head` runs it)."""
        if self.cpu_head is not None:
            return None
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def linear_shapes(self) -> set[tuple[int, int]]:
        """The weight shapes of the float projections and output head."""
        head = self._head_weight()
        return linear_shapes(self.layers) | (set() if head is None else {tuple(head.shape)})

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The final hidden rows (normed) of `logits_indices` only, the rest are never sampled,
        for `logits`. `positions`: each token's row in the rotary tables
        (`RotaryEmbedding.rows`)."""
        x = self.embed(input_ids)

        def tables(rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rotary(positions)
            return cos.to(x.dtype), sin.to(x.dtype)

        rope = tables(self.rotary)
        local = rope if self.local_rotary is None else tables(self.local_rotary)
        fused = self.fused_decode and self.fused_decode.plan(meta, x.shape[0])
        if fused:
            x, residual = self.fused_decode(x, rope, local, kv_caches, fused, backend, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                cos, sin = rope if layer.self_attn.window is None else local
                x, residual = layer(x, residual, cos, sin, kv_cache, backend, meta)
        x, _ = self.norm(x[logits_indices], residual[logits_indices])
        if self.head_rotation is not None:
            weight, block = self.head_rotation
            rows = cpu_ops.hadamard_(x.float(), block).mul_(weight)
            x = cpu_ops.hadamard_(rows, block).to(x.dtype)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input rows of tokens `input_ids`."""
        return self.embed_tokens(input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden rows `x`, in fp32."""
        if self.cpu_head is not None:
            return self.cpu_head(x, out_dtype=torch.float32)
        if self.head_block_rows and x.shape[0] <= self.head_block_rows:
            return linear_blocks_f32(x, self.head_blocks, None)
        weight = self._head_weight()
        if weight.dtype == torch.float16 or (self.head_c_rows and x.shape[0] <= self.head_c_rows):
            return cpu_ops.linear_f32(x, weight, None)  # an fp16 head (`half_head_`) at any size
        return F.linear(x, weight).float()

    def logits_argmax(self, x: torch.Tensor, columns: int) -> torch.Tensor | None:
        """Each row's `logits(x)[:, :columns].argmax(-1)`, where the head gives it without the
        whole logits (`QuantLinear.argmax`, `CpuLinear.argmax`); else None."""
        if self.cpu_head is not None:
            return self.cpu_head.argmax(x, columns)
        return None

    def checkpoint_name_map(self, name: str) -> tuple[str, int | None, tuple | None] | None:
        """Map a Hugging Face checkpoint tensor name onto ours (fusing qkv and gate/up): our
        parameter's name, and the shard of it the tensor fills (`param_shard`)."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        if "rotary_emb" in name:
            return None
        m = re.fullmatch(r"(layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)", name)
        if m:
            attn = self.layers[0].self_attn
            sizes = (attn.q_size, attn.kv_size, attn.kv_size)
            return f"{m[1]}qkv_proj.{m[3]}", "qkv".index(m[2]), sizes
        m = re.fullmatch(r"(layers\.\d+\.mlp\.)(gate|up)_proj\.(weight|bias)", name)
        if m:
            size = self.config.intermediate_size
            return f"{m[1]}gate_up_proj.{m[3]}", ("gate", "up").index(m[2]), (size, size)
        return name, None, None


def param_shard(param: torch.Tensor, shard: int | None, sizes) -> torch.Tensor:
    """The rows of a fused parameter that shard `shard` of `sizes` fills (all of it for None),
    as `LlamaForCausalLM.checkpoint_name_map` names them: here, beside that map, so that both
    weight loaders (safetensors, GGUF) read its shards one way."""
    return param if shard is None else param.narrow(0, sum(sizes[:shard]), sizes[shard])
