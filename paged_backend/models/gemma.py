"""Gemma 2 and Gemma 3 (text) decoders over a flattened batch: the Llama layer of
`paged_backend.models.llama` (fused qkv and gate/up projections, the attention backends, the CPU
linears) with Gemma's differences, after transformers' `modeling_gemma2` and `modeling_gemma3`:

- embeddings scaled by sqrt(hidden_size), that factor rounded to the model dtype first;
- RMSNorm times (1 + weight), computed in fp32 and rounded once (`gemma_rms_norm`), also on the
  q and k heads (Gemma 3);
- a sandwich of four norms per layer: each sublayer's output is normed again before its residual
  add (`GemmaDecoderLayer`);
- GeGLU (gelu, tanh approximation) in the MLP;
- scores scaled by `query_pre_attn_scalar ** -0.5` (`Attention.q_scale`);
- sliding-window layers interleaved with global ones, in Gemma 3 on their own rope base;
- soft-capped attention scores (Gemma 2, applied by the attention backends) and final logits.

Norm and GeGLU run as torch ops on every kind of `Ops`: the fused C and Triton ones implement
Llama's norm and SiLU; rotary, attention and the linears take the fast paths.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from paged_backend.attention import AttentionBackend
from paged_backend.models.config import ModelConfig
from paged_backend.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    Ops,
    RMSNorm,
    RotaryEmbedding,
    norm_residual,
)


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """RMSNorm times (1 + weight) in fp32, rounded once to x's dtype: Gemma stores its norm
    weights as offsets from 1. With `residual`, of h = x + residual, returning (normed, h) like
    `torch_rms_norm`."""
    h = x if residual is None else x + residual
    normed = F.rms_norm(h.float(), weight.shape, 1.0 + weight.float(), eps).to(h.dtype)
    return normed if residual is None else (normed, h)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU of fused rows [T, 2 * dim] (gate | up), transformers' `gelu_pytorch_tanh`."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap: values squashed smoothly into (-cap, cap); x where `cap` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaDecoderLayer(DecoderLayer):
    """Each sublayer's output is normed (post_attention, post_feedforward) before its residual
    add. The add still fuses into the norm that follows it, as in Llama's layer: the attention
    output's into pre_feedforward_layernorm, the MLP output's into the next layer's input norm."""

    def __init__(self, config: ModelConfig, ops: Ops, window: int | None = None) -> None:
        super().__init__(config, ops, window)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops.rms_norm)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops.rms_norm)

    def forward(self, x, residual, cos, sin, kv_cache, backend, meta):
        """(this layer's output, the residual stream before it), as `DecoderLayer.forward`."""
        h, residual = norm_residual(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, backend, meta))
        h, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text models (`Gemma3ForCausalLM`); loads,
    packs and runs its linears as `LlamaForCausalLM` does."""

    layer_class = GemmaDecoderLayer

    @staticmethod
    def family_ops(ops: Ops) -> Ops:
        return replace(
            ops, rms_norm=gemma_rms_norm, head_norm=gemma_rms_norm, act_and_mul=gelu_tanh_and_mul
        )

    def __init__(self, config: ModelConfig, max_len: int, ops: str = "torch") -> None:
        super().__init__(config, max_len, ops)
        local = config.local_rope_theta
        self.local_rotary = (
            None
            if local is None
            else RotaryEmbedding(replace(config, rope_theta=local, rope_scaling=None), max_len)
        )
        # A buffer, so that casting the model rounds it as transformers does (sqrt(1152) =
        # 33.94 is 34.0 in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (fp32) for the rows of `logits_indices` only. Sliding-window layers take the
        local rope tables where the model has them."""
        x = self.embed_tokens(input_ids) * self.embed_scale

        def tables(rotary: RotaryEmbedding) -> list[torch.Tensor]:
            return [t.to(x.dtype) for t in rotary(positions)]

        rope = tables(self.rotary)
        local = rope if self.local_rotary is None else tables(self.local_rotary)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = rope if layer.self_attn.window is None else local
            x, residual = layer(x, residual, cos, sin, kv_cache, backend, meta)
        x, _ = self.norm(x[logits_indices], residual[logits_indices])
        return softcap(self.logits(x), self.config.final_logit_softcap)
