"""Gemma 2's and Gemma 3's `ModelConfig` fields, from transformers' config (which resolves
Gemma 3's per-layer-type rope parameters and its sliding/global interleaving)."""

from __future__ import annotations

from pathlib import Path

from paged_backend.models.llama_config import rope_scaling_of

# Gemma 2 and text-only Gemma 3: `paged_backend.models.gemma`
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def gemma_fields(text_config, arch: str, config_file: Path) -> dict:
    """Gemma 2's or Gemma 3's `ModelConfig` fields, from transformers' config. Gemma 3's reads
    both the old `rope_theta`/`rope_local_base_freq`/`rope_scaling` keys and `rope_parameters`
    per layer type: its global layers take `rope_theta` and its scaling, the sliding ones the
    local base. Gemma 2 has one rope, no q/k norms, and soft-caps attention scores (Gemma 3's
    modules ignore `attn_logit_softcapping`)."""
    activation = text_config.hidden_activation
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {activation!r} in {config_file}")
    if getattr(text_config, "use_bidirectional_attention", False):
        raise ValueError(f"unsupported bidirectional attention in {config_file}")
    gemma3 = arch == "Gemma3ForCausalLM"
    rope = text_config.rope_parameters
    glob, local = (rope["full_attention"], rope["sliding_attention"]) if gemma3 else (rope, None)
    if local and rope_scaling_of(local, config_file, ()) is not None:
        raise ValueError(f"unsupported rope scaling on sliding layers in {config_file}")
    if any(r.get("partial_rotary_factor", 1.0) != 1.0 for r in (glob, local) if r):
        raise ValueError(f"unsupported partial rotary factor in {config_file}")
    bias = bool(text_config.attention_bias)
    return dict(
        rope_theta=float(glob["rope_theta"]),
        rope_scaling=rope_scaling_of(glob, config_file, ("llama3", "linear")),
        local_rope_theta=float(local["rope_theta"]) if local else None,
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=gemma3,
        query_pre_attn_scalar=float(text_config.query_pre_attn_scalar),
        final_logit_softcap=text_config.final_logit_softcapping,
        attn_logit_softcap=None if gemma3 else text_config.attn_logit_softcapping,
    )
