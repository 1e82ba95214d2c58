"""The engine's configuration, validated once at construction, and the device, dtype and
attention backend it resolves to. A model's own: `paged_backend.models.config`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from paged_backend.chat_formats import check_chat_template
from paged_backend.cpu.features import cpu_features
from paged_backend.cpu.ops import GEMM_MAX_ROWS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_IMPLS = ("auto", "native", "transformers")
KV_CACHE_DTYPES = ("auto", "float16", "float32")  # `EngineConfig.kv_cache_dtype`
MAX_SPECULATIVE_TOKENS = 32  # more drafts than this only add rejected rows to a step
# Steps with more running sequences than this do not draft (`disable_by_batch_size`), by the
# model's dtype where the config names none. A drafting sequence adds its drafts as rows; where a
# step of more rows costs nearly as much more, a rejected draft is lost time. Measured (2 threads,
# default model; step time with 4 rejected drafts per sequence over the plain step): fp32 on an
# AVX2 Zen 3, 1.33x at 1 sequence, 1.56x at 2, 1.85x at 4, 2.6x at 8, 4.3x at 32; bf16 on an
# AVX512-BF16 Zen 4, 1.57x, 1.61x, 1.75x at 3, 2.0x at 4, 2.7x at 8, 4.0x at 32. Quoting answers
# keep ~70% of drafts, RAG answers ~45%: batches of RAG questions drafting against not gained
# (`examples/speculative_benchmark.py --batch N --disable-by-batch-size 64`) 1.04x at 2, 1.06x at
# 3, 0.87x at 4 and 0.86x at 8 sequences in bf16; in fp32, drafting paid up to 4.
DISABLE_BY_BATCH_SIZE = {torch.float32: 4, torch.bfloat16: 3}


QUANTIZATIONS = (None, "none", "int4", "int8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Drafting by prompt lookup (vLLM's `ngram` method, with its names): each step, a greedy
    sequence drafts up to `num_speculative_tokens` tokens that followed an earlier occurrence of
    its last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), verified in the
    same forward. A step in which more than `disable_by_batch_size` sequences run drafts
    nothing (None: `DISABLE_BY_BATCH_SIZE` for the model's dtype). Built from the
    `speculative_config` dict by `from_dict`, which validates it."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    method: str = "ngram"

    @classmethod
    def from_dict(cls, spec: object) -> SpeculativeConfig:
        """vLLM's defaults: a missing lookup bound takes the other's value; both missing, 5."""
        if not isinstance(spec, dict):
            raise ValueError(
                f"speculative_config must be None or a dict, got {type(spec).__name__}"
            )
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        }
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; allowed: {sorted(known)}"
            )
        if spec.get("method") != "ngram":
            raise ValueError(
                f"speculative_config['method'] must be 'ngram', got {spec.get('method')!r}"
            )
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        k = spec.get("num_speculative_tokens")
        _check_int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", lo, 1, None)
        _check_int("prompt_lookup_max", hi, lo, None)
        batch = spec.get("disable_by_batch_size")
        if batch is not None:
            _check_int("disable_by_batch_size", batch, 1, None)
        return cls(k, lo, hi, batch)


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config['{name}'] must be an int {allowed}, got {value!r}")


@dataclass
class EngineConfig:
    """Everything that shapes an engine; `LLM(**kwargs)` and `AsyncEngine.from_model` take these."""

    model: str | None = None
    revision: str | None = None  # of a hub model: a branch, tag or commit
    dtype: str = "auto"
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's name. "auto": the model's dtype (fp16 for quantized weights in float32 on CPU, see
    # `resolve_kv_cache_dtype`). "float16": fp16 K/V for a float32 model on CPU, half the bytes a
    # token holds and its attention reads (llama.cpp's default cache type); "float32": a float32
    # model's K/V in full (a quantized one's too).
    kv_cache_dtype: str = "auto"
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
    # None: a GGUF file's weights stay in its block formats on CPU (but for the embedded default
    # model's, which runs dequantized); "none": dequantized to `dtype`; "int4": int4 copies for
    # small steps (CPU, bf16); "int8": linears as int8 blocks (a scale a 256 inputs, Q8_256,
    # where they are whole super-blocks, else a 32, Q8_0; CPU).
    quantization: str | None = None
    cpu_kernels: bool | None = None
    cpu_gemm_max_rows: int | None = None
    model_impl: str = "auto"
    # A Jinja chat template that wins over the model's own and its family's (chat_formats).
    chat_template: str | None = None
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b} (vLLM's), or a SpeculativeConfig; None: no drafting.
    speculative_config: dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        check_chat_template(self.chat_template)
        if self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
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
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                "kv_cache_dtype must be 'auto', 'float16' or 'float32', "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype != "auto":
            device = self.resolve_device()
            model_dtype = self.resolve_dtype(device)
            if model_dtype != torch.float32 or (
                self.kv_cache_dtype == "float16" and device.type != "cpu"
            ):
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} is for float32 models"
                    + (" on CPU" if self.kv_cache_dtype == "float16" else "")
                    + f" (a {model_dtype} model's cache is 'auto'); got {model_dtype} on "
                    f"{device.type}"
                )
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
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
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

    def resolve_kv_cache_dtype(
        self, model_dtype: torch.dtype, device: torch.device, quantized: bool
    ) -> torch.dtype:
        """ "auto" is the model's dtype, but fp16 for quantized weights (GGUF blocks, GPTQ / AWQ)
        running in float32 on CPU: llama.cpp's cache type for the files its users bring (a bf16
        CPU runs them in bf16, K/V too), half the memory for the same speed (1B Q4_K_M, AVX2:
        within 5% at 1 x 2,000 and 32 x 300 tokens). Its rounding shows: the default model's
        Q4_1 file against its dequantized weights, held-out text, perplexity +0.06% with fp32
        K/V, +0.40% with fp16 (llama.cpp's, +0.34%); "float32" keeps full K/V."""
        if self.kv_cache_dtype != "auto":
            return _DTYPES[self.kv_cache_dtype]
        half = quantized and device.type == "cpu" and model_dtype == torch.float32
        return torch.float16 if half else model_dtype

    def resolve_backend(self, device: torch.device) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        # CUDA builds of torch bring triton; without it (a custom build) the torch path serves.
        has_triton = importlib.util.find_spec("triton") is not None
        return "triton" if device.type == "cuda" and has_triton else "torch"


def _cpu_has_native_bf16() -> bool:
    return bool(cpu_features() & {"avx512_bf16", "amx_bf16"})
