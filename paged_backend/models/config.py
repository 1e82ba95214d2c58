"""A model's configuration: the subset of its Hugging Face `config.json` our modules need.

`ModelConfig.from_dir` decides how a model runs (natively or on transformers' modeling code)
and takes the family's fields from its own parser: `llama_config`, `gemma_config`,
`transformers_config`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from paged_backend.file_cache import cache_dir, installed_stamp, read_checked, write_checked
from paged_backend.models.gemma_config import GEMMA_ARCHITECTURES, gemma_fields
from paged_backend.models.llama_config import LLAMA_ARCHITECTURES, llama_fields, longrope
from paged_backend.models.transformers_config import layer_windows, transformers_fields

SUPPORTED_ARCHITECTURES = LLAMA_ARCHITECTURES + GEMMA_ARCHITECTURES


def _key(config_file: Path) -> str:
    """What a native reading of `config_file` depends on: its bytes, the installed transformers
    and our readers' code (this package's config modules)."""
    digest = hashlib.sha256(installed_stamp("transformers").encode())
    for source in sorted(Path(__file__).parent.glob("*config.py")):
        digest.update(source.read_bytes())
    digest.update(config_file.read_bytes())
    return digest.hexdigest()[:32]


def plain_llama(raw: dict, arch: str, family: dict | None) -> bool:
    """Whether transformers' config of this model is its config.json over `LlamaConfig`'s
    defaults, of which we read one (`tie_word_embeddings`, False): a Llama without LongRoPE
    (whose factors transformers resolves). Such a config is read without transformers, whose
    import takes 1-2 s of a start; tests check that both readings agree."""
    scaling = (family or {}).get("rope_scaling")
    longrope = scaling is not None and scaling["rope_type"] == "longrope"
    return arch == "LlamaForCausalLM" and raw.get("model_type") == "llama" and not longrope


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
            return cls(**transformers_fields(path, raw))
        try:
            return cls._native(raw, arch, config_file)
        except ValueError:  # a variant our modules do not implement (a rope type, say)
            if model_impl == "native":
                raise
            return cls(**transformers_fields(path, raw))

    @classmethod
    def _native(cls, raw: dict, arch: str, config_file: Path) -> ModelConfig:
        # Llama's rope is read from config.json before transformers reads it, so that a rope
        # type we lack is named even where transformers cannot read the config.
        family = None if arch in GEMMA_ARCHITECTURES else llama_fields(raw, arch, config_file)
        if plain_llama(raw, arch, family):
            text_config = SimpleNamespace(**{"tie_word_embeddings": False, **raw})
            return cls._read(raw, arch, config_file, family, text_config)
        # Other configs need transformers' reading (its defaults, its rope resolution): 1-2 s
        # and ~25 MB to import it, once; then the reading is kept in the cache.
        entry = cache_dir() / "model_configs" / f"{_key(config_file)}.json"
        data = read_checked(entry)
        if data is not None:
            fields = json.loads(data)
            return cls(**{**fields, "layer_windows": tuple(fields["layer_windows"])})
        from transformers import AutoConfig

        text_config = AutoConfig.from_pretrained(config_file.parent).get_text_config()
        config = cls._read(raw, arch, config_file, family, text_config)
        write_checked(entry, json.dumps(dataclasses.asdict(config)).encode())
        return config

    @classmethod
    def _read(
        cls, raw: dict, arch: str, config_file: Path, family: dict | None, text_config
    ) -> ModelConfig:
        family = family or gemma_fields(text_config, arch, config_file)
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        if family["rope_scaling"] is not None and family["rope_scaling"]["rope_type"] == "longrope":
            rotary_dim = int(head_dim * family["partial_rotary_factor"])
            family["rope_scaling"] = longrope(text_config, rotary_dim, config_file)
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
