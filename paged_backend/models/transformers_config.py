"""`ModelConfig` fields read through transformers' config classes: for the models that run on
transformers' modeling code (`paged_backend.models.transformers_impl`), and each layer's
attention window, which transformers resolves for every family.

Apart from `transformers_impl` so that parsing a config does not import the modules that run it.
"""

from __future__ import annotations

from pathlib import Path


def check_servable(hf_config, architecture: str) -> None:
    """Raise ValueError naming the architecture and why, for what `transformers_impl` cannot
    serve."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reason = None
    model_class = getattr(transformers, architecture, None)
    if getattr(hf_config, "is_encoder_decoder", False):
        reason = "it is an encoder-decoder model"
    elif model_class is None or architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        reason = "it is not a causal language model that transformers can build"
    elif not getattr(model_class, "_supports_attention_backend", False):
        reason = "its transformers class does not take a pluggable attention (recurrent state?)"
    if reason:
        raise ValueError(f"cannot serve architecture {architecture}: {reason}")


def transformers_fields(path: Path, raw: dict) -> dict:
    """The `ModelConfig` fields of the model in `path` (config.json `raw`) as transformers' modules
    run it: they apply their own rotary, biases and norms, so only the shapes matter here."""
    from transformers import AutoConfig

    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{path / 'config.json'} names no architecture")
    try:
        hf = AutoConfig.from_pretrained(path)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"transformers cannot read {path / 'config.json'}: {exc}") from None
    check_servable(hf, archs[0])
    text = hf.get_text_config()
    num_heads = text.num_attention_heads
    eos = getattr(text, "eos_token_id", None) or raw.get("eos_token_id")
    return dict(
        architecture=archs[0],
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 0),
        num_layers=text.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_theta=10000.0,  # transformers' modules apply their own rotary
        rope_scaling=None,
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=False,
        layer_windows=layer_windows(text, text.num_hidden_layers),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        impl="transformers",
    )


def layer_windows(text_config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers' modules apply it: a token sees itself and
    the `window - 1` before it. transformers' config classes resolve the family rules (Qwen's
    `use_sliding_window` and `max_window_layers`, Gemma's interleaving) into `sliding_window` and
    `layer_types`; without `layer_types` (Mistral, Phi-3) every layer slides."""
    window = getattr(text_config, "sliding_window", None)
    if not window:
        return (None,) * num_layers
    types = getattr(text_config, "layer_types", None) or ["sliding_attention"] * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
