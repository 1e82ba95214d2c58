"""Gemma 2 and Gemma 3 (text) decoders over a flattened batch: the Llama layer of
`paged_backend.models.llama` (fused qkv and gate/up projections, the attention backends, the CPU
linears) with Gemma's differences, after transformers' `modeling_gemma2` and `modeling_gemma3`:

- embeddings scaled by sqrt(hidden_size), that factor rounded to the model dtype first;
- RMSNorm times (1 + weight), computed in fp32 and rounded once (`torch_rms_norm`'s `offset`),
  also on the q and k heads (Gemma 3);
- a sandwich of four norms per layer: each sublayer's output is normed again before its residual
  add (`GemmaDecoderLayer`);
- GeGLU (gelu, tanh approximation) in the MLP;
- scores scaled by `query_pre_attn_scalar ** -0.5` (`Attention.q_scale`);
- sliding-window layers interleaved with global ones, in Gemma 3 on their own rope base;
- soft-capped attention scores (Gemma 2, applied by the attention backends) and final logits.

On the C ops (`cpu_ops`) norms and GeGLU run as C ops too, so decode steps run in one C call
(`FusedDecode`); on the others, as torch ops (the Triton ones implement Llama's norm and SiLU).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.ops import torch_gelu_tanh_and_mul, torch_rms_norm
from paged_backend.models.config import ModelConfig
from paged_backend.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    Ops,
    RMSNorm,
    RotaryEmbedding,
    make_ops,
    norm_residual,
)

torch_gemma_rms_norm = partial(torch_rms_norm, offset=1.0)


def softcap_(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """x, made tanh(x / cap) * cap in place: values squashed smoothly into (-cap, cap); x as it
    is where `cap` is None. In place because x is a step's fp32 logits: 32 rows over Gemma's
    262,144-token vocabulary are 34 MB, and each out-of-place op held another copy at once."""
    return x if cap is None else x.div_(cap).tanh_().mul_(cap)


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

    def sublayer_norms(self) -> tuple[RMSNorm | None, RMSNorm, RMSNorm | None]:
        return (
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text models (`Gemma3ForCausalLM`); loads,
    packs and runs its linears as `LlamaForCausalLM` does, and its decode steps in one C call
    (`FusedDecode`) where Llama's would."""

    layer_class = GemmaDecoderLayer

    @staticmethod
    def family_ops(kind: str) -> Ops:
        if kind == "cpu":
            norm, head_norm = cpu_ops.gemma_rms_norm, cpu_ops.gemma_head_norm
            act = cpu_ops.gelu_tanh_and_mul
        else:
            norm = head_norm = torch_gemma_rms_norm
            act = torch_gelu_tanh_and_mul
        return replace(make_ops(kind), rms_norm=norm, head_norm=head_norm, act_and_mul=act)

    def __init__(self, config: ModelConfig, max_len: int, ops: str = "torch") -> None:
        super().__init__(config, max_len, ops)
        local = config.local_rope_theta
        if local is not None:
            self.local_rotary = RotaryEmbedding(
                replace(config, rope_theta=local, rope_scaling=None), max_len
            )
        # A buffer, so that casting the model rounds it as transformers does (sqrt(1152) =
        # 33.94 is 34.0 in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return softcap_(super().logits(x), self.config.final_logit_softcap)

    def logits_argmax(self, x: torch.Tensor, columns: int) -> torch.Tensor | None:
        # a cap can round distinct logits to one value, whose first then wins
        if self.config.final_logit_softcap is not None:
            return None
        return super().logits_argmax(x, columns)
