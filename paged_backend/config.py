"""Engine and model configuration: plain dataclasses, validated once at construction."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_backend.cpu.features import cpu_features
from paged_backend.cpu.ops import GEMM_MAX_ROWS

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Phi-3, Phi-4: fused qkv and gate_up in the checkpoint, as ours
    "Gemma2ForCausalLM",  # Gemma 2 and text-only Gemma 3: `paged_backend.models.gemma`
    "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass
class ModelConfig:
    """The subset of a Hugging Face `config.json` our native modules (Llama family, Gemma)
    need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...] = ()  # per layer: its attention window, None: global
    o_proj_bias: bool = False
    mlp_bias: bool = False
    query_pre_attn_scalar: float | None = None  # scores scale by its ** -0.5, not head_dim's
    local_rope_theta: float | None = None  # the sliding layers' rope base, where it differs
    final_logit_softcap: float | None = None  # logits -> tanh(logits / cap) * cap
    attn_logit_softcap: float | None = None  # attention scores, likewise
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotary rotates
    eos_token_ids: list[int] = field(default_factory=list)
    impl: str = "native"  # or "transformers": its modeling code on our cache

    def __post_init__(self) -> None:
        if self.rotary_dim % 2:  # rotate-half pairs dim i with dim i + rotary_dim / 2
            raise ValueError(
                f"partial rotary factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                f"rotates an odd number of dims ({self.rotary_dim})"
            )

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head rotary rotates (all but for Phi-4-mini's
        partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's original context length: the long factors apply from this position on,
        and at every position of a prompt longer than it (`long_rope`); None without LongRoPE."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return None
        return scaling["original_max_position_embeddings"]

    def long_rope(self, prompt_len: int) -> bool:
        """Whether a prompt of this length runs LongRoPE's long factors from its first position:
        transformers picks the factors per forward call by its sequence length, so a prompt longer
        than the original length is prefilled with the long ones throughout, while a shorter one
        keeps its short-factor keys and switches (for the new tokens only) once it grows past."""
        start = self.long_rope_from
        return start is not None and prompt_len > start

    @property
    def kv_window(self) -> int | None:
        """How many trailing tokens of a sequence any layer still reads, when every layer has a
        window (the largest); None when a global layer reads them all. Blocks wholly before
        that can be freed."""
        windows = self.layer_windows
        if not windows or None in windows:
            return None
        return max(windows)

    def resolve_max_model_len(self, requested: int | None) -> int:
        if requested is not None and requested > self.max_len:
            raise ValueError(
                f"max_model_len must be <= {self.max_len} for this model, got {requested}"
            )
        return requested or self.max_len

    @classmethod
    def from_dir(cls, path: Path, model_impl: str = "auto") -> ModelConfig:
        """The model in `path`, run natively where we have its family (`model_impl` "auto" or
        "native"), else (or with "transformers") through transformers' modeling code."""
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and model_impl == "native":
            raise ValueError(
                f"architecture {archs} in {config_file} has no native implementation (native: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}); model_impl='auto' or 'transformers' "
                "runs it through transformers' modeling code"
            )
        if arch is None or model_impl == "transformers":
            return cls._through_transformers(path, raw)
        try:
            return cls._native(raw, arch, config_file)
        except ValueError:  # a variant our modules do not implement (a rope type, say)
            if model_impl == "native":
                raise
            return cls._through_transformers(path, raw)

    @classmethod
    def _through_transformers(cls, path: Path, raw: dict) -> ModelConfig:
        from transformers import AutoConfig

        from paged_backend.models.transformers_impl import check_servable

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
        return cls(
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

    @classmethod
    def _native(cls, raw: dict, arch: str, config_file: Path) -> ModelConfig:
        # Llama's rope is read from config.json before transformers reads it, so that a rope
        # type we lack is named even where transformers cannot read the config.
        family = None if arch in GEMMA_ARCHITECTURES else _llama_fields(raw, arch, config_file)
        from transformers import AutoConfig

        text_config = AutoConfig.from_pretrained(config_file.parent).get_text_config()
        family = family or _gemma_fields(text_config, arch, config_file)
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        if family["rope_scaling"] is not None and family["rope_scaling"]["rope_type"] == "longrope":
            rotary_dim = int(head_dim * family["partial_rotary_factor"])
            family["rope_scaling"] = _longrope(text_config, rotary_dim, config_file)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(text_config.tie_word_embeddings),  # the class's default
            layer_windows=layer_windows(text_config, raw["num_hidden_layers"]),
            eos_token_ids=eos_ids,
            **family,
        )


def _rope_scaling(scaling: dict, config_file: Path, types: tuple[str, ...]) -> dict | None:
    """`scaling` (a `rope_scaling` or `rope_parameters` dict) with its `rope_type` where it is
    one of `types`, the scalings our modules implement for the family; None for plain RoPE;
    else ValueError."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and rope_type not in types:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} in {config_file}")
    return None if rope_type == "default" else dict(scaling, rope_type=rope_type)


def _llama_fields(raw: dict, arch: str, config_file: Path) -> dict:
    """The Llama family's `ModelConfig` fields, from config.json (LongRoPE's are resolved from
    transformers' config afterwards, `_longrope`)."""
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
        rope_scaling=_rope_scaling(scaling, config_file, ("llama3", "linear", "longrope")),
        partial_rotary_factor=float(partial),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        o_proj_bias=attention_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
    )


def _longrope(text_config, rotary_dim: int, config_file: Path) -> dict:
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


def _gemma_fields(text_config, arch: str, config_file: Path) -> dict:
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
    if local and _rope_scaling(local, config_file, ()) is not None:
        raise ValueError(f"unsupported rope scaling on sliding layers in {config_file}")
    if any(r.get("partial_rotary_factor", 1.0) != 1.0 for r in (glob, local) if r):
        raise ValueError(f"unsupported partial rotary factor in {config_file}")
    bias = bool(text_config.attention_bias)
    return dict(
        rope_theta=float(glob["rope_theta"]),
        rope_scaling=_rope_scaling(glob, config_file, ("llama3", "linear")),
        local_rope_theta=float(local["rope_theta"]) if local else None,
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=gemma3,
        query_pre_attn_scalar=float(text_config.query_pre_attn_scalar),
        final_logit_softcap=text_config.final_logit_softcapping,
        attn_logit_softcap=None if gemma3 else text_config.attn_logit_softcapping,
    )


@dataclass
class EngineConfig:
    """Everything that shapes an engine; `LLM(**kwargs)` and `AsyncEngine.from_model` take these."""

    model: str | None = None
    revision: str | None = None  # of a hub model: a branch, tag or commit
    dtype: str = "auto"
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # vLLM's: a request with more tokens than this left to prefill (a long prefill) runs at most
    # this many per step, and long prefills together leave as many of each step's budget (or the
    # budget minus the threshold, where that is fewer) to decodes and short prompts, passing a long
    # waiting request over for shorter ones behind it. 0/None: off; at or over
    # max_num_batched_tokens it caps nothing. The default, a quarter of the default budget: three
    # long prefills fill 1536 tokens of a step and leave 512 to up to max_num_seqs (128) decodes and
    # the prompts queued behind them, so a short prompt starts in the next step whatever is queued
    # ahead; prompts up to 512 uncached tokens are never capped, and long ones prefill as many
    # tokens/s as uncapped (measured: README, Head-of-line blocking).
    long_prefill_token_threshold: int | None = 512
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    device: str = "auto"
    num_threads: int | None = None
    seed: int = 0
    pack_weights: bool | None = None
    fp16_decode_weights: bool | None = None
    quantization: str | None = None
    cpu_kernels: bool | None = None
    cpu_gemm_max_rows: int | None = None
    model_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(
                f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                "attention_backend must be 'auto', 'torch' or 'triton', "
                f"got {self.attention_backend!r}"
            )
        # Triton's tiles need 16-token blocks. The torch backend takes any size and defaults to
        # 4 tokens: a sequence's last block is half empty on average, which with 16-token
        # blocks left 8-12% of the KV slots empty on RAG-sized requests (2-3% with 4), for the
        # same speed; prefix-cache hits also come at 4-token granularity.
        triton = self.resolve_backend(self.resolve_device()) == "triton"
        if self.block_size is None:
            self.block_size = 16 if triton else 4
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if triton and self.block_size % 16:
            raise ValueError(
                f"block_size must be a multiple of 16 for the triton backend, got {self.block_size}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (
            not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0
        ):
            raise ValueError(
                "long_prefill_token_threshold must be None or 0 (off) or a positive int "
                f"(tokens of one request's prefill per step), got {threshold!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.quantization not in (None, "int4"):
            raise ValueError(
                f"quantization must be None or 'int4' (CPU), got {self.quantization!r}"
            )
        rows = self.cpu_gemm_max_rows
        if rows is not None and (
            not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= GEMM_MAX_ROWS
        ):
            raise ValueError(
                f"cpu_gemm_max_rows must be None (timed on this machine) or an int in "
                f"[0, {GEMM_MAX_ROWS}], got {rows!r}"
            )
        for name in ("pack_weights", "fp16_decode_weights", "cpu_kernels"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be None (auto), True or False, got {value!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 where the hardware runs it natively (CUDA, AVX-512 bf16 CPUs), else fp32."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32

    def resolve_backend(self, device: torch.device) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        # CUDA builds of torch bring triton; without it (a custom build) the torch path serves.
        has_triton = importlib.util.find_spec("triton") is not None
        return "triton" if device.type == "cuda" and has_triton else "torch"


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


def _cpu_has_native_bf16() -> bool:
    return bool(cpu_features() & {"avx512_bf16", "amx_bf16"})
