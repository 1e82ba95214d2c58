"""The Llama family's (Llama, Mistral, Qwen2/3, Phi-3) `ModelConfig` fields, from config.json.

Here and not in `paged_backend.models.config` so that each family's quirks sit with the family;
Gemma reuses the rope-scaling check (`rope_scaling_of`).
"""

from __future__ import annotations

import math
from pathlib import Path

LLAMA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Phi-3, Phi-4: fused qkv and gate_up in the checkpoint, as ours
)


def rope_scaling_of(scaling: dict, config_file: Path, types: tuple[str, ...]) -> dict | None:
    """`scaling` (a `rope_scaling` or `rope_parameters` dict) with its `rope_type` where it is
    one of `types`, the scalings our modules implement for the family (without the base,
    which `rope_parameters` holds too); None for plain RoPE; else ValueError."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and rope_type not in types:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} in {config_file}")
    if rope_type == "default":
        return None
    return {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {
        "rope_type": rope_type
    }


def llama_fields(raw: dict, arch: str, config_file: Path) -> dict:
    """The Llama family's `ModelConfig` fields, from config.json (LongRoPE's are resolved from
    transformers' config afterwards, `longrope`)."""
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or rope
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    # Of the family only Phi-3's transformers modules rotate a partial head (Phi-4-mini).
    if partial != 1.0 and arch != "Phi3ForCausalLM":
        raise ValueError(f"unsupported partial rotary factor {partial} in {config_file}")
    # Llama and Qwen3 put `attention_bias` on q, k, v and o; Qwen2 always has q/k/v biases
    # and no o bias; Mistral has none. Only Llama reads `mlp_bias`.
    llama_like = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
    attention_bias = llama_like and bool(raw.get("attention_bias", False))
    return dict(
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_of(scaling, config_file, ("llama3", "linear", "longrope")),
        partial_rotary_factor=float(partial),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        o_proj_bias=attention_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
    )


def longrope(text_config, rotary_dim: int, config_file: Path) -> dict:
    """LongRoPE's factors, original length and attention factor as transformers resolves them
    (`_compute_longrope_parameters`): Phi-3 keeps its original length outside the rope dict,
    the factor defaults to the ratio of the lengths and the attention factor to
    sqrt(1 + ln(factor) / ln(original length)); from transformers' config, which also reads the
    old `rope_scaling` keys."""
    rope = text_config.rope_parameters
    original = getattr(text_config, "original_max_position_embeddings", None) or rope.get(
        "original_max_position_embeddings", text_config.max_position_embeddings
    )
    factor = rope.get("factor") or text_config.max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        if len(rope.get(name) or ()) != rotary_dim // 2:
            raise ValueError(f"LongRoPE's {name} needs {rotary_dim // 2} values in {config_file}")
    return dict(
        rope_type="longrope",
        short_factor=list(rope["short_factor"]),
        long_factor=list(rope["long_factor"]),
        original_max_position_embeddings=int(original),
        attention_factor=float(attention),
    )
