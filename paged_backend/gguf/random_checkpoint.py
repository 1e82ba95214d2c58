"""Random-weight checkpoints of real model shapes, written offline, so that anyone can test and
benchmark the quantized GGUF path at real sizes without downloading a model:

    python -m paged_backend.gguf.random_checkpoint --shape llama-3.2-1b --out DIR \\
        [--formats bf16,q4_k_m,q4_0,q8_0] [--seed 0]

writes, from one set of weights (normal, std 0.02; norms ones, Gemma's offsets from one normal
too), rounded to bfloat16:
- `DIR/bf16/`: a Hugging Face directory (config.json, model.safetensors, the default model's
  tokenizer files);
- `DIR/gptq/` (only when `--formats` names `gptq`): the same as a symmetric GPTQ int4 checkpoint
  (groups of 128 inputs, the original format; embedding, norms and head fp16);
- `DIR/<shape>-Q4_K_M.gguf`, `-Q4_0.gguf`, `-Q8_0.gguf` (and `-Q2_K.gguf`, `-Q3_K_M.gguf`,
  `-Q5_K_M.gguf` when `--formats` names `q2_k`, `q3_k_m`, `q5_k_m`): those weights quantized, as
  llama.cpp's convert_hf_to_gguf.py and llama-quantize write them: its tensor names, its
  hyperparameter keys (arch `llama` for Llama and Mistral, `qwen2`, `qwen3`, `gemma2`, `gemma3`),
  Q and K rows permuted for `llama`, llama3 rope scaling as a `rope_freqs.weight` tensor, Gemma's
  norms as 1 + weight, and the default model's tokenizer (`tokenizer.*` keys copied from its GGUF
  file; its 49,152 tokens, then unused ones up to a larger vocabulary: Gemma 3's 262,144). Real
  Gemma files hold a SentencePiece vocabulary, and transformers' GGUF loader reads a
  `gemma2`/`gemma3` file's tokenizer as one: the Gemma shapes' text tokenizes otherwise than
  through their bf16 copy (spaces come out unknown), so compare them with their copy by weights
  and config, and generations within one file.

Tensor types: Q4_K_M follows llama.cpp's `llama_tensor_get_type`: Q4_K, Q6_K for `attn_v` and
`ffn_down` on the layers `use_more_bits` picks and for the output (the token embeddings where
they are tied), and where a row is not whole 256-weight super-blocks (Qwen2.5-0.5B's 896) its
fallbacks Q5_0 for Q4_K and Q8_0 for Q6_K. Q4_0 and Q8_0 files hold every 2-D weight in their
type; llama.cpp would give the output (or tied embeddings) Q6_K in a Q4_0 file. Q3_K_M: Q3_K,
with more bits where `_q3_k_m_type` says and Q6_K for the output; Q5_K_M: Q4_K_M's rules on
Q5_K; Q2_K: Q2_K, Q3_K for attn_v and ffn_down, Q6_K for the output (simpler than llama.cpp's
mix, which also weighs the model's shape). 1-D tensors
(norms, biases, rope factors) are F32 everywhere. Values are quantized by
`paged_backend.gguf.quantize` (simpler scale choice than llama.cpp: not bit-identical).

Everything streams a tensor at a time (each tensor drawn from its own seeded generator, written
to every format, dropped), so memory stays near the largest tensor: a 3B shape fits in a few GB.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np
import torch

from paged_backend.default_model import default_model_file
from paged_backend.gguf.quantize import QK_K, quantize
from paged_backend.gguf.weights import read_gguf_faster
from paged_backend.int4_checkpoint import gptq_tensors, int4_levels
from paged_backend.model_loader import resolve_model_path

INIT_STD = 0.02
# From the default model's converted directory into the bf16 copy.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
LLAMA3_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


# transformers' class -> llama.cpp's architecture (its converter writes Mistral as `llama`).
GGUF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
# Soft-caps (attention scores, final logits): not Gemma 2's 50 and 30, which transformers' GGUF
# loader assumes (it reads neither key), so that a reader dropping them is caught.
GEMMA2_SOFTCAPS = (40.0, 20.0)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # its sliding layers' base; GGUF files do not store it


@dataclass(frozen=True)
class Shape:
    """A model's real dimensions (its vocabulary's size; the tokens are the default
    tokenizer's, then unused ones)."""

    architecture: str  # transformers' class, a key of GGUF_ARCHS
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    rope_theta: float
    rms_eps: float
    tied: bool = True
    rope_scaling: dict | None = None
    vocab: int = 49152
    key_length: int | None = None  # head_dim, where it is not hidden // heads
    sliding_window: int | None = None  # Gemma's sliding layers' window

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads

    @property
    def gguf_arch(self) -> str:
        return GGUF_ARCHS[self.architecture]

    @property
    def model_type(self) -> str:
        """config.json's model_type."""
        special = {"MistralForCausalLM": "mistral", "Gemma3ForCausalLM": "gemma3_text"}
        return special.get(self.architecture, self.gguf_arch)

    @property
    def gemma(self) -> bool:
        return self.gguf_arch in ("gemma2", "gemma3")

    @property
    def qk_norm(self) -> bool:
        """Whether each layer norms its q and k heads (per-head RMSNorms)."""
        return self.gguf_arch in ("qwen3", "gemma3")


_LLAMA_3_2 = {
    "max_positions": 131072,
    "rope_theta": 5e5,
    "rms_eps": 1e-5,
    "rope_scaling": LLAMA3_ROPE,
}
SHAPES = {
    "qwen2.5-0.5b": Shape("Qwen2ForCausalLM", 896, 24, 14, 2, 4864, 32768, 1e6, 1e-6),
    "llama-3.2-1b": Shape("LlamaForCausalLM", 2048, 16, 32, 8, 8192, **_LLAMA_3_2),
    "llama-3.2-3b": Shape("LlamaForCausalLM", 3072, 28, 24, 8, 8192, **_LLAMA_3_2),
    # Llama 3.1 8B: untied, its own vocabulary's size (a 1 GB embedding and head at bf16) and
    # rope scaling (factor 8).
    "llama-3.1-8b": Shape(
        "LlamaForCausalLM",
        *(4096, 32, 32, 8, 14336, 131072, 5e5, 1e-5),
        tied=False,
        rope_scaling={**LLAMA3_ROPE, "factor": 8.0},
        vocab=128256,
    ),
    # Gemma 3 270M: most of its weights are the 262,144-token embedding (tied), and 640 inputs
    # are not whole K-quant super-blocks (a Q4_K_M file falls back to Q5_0 and Q8_0).
    "gemma-3-270m": Shape(
        "Gemma3ForCausalLM",
        *(640, 18, 4, 1, 2048, 32768, 1e6, 1e-6),
        vocab=262144,
        key_length=256,
        sliding_window=512,
    ),
    # For tests: every row length a multiple of 256 (K-quants), one of each family; the llama
    # one untied (an `output.weight`) with Llama 3.2's rope, the qwen2 one tied with biases.
    "tiny": Shape("LlamaForCausalLM", 256, 2, 4, 2, 512, **_LLAMA_3_2, tied=False),
    "tiny-qwen2": Shape("Qwen2ForCausalLM", 256, 2, 4, 2, 512, 32768, 1e6, 1e-6),
    # The other families our modules serve, each built as its real models are: Qwen3 (q/k
    # norms, head_dim neither hidden / heads nor transformers' Qwen3 default of 128), Mistral
    # (v0.3's: no window, untied), Gemma 2 (sliding and global layers alternating, soft-caps;
    # head_dim 256) and Gemma 3 (five sliding layers to one global, q/k norms, 1B's single KV
    # head, 4B's linear rope scaling of the global layers). Windows of 16 so that short prompts
    # reach past them.
    "tiny-qwen3": Shape("Qwen3ForCausalLM", 256, 2, 4, 2, 512, 40960, 1e6, 1e-6, key_length=192),
    "tiny-mistral": Shape("MistralForCausalLM", 256, 2, 4, 2, 512, 32768, 1e6, 1e-5, tied=False),
    # Phi-3 (mini-4k's layout): q, k and v in one tensor, gate and up in another, as its
    # checkpoints and llama.cpp's files hold them; untied.
    "tiny-phi3": Shape("Phi3ForCausalLM", 256, 2, 4, 2, 512, 4096, 1e4, 1e-5, tied=False),
    "tiny-gemma2": Shape(
        "Gemma2ForCausalLM", 256, 2, 4, 2, 512, 8192, 1e4, 1e-6, key_length=256, sliding_window=16
    ),
    "tiny-gemma3": Shape(
        "Gemma3ForCausalLM",
        *(256, 6, 4, 1, 512, 32768, 1e6, 1e-6),
        key_length=256,
        sliding_window=16,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}

# Format -> (file name suffix, llama.cpp's LLAMA_FTYPE, its type for plain 2-D weights).
GGUF_FORMATS = {
    "q4_k_m": ("Q4_K_M", gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K"),
    "q4_0": ("Q4_0", gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_0"),
    "q8_0": ("Q8_0", gguf.LlamaFileType.MOSTLY_Q8_0, "Q8_0"),
    "q3_k_m": ("Q3_K_M", gguf.LlamaFileType.MOSTLY_Q3_K_M, "Q3_K"),
    "q5_k_m": ("Q5_K_M", gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q5_K"),
    "q2_k": ("Q2_K", gguf.LlamaFileType.MOSTLY_Q2_K, "Q2_K"),
}
DEFAULT_FORMATS = ("bf16", "q4_k_m", "q4_0", "q8_0")
FORMATS = (*DEFAULT_FORMATS, "q2_k", "q3_k_m", "q5_k_m", "gptq")
# llama.cpp's types for rows that are not whole super-blocks (`convert_incompatible_tensor`;
# for Q3_K it now picks IQ4_NL, which `gguf` cannot write, and Q4_0 before that).
_K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str  # in model.safetensors
    gguf_name: str
    shape: tuple[int, ...]
    layer: int | None = None
    ones: bool = False  # a norm's weight (Gemma's are offsets from one: random)

    @property
    def role(self) -> str:
        """The GGUF name without its block: `attn_v.weight`, `token_embd.weight`..."""
        return self.gguf_name.split(".", 2)[-1] if self.layer is not None else self.gguf_name


def tensor_plan(shape: Shape) -> list[TensorSpec]:
    """The checkpoint's tensors, in writing order, with their names in both formats."""
    ones = not shape.gemma  # Gemma's norms hold offsets from one
    embed = TensorSpec(
        "model.embed_tokens.weight", "token_embd.weight", (shape.vocab, shape.hidden)
    )
    norm = TensorSpec("model.norm.weight", "output_norm.weight", (shape.hidden,), None, ones)
    layers = [spec for i in range(shape.layers) for spec in _layer_plan(shape, i)]
    output = [] if shape.tied else [TensorSpec("lm_head.weight", "output.weight", embed.shape)]
    return [embed, *layers, norm, *output]


def _layer_plan(shape: Shape, i: int) -> list[TensorSpec]:
    h, f, d = shape.hidden, shape.intermediate, shape.head_dim
    q_rows, kv_rows = shape.heads * d, shape.kv_heads * d
    names = [("input_layernorm.weight", "attn_norm.weight", (h,))]
    fused = shape.gguf_arch == "phi3"
    if fused:
        names.append(("self_attn.qkv_proj.weight", "attn_qkv.weight", (q_rows + 2 * kv_rows, h)))
    for proj, rows in () if fused else (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        names.append((f"self_attn.{proj}_proj.weight", f"attn_{proj}.weight", (rows, h)))
        if shape.gguf_arch == "qwen2":  # Qwen2's q, k and v have biases
            names.append((f"self_attn.{proj}_proj.bias", f"attn_{proj}.bias", (rows,)))
    if shape.qk_norm:
        for proj in "qk":
            names.append((f"self_attn.{proj}_norm.weight", f"attn_{proj}_norm.weight", (d,)))
    names.append(("self_attn.o_proj.weight", "attn_output.weight", (h, q_rows)))
    if shape.gemma:  # the sandwich: each sublayer's output is normed too
        names.append(("post_attention_layernorm.weight", "post_attention_norm.weight", (h,)))
        names.append(("pre_feedforward_layernorm.weight", "ffn_norm.weight", (h,)))
    else:
        names.append(("post_attention_layernorm.weight", "ffn_norm.weight", (h,)))
    if fused:  # llama.cpp's ffn_up holds Phi-3's gate_up_proj: gate's rows, then up's
        names.append(("mlp.gate_up_proj.weight", "ffn_up.weight", (2 * f, h)))
    else:
        names += [
            ("mlp.gate_proj.weight", "ffn_gate.weight", (f, h)),
            ("mlp.up_proj.weight", "ffn_up.weight", (f, h)),
        ]
    names.append(("mlp.down_proj.weight", "ffn_down.weight", (h, f)))
    if shape.gemma:
        names.append(("post_feedforward_layernorm.weight", "post_ffw_norm.weight", (h,)))
    ones = not shape.gemma  # Gemma's norms hold offsets from one
    return [
        TensorSpec(
            f"model.layers.{i}.{hf}", f"blk.{i}.{gg}", dims, i, ones and hf.endswith("norm.weight")
        )
        for hf, gg, dims in names
    ]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_type(spec: TensorSpec, shape: Shape, fmt: str) -> str:
    """The GGUF type name of `spec` in a file of format `fmt` (see the module docstring)."""
    if len(spec.shape) == 1:
        return "F32"
    base = GGUF_FORMATS[fmt][2]
    if fmt in ("q4_0", "q8_0"):
        return base
    output = spec.role == "output.weight" or (shape.tied and spec.role == "token_embd.weight")
    if output:
        chosen = "Q6_K"
    elif fmt == "q3_k_m":
        chosen = _q3_k_m_type(spec, shape)
    elif fmt == "q2_k":  # a simpler mix than llama.cpp's: more bits for v and down only
        chosen = "Q3_K" if spec.role in ("attn_v.weight", "ffn_down.weight") else base
    elif spec.role == "attn_qkv.weight":  # a fused qkv (Phi-3): llama.cpp gives it Q5_K in _M
        chosen = "Q5_K"
    elif spec.role in ("attn_v.weight", "ffn_down.weight"):
        chosen = "Q6_K" if use_more_bits(spec.layer, shape.layers) else base
    else:
        chosen = base
    return chosen if spec.shape[-1] % QK_K == 0 else _K_FALLBACK[chosen]


def _q3_k_m_type(spec: TensorSpec, shape: Shape) -> str:
    """Q3_K_M's type for a layer weight (llama.cpp): Q3_K, but attn_v Q5_K on the first two
    layers and Q4_K after, ffn_down Q5_K on the first sixteenth and Q4_K after, attn_output
    and a fused qkv Q4_K."""
    if spec.role == "attn_v.weight":
        return "Q5_K" if spec.layer < 2 else "Q4_K"
    if spec.role == "ffn_down.weight":
        return "Q5_K" if spec.layer < shape.layers // 16 else "Q4_K"
    if spec.role in ("attn_output.weight", "attn_qkv.weight"):
        return "Q4_K"
    return "Q3_K"


def rope_freqs(shape: Shape) -> np.ndarray:
    """llama3 rope scaling as llama.cpp reads it: one divisor of each rotary frequency,
    computed as convert_hf_to_gguf.py's LlamaModel does (in float32 torch scalars)."""
    scaling, dim = shape.rope_scaling, shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(factors, dtype=np.float32)


def permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp rotates interleaved pairs, HF
    checkpoints rotate halves; `heads` is the KV head count for K."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def random_tensor(spec: TensorSpec, seed: int, index: int) -> torch.Tensor:
    """The bf16 values of tensor number `index`: its own generator, so that any subset of
    formats, written in any run, holds the same weights."""
    if spec.ones:
        return torch.ones(spec.shape, dtype=torch.bfloat16)
    values = np.random.default_rng([seed, index]).standard_normal(spec.shape, dtype=np.float32)
    values *= INIT_STD
    return torch.from_numpy(values).to(torch.bfloat16)


def family_config(shape: Shape) -> dict:
    """The keys of config.json that the family's real models have beyond the common ones."""
    window = shape.sliding_window
    if shape.architecture == "LlamaForCausalLM":  # Llama 3.2's names its head_dim and biases
        return {
            "head_dim": shape.head_dim,
            "attention_bias": False,
            "mlp_bias": False,
            "rope_scaling": shape.rope_scaling,
            "pretraining_tp": 1,
        }
    if shape.architecture == "MistralForCausalLM":  # v0.3's
        return {"sliding_window": window}
    if shape.gguf_arch == "phi3":  # Phi-3-mini-4k's, without its window of 2047
        return {
            "original_max_position_embeddings": shape.max_positions,
            "rope_scaling": None,
            "sliding_window": None,
            "attention_bias": False,
        }
    if not shape.gemma:  # Qwen2.5's and Qwen3's: sliding-window fields, the window off
        qwen3 = {"head_dim": shape.head_dim, "attention_bias": False, "rope_scaling": None}
        return {
            **(qwen3 if shape.gguf_arch == "qwen3" else {}),
            "use_sliding_window": False,
            "sliding_window": None if shape.gguf_arch == "qwen3" else shape.max_positions,
            "max_window_layers": shape.layers,
        }
    gemma = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": shape.head_dim,
        "attention_bias": False,
        "query_pre_attn_scalar": shape.head_dim,
        "sliding_window": window,
    }
    if shape.gguf_arch == "gemma2":
        attn_cap, final_cap = GEMMA2_SOFTCAPS
        return {
            **gemma,
            "attn_logit_softcapping": attn_cap,
            "final_logit_softcapping": final_cap,
            "cache_implementation": "hybrid",
        }
    return {
        **gemma,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_scaling": shape.rope_scaling,
        "sliding_window_pattern": 6,
    }


def hf_config(shape: Shape, default_dir: Path) -> dict:
    """config.json as the real model's, on the default tokenizer's special tokens."""
    default = json.loads((default_dir / "config.json").read_text())
    config = {
        "architectures": [shape.architecture],
        "attention_dropout": 0.0,
        "bos_token_id": default["bos_token_id"],
        "eos_token_id": default["eos_token_id"],
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": INIT_STD,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": shape.max_positions,
        "model_type": shape.model_type,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tied,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": shape.vocab,
    }
    return config | family_config(shape)


@functools.cache
def tokenizer_fields(path: Path) -> tuple[tuple[str, object, list[gguf.GGUFValueType]], ...]:
    """Every `tokenizer.*` key of a GGUF file: (key, value, its types). Cached: GGUFReader
    takes seconds over a vocabulary's ~100k strings, even read faster."""
    read_gguf_faster()
    reader = gguf.GGUFReader(path)
    return tuple(
        (key, field.contents(), field.types)
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    )


def _metadata(writer: gguf.GGUFWriter, shape: Shape, fmt: str, name: str, tokenizer: tuple) -> None:
    """The keys convert_hf_to_gguf.py writes for the shape's config: TextModel's (key/value
    lengths where config.json has head_dim, which Llama 3.2's, Qwen3's and Gemma's have and
    Qwen2.5's and Mistral's have not), then LlamaModel's vocab size and rope dimensions,
    Phi3MiniModel's rope dimensions, original context and window (0: none),
    Gemma2Model's (no rope base: llama.cpp's default is Gemma 2's; soft-caps, window) or
    Gemma3Model's window and linear rope scaling; the file type llama-quantize sets, and the
    default model's tokenizer."""
    writer.add_type("model")
    writer.add_name(f"random {name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.max_positions)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.gguf_arch != "gemma2":
        writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if "head_dim" in family_config(shape):
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.gguf_arch == "llama":
        writer.add_vocab_size(shape.vocab)
    if shape.gguf_arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.gguf_arch == "phi3":  # Phi3MiniModel's: no window written as 0
        writer.add_rope_scaling_orig_ctx_len(shape.max_positions)
        writer.add_sliding_window(0)
    if shape.rope_scaling and shape.rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_scaling["factor"])
    if shape.gguf_arch == "gemma2":
        writer.add_attn_logit_softcapping(GEMMA2_SOFTCAPS[0])
        writer.add_final_logit_softcapping(GEMMA2_SOFTCAPS[1])
    if shape.gemma:
        writer.add_sliding_window(shape.sliding_window)
    writer.add_file_type(GGUF_FORMATS[fmt][1])
    for key, value, types in padded_tokenizer(tokenizer, shape.vocab):
        sub_type = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def padded_tokenizer(tokenizer: tuple, vocab: int) -> tuple:
    """The `tokenizer.*` keys with `<unused{i}>` tokens (type UNUSED) after the real ones, up to
    `vocab`: llama.cpp takes the vocabulary's size from the token list."""
    tokens = dict((key, value) for key, value, _ in tokenizer)["tokenizer.ggml.tokens"]
    extra = range(vocab - len(tokens))
    padding = {
        "tokenizer.ggml.tokens": [f"<unused{i}>" for i in extra],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * len(extra),
    }
    return tuple(
        (key, value + padding[key] if key in padding else value, types)
        for key, value, types in tokenizer
    )


@contextmanager
def _partial(path: Path) -> Iterator[Path]:
    """A name beside `path` to write to, renamed to `path` once written: an interrupted run
    leaves no half file under the real name."""
    tmp = path.with_name(path.name + ".partial")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _Sink(Protocol):
    """One output file, fed every tensor of the plan in order."""

    def write(self, spec: TensorSpec, weight: torch.Tensor) -> None: ...

    def close(self) -> None: ...


GPTQ_GROUP = 128  # the group size of the `gptq` format (symmetric, as most GPTQ files)
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "I32": 4}


def _entries(spec: TensorSpec, fmt: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the safetensors tensors `spec` becomes in `fmt`: bf16 as it is;
    in `gptq` a layer's projection as GPTQ's four tensors, anything else fp16."""
    if fmt == "bf16":
        return [(spec.hf_name, "BF16", spec.shape)]
    if spec.layer is None or not spec.hf_name.endswith("_proj.weight"):
        return [(spec.hf_name, "F16", spec.shape)]
    out, inputs = spec.shape
    prefix, groups = spec.hf_name.removesuffix(".weight"), inputs // GPTQ_GROUP
    return [
        (f"{prefix}.qweight", "I32", (inputs // 8, out)),
        (f"{prefix}.qzeros", "I32", (groups, out // 8)),
        (f"{prefix}.scales", "F16", (groups, out)),
        (f"{prefix}.g_idx", "I32", (inputs,)),
    ]


class _SafetensorsSink:
    """model.safetensors, a tensor at a time (its header from the plan first): safetensors'
    own writer takes the whole state dict, 6 GB for a 3B model. `fmt`: "bf16", or "gptq" (its
    projections as symmetric GPTQ int4, `GPTQ_GROUP` inputs a group)."""

    def __init__(self, path: Path, plan: list[TensorSpec], fmt: str = "bf16") -> None:
        header, offset = {}, 0
        self.fmt = fmt
        for spec in plan:
            for name, dtype, shape in _entries(spec, fmt):
                size = math.prod(shape) * _DTYPE_BYTES[dtype]
                header[name] = {
                    "dtype": dtype,
                    "shape": list(shape),
                    "data_offsets": [offset, offset + size],
                }
                offset += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, spec: TensorSpec, weight: torch.Tensor) -> None:
        entries = _entries(spec, self.fmt)
        if len(entries) == 4:  # in the order of `_entries`
            levels = int4_levels(weight, GPTQ_GROUP, sym=True)
            tensors = list(gptq_tensors(*levels, GPTQ_GROUP).values())
        else:
            tensors = [weight if self.fmt == "bf16" else weight.to(torch.float16)]
        for tensor in tensors:
            tensor.contiguous().view(torch.uint8).numpy().tofile(self.file)

    def close(self) -> None:
        self.file.close()


class _GGUFSink:
    """One GGUF file: metadata and tensor infos up front (types and sizes follow from the
    shape), then each tensor's blocks as its weights come."""

    def __init__(
        self,
        path: Path,
        shape: Shape,
        fmt: str,
        plan: list[TensorSpec],
        name: str,
        tokenizer: tuple,
    ) -> None:
        self.shape, self.fmt = shape, fmt
        self.writer = gguf.GGUFWriter(path, shape.gguf_arch)
        _metadata(self.writer, shape, fmt, name, tokenizer)
        llama3 = (shape.rope_scaling or {}).get("rope_type") == "llama3"
        freqs = rope_freqs(shape) if llama3 else None
        if freqs is not None:
            self.writer.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes)
        for spec in plan:
            qtype = gguf.GGMLQuantizationType[gguf_type(spec, shape, fmt)]
            shape_bytes = gguf.quant_shape_to_byte_shape(spec.shape, qtype)
            self.writer.add_tensor_info(
                spec.gguf_name, shape_bytes, np.dtype(np.uint8), math.prod(shape_bytes), qtype
            )
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        if freqs is not None:
            self.writer.write_tensor_data(freqs)

    def write(self, spec: TensorSpec, weight: torch.Tensor) -> None:
        values = weight.float().numpy()
        if self.shape.gguf_arch == "llama" and spec.role in ("attn_q.weight", "attn_k.weight"):
            heads = self.shape.heads if spec.role == "attn_q.weight" else self.shape.kv_heads
            values = permute_qk(values, heads)
        if self.shape.gemma and spec.role.endswith("norm.weight"):
            values = values + 1.0  # Gemma's norms scale by 1 + weight: llama.cpp stores the sum
        type_name = gguf_type(spec, self.shape, self.fmt)
        self.writer.write_tensor_data(values if type_name == "F32" else quantize(values, type_name))

    def close(self) -> None:
        self.writer.close()


def _open_sink(stack: ExitStack, path: Path, make: Callable[[Path], _Sink]) -> _Sink:
    """A sink made on a temporary name, closed and then renamed to `path` when `stack` exits."""
    sink = make(stack.enter_context(_partial(path)))
    stack.callback(sink.close)  # LIFO: closed before the rename
    return sink


def gguf_path(out: Path, name: str, fmt: str) -> Path:
    return out / f"{name}-{GGUF_FORMATS[fmt][0]}.gguf"


def write_checkpoint(
    name: str, out: Path, formats: tuple[str, ...] = DEFAULT_FORMATS, seed: int = 0
) -> list[Path]:
    """Write the random checkpoint of shape `name` into `out` in `formats`; the paths written."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"unknown formats {unknown}; formats: {', '.join(FORMATS)}")
    shape, plan = SHAPES[name], tensor_plan(SHAPES[name])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with ExitStack() as stack:
        sinks = []
        for fmt in (f for f in ("bf16", "gptq") if f in formats):
            hf_dir = out / fmt
            hf_dir.mkdir(exist_ok=True)
            default_dir = resolve_model_path(None)
            config = hf_config(shape, default_dir)
            if fmt == "gptq":
                config["torch_dtype"] = "float16"
                config["quantization_config"] = {
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": GPTQ_GROUP,
                    "desc_act": False,
                    "sym": True,
                    "checkpoint_format": "gptq",
                }
            (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
            for file in COPIED_FILES:
                shutil.copy(default_dir / file, hf_dir / file)
            path = hf_dir / "model.safetensors"
            make = functools.partial(_SafetensorsSink, plan=plan, fmt=fmt)
            sinks.append(_open_sink(stack, path, make))
            written.append(hf_dir)
        for fmt in (f for f in GGUF_FORMATS if f in formats):
            path = gguf_path(out, name, fmt)
            tokenizer = tokenizer_fields(default_model_file())
            make = functools.partial(
                _GGUFSink, shape=shape, fmt=fmt, plan=plan, name=name, tokenizer=tokenizer
            )
            sinks.append(_open_sink(stack, path, make))
            written.append(path)
        for index, spec in enumerate(plan):
            weight = random_tensor(spec, seed, index)
            for sink in sinks:
                sink.write(spec, weight)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"comma-separated, of {', '.join(FORMATS)}",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    for path in write_checkpoint(args.shape, args.out, formats, args.seed):
        print(path)
    print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
