"""A GGUF file's tensors into our modules, the weights staying in their block formats.

The file is memory-mapped copy-on-write and a weight the kernels read as it is loads as a view of
the file's pages; the model runner then copies every weight once onto 2 MiB pages, dropping the
file's pages as it goes (`cpu.memory.move_to_huge_pages_`), so a weight is resident once. Only what
must change is copied here: the q and k rows of a `llama` file, which llama.cpp's converter permuted
for its interleaved rotary, are put back in Hugging Face's order. Linears and the embedding table in
a format of `BLOCK_FORMATS` become `QuantLinear` / `QuantEmbedding`; a fused projection's parts (q,
k, v; gate, up) stay separate weights of one `QuantLinear`, as a Q4_K_M file stores them in
different formats; one in a block format the kernels do not read (the IQ types) becomes int8
blocks of its values. Any other tensor (norms, biases, F16 / F32 weights) is dequantized into its
parameter.
"""

from __future__ import annotations

import math
import re
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, gguf_reader
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from paged_backend.cpu.memory import release_file_pages
from paged_backend.cpu.quant import (
    BLOCK_FORMATS,
    EXACT_F32_FORMATS,
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    check_block_shape,
    dequantize,
    place_block_linear_,
)
from paged_backend.gguf import ARCHITECTURES
from paged_backend.gguf.quantize import int8_weight
from paged_backend.models.llama import param_shard

# Of `ARCHITECTURES`, those whose q/k rows llama.cpp's converter permutes and whose norms it
# stores as 1 + weight.
_PERMUTED = ("llama", "mistral")
_GEMMA = ("gemma2", "gemma3")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's projections stay fused in its files, as in its checkpoints: ffn_up is gate_up_proj.
_PHI3_LAYER = {
    **{k: v for k, v in _LAYER.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
_IGNORED = ("rope_freqs.weight",)  # llama3's rotary factors: `read_metadata` reads them
# Llama 3.1/3.2's llama3 RoPE scaling but for its factor: what every such file was made with.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def architecture(reader: GGUFReader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


@dataclass(frozen=True)
class MappedTensor:
    """A tensor of a GGUF file as `load_gguf` reads it: `data` a view of the mapped file, with
    GGUFReader's shape (floats [rows, cols] or [n], blocks uint8 [rows, bytes a row])."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: inputs first
    data: np.ndarray


def tensor_table(reader: GGUFReader) -> list[dict]:
    """Where each tensor lies in the file, and its type and shape: kept with the file's config
    so that later starts map the tensors without parsing the file's metadata again (GGUFReader
    took 2.6 s on a 1B model's file, most of it the tokenizer's 49k-entry arrays)."""
    return [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "shape": [int(d) for d in t.shape],
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]


def map_tensors(path: Path, table: list[dict]) -> list[MappedTensor]:
    """The tensors of `table` (from `tensor_table`) as views of GGUF file `path`, mapped
    copy-on-write (writable views; the file never changes)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    tensors = []
    for entry in table:
        kind = GGMLQuantizationType(entry["type"])
        raw = mapped[entry["offset"] : entry["offset"] + entry["bytes"]]
        dims = tuple(reversed(entry["shape"]))
        if kind in _FLOAT_TYPES:
            data = raw.view(_FLOAT_TYPES[kind]).reshape(dims)
        else:
            data = raw.reshape(-1, entry["bytes"] // max(1, math.prod(dims[:-1])))
        tensors.append(MappedTensor(entry["name"], kind, tuple(entry["shape"]), data))
    return tensors


class _PlainMapNumpy(types.ModuleType):
    """numpy, but `memmap` gives a plain ndarray view of the mapping (the same pages, read as
    lazily): GGUFReader slices its map once per metadata item, and a `np.memmap` slice costs a
    subclass instance each (~1.5M for a 49k-token vocabulary's tokens and merges)."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


_field_parts = GGUFReader._get_field_parts


def _array_parts(reader: GGUFReader, orig_offs: int, raw_type: int):
    """`GGUFReader._get_field_parts` with an array of scalars or of strings read in one pass:
    the same parts, a view for each element (the form transformers' GGUF loader reads), without
    gguf's recursion into each element (~10 numpy calls each; a 49k-token vocabulary's tokens,
    types and merges are ~150k elements)."""
    if raw_type != gguf_reader.GGUFValueType.ARRAY or reader.byte_order != "I":
        return _field_parts(reader, orig_offs, raw_type)
    raw_itype, alen = reader._get(orig_offs, np.uint32), reader._get(orig_offs + 4, np.uint64)
    item, count, offs = gguf_reader.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
    parts: list[np.ndarray] = [raw_itype, alen]
    if item == gguf_reader.GGUFValueType.STRING:
        data, lengths = reader.data, memoryview(reader.data).cast("B")
        for _ in range(count):
            size = int.from_bytes(lengths[offs : offs + 8], "little")
            parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + size])
            offs += 8 + size
        data_idxs = list(range(3, 2 + 2 * count, 2))
    elif item in reader.gguf_scalar_to_np:
        values = reader._get(offs, reader.gguf_scalar_to_np[item], count)
        parts += list(values.reshape(count, 1))
        offs += values.nbytes
        data_idxs = list(range(2, 2 + count))
    else:  # arrays of arrays
        return _field_parts(reader, orig_offs, raw_type)
    return (
        offs - orig_offs,
        parts,
        data_idxs,
        [gguf_reader.GGUFValueType.ARRAY, item][: 1 + (count > 0)],
    )


def read_gguf_faster() -> None:
    """Make every `GGUFReader` (ours and transformers' GGUF loader) read through
    `_PlainMapNumpy` and `_array_parts`: the same fields, parsed faster (the default model's
    file on a 2-core AVX2 EPYC: 4.9 s through the plain map alone, 0.4 s with both; a GGUF
    file's first start reads it three times, a tiny model's first load 17.3 -> 4.1 s).
    Idempotent."""
    gguf_reader.np = _PlainMapNumpy("numpy")
    GGUFReader._get_field_parts = _array_parts


def read_metadata(path: Path) -> tuple[str, dict, list[dict]]:
    """(general.architecture, its `config_fixes`, the `tensor_table`) of GGUF file `path`."""
    read_gguf_faster()
    reader = GGUFReader(path)
    arch = architecture(reader)
    return arch, config_fixes(reader, arch, path), tensor_table(reader)


def config_fixes(reader: GGUFReader, arch: str, path: Path) -> dict:
    """The Hugging Face config values that GGUF file `path` holds and transformers' GGUF
    config reader drops (it maps a fixed key list per architecture), each of which changes the
    model's output:
    - "head_dim" from `attention.key_length` (Qwen3's is not hidden // heads);
    - Gemma 2's attention and final soft-caps;
    - "rope_scaling": Gemma 3's linear scaling (4B and larger), and llama3 scaling, which
      llama.cpp's converter keeps as a `rope_freqs` tensor (each rotary frequency's divisor)
      rather than as its parameters: the parameters that give those divisors are found here;
    - "query_pre_attn_scalar" of the 27B Gemmas, hidden // heads where the smaller ones have
      head_dim: GGUF does not store it, llama.cpp tells them by their layer count;
    - Phi-3's window and rotary share (`_phi3_fixes`)."""

    def value(key: str):
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    fixes = {}
    if value("attention.key_length") is not None:
        fixes["head_dim"] = int(value("attention.key_length"))
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if value(cap) is not None:
            fixes[cap] = float(value(cap))
    if value("rope.scaling.type") == "linear":
        factor = float(value("rope.scaling.factor"))
        fixes["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float64)
        theta = float(value("rope.freq_base"))
        scaling = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE}
        if not np.allclose(llama3_factors(scaling, theta, 2 * len(factors)), factors, rtol=1e-3):
            raise ValueError(f"{path}: its rope_freqs are not llama3 RoPE scaling's")
        fixes["rope_scaling"] = scaling
    if arch in _GEMMA_27B_LAYERS and _GEMMA_27B_LAYERS[arch] == value("block_count"):
        fixes["query_pre_attn_scalar"] = value("embedding_length") // value("attention.head_count")
    if arch == "phi3":
        fixes |= _phi3_fixes(reader, value, path)
    return fixes


def _phi3_fixes(reader: GGUFReader, value, path: Path) -> dict:
    """Phi-3's window (0: none; Phi-3-mini-4k's is 2047) and its rotary share of each head
    (Phi-4-mini's 0.75), which transformers' phi3 keys leave out. Its long-context files' rope
    factors (LongRoPE tensors) are refused: nothing here reads them."""
    if any(t.name.startswith("rope_factors") for t in reader.tensors):
        raise ValueError(f"{path}: Phi-3 LongRoPE files (rope_factors tensors) are not supported")
    fixes = {}
    if value("attention.sliding_window"):
        fixes["sliding_window"] = int(value("attention.sliding_window"))
    head_dim = value("embedding_length") // value("attention.head_count")
    rotary = value("rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        fixes["partial_rotary_factor"] = rotary / head_dim
    return fixes


def apply_config_fixes(config, fixes: dict) -> None:
    """Set `config_fixes` on a transformers config read from the same file. Rope scaling goes
    into `rope_parameters` (Gemma 3's: its global layers')."""
    for key, fix in fixes.items():
        if key == "rope_scaling":
            rope = config.rope_parameters
            rope.get("full_attention", rope).update(fix)
        else:
            setattr(config, key, fix)


def llama3_factors(scaling: dict, theta: float, dim: int) -> np.ndarray:
    """The divisor of each rotary frequency under llama3 scaling (as `rope_freqs` holds them)."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))


def hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face checkpoint name of GGUF tensor `name` (None: a tensor we do not load)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m is None:
        return None
    part = (_PHI3_LAYER if arch == "phi3" else _LAYER).get(m[2])
    if m[2] == "ffn_norm":  # the norm before the MLP: Gemma's sandwich names it "pre"
        part = "pre_feedforward_layernorm" if arch in _GEMMA else "post_attention_layernorm"
    return None if part is None else f"model.layers.{m[1]}.{part}.{m[3]}"


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (each head's rows interleaved in pairs) on the rows of a
    weight or bias, whatever a row holds (floats, or a quantized row's bytes)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def load_gguf(
    model: nn.Module,
    path: Path,
    dtype: torch.dtype,
    arch: str,
    table: list[dict],
    quantized: bool = True,
) -> None:
    """Fill `model` (our Llama-family or Gemma modules, parameters allocated but unloaded) from
    the GGUF file `path` of architecture `arch`, whose tensors `table` (`tensor_table`) locates:
    linears and the embedding quantized where `quantized` and their format allows, every other
    tensor dequantized into its parameter. Call before casting the model to `dtype` (the dtype
    the embedding's rows come out in)."""
    params = dict(model.named_parameters())
    by_param = _pieces_by_param(model, path, arch, table)
    missing = [n for n in params if n not in by_param]
    if missing:
        raise ValueError(f"{path}: weights missing: {missing[:5]}")
    for param_name, pieces in by_param.items():
        if quantized and _quantize_(model, param_name, pieces, dtype):
            continue
        for shard, sizes, tensor, rows in pieces:
            _dequantize_into(params[param_name], shard, sizes, tensor, rows, arch)


_CHECKED_ROW = 16


def exact_f32_blocks(
    model: nn.Module, path: Path, arch: str, table: list[dict]
) -> dict[str, list[QuantWeight]]:
    """The blocks of each fp32 weight of `model` (by module name; "lm_head" for a tied head: the
    embedding's) that GGUF file `path` holds in one format of `EXACT_F32_FORMATS` with exactly
    its values (checked, `_same_values`: a model `load_gguf` or transformers' GGUF loader
    dequantized from that file), for `LlamaForCausalLM.use_f32_blocks_`, which times each
    format and shape once."""
    params = dict(model.named_parameters())
    out = {}
    for param_name, pieces in _pieces_by_param(model, path, arch, table).items():
        module_name, _, kind = param_name.rpartition(".")
        if kind != "weight" or (module_name == "embed_tokens" and model.lm_head is not None):
            continue
        ordered = sorted(pieces, key=lambda piece: piece[0] or 0)
        weights = [_block_weight(tensor, rows) for _, _, tensor, rows in ordered]
        formats = {w.format if w is not None else None for w in weights}
        if len(formats) != 1 or not formats <= set(EXACT_F32_FORMATS):
            continue
        if _same_values(weights, params[param_name]):
            out["lm_head" if module_name == "embed_tokens" else module_name] = weights
    return out


def _same_values(weights: list[QuantWeight], param: torch.Tensor) -> bool:
    """Whether fp32 `param` holds the values of `weights` (parts stacked), checked on every
    `_CHECKED_ROW`-th row and the last of each part: a conversion that computed them otherwise
    (or permuted rows) differs all over, and checking every row took a third of a start."""
    if param.dtype != torch.float32:
        return False
    first = 0
    for w in weights:
        ids = torch.tensor([*range(0, w.out_features, _CHECKED_ROW), w.out_features - 1])
        if not torch.equal(dequantize(w, ids), param[first + ids]):
            return False
        first += w.out_features
    return True


def _pieces_by_param(
    model: nn.Module, path: Path, arch: str, table: list[dict]
) -> dict[str, list[tuple[int | None, tuple | None, object, np.ndarray]]]:
    """The file's tensors by the model parameter each fills: (shard, sizes, tensor, rows), the
    rows of llama.cpp's permuted q/k weights put back in order."""
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not one we load ({', '.join(ARCHITECTURES)})"
        )
    config = model.config
    params = dict(model.named_parameters())
    by_param: dict[str, list[tuple[int | None, tuple | None, object, np.ndarray]]] = {}
    for tensor in map_tensors(path, table):
        name = hf_name(tensor.name, arch)
        if name is None:
            if tensor.name not in _IGNORED:
                raise ValueError(f"{path}: unexpected tensor {tensor.name!r}")
            continue
        target = model.checkpoint_name_map(name)
        if target is None:
            continue
        param_name, shard, sizes = target
        if param_name not in params:
            raise ValueError(f"{path}: tensor {tensor.name!r} has no place in the model")
        rows = tensor.data
        if arch in _PERMUTED and re.search(r"\.attn_[qk]\.", tensor.name):
            heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
            rows = unpermute_rows(rows, heads)
        by_param.setdefault(param_name, []).append((shard, sizes, tensor, rows))
    return by_param


def _block_weight(tensor, rows: np.ndarray) -> QuantWeight | None:
    fmt = GGMLQuantizationType(tensor.tensor_type).name
    if fmt not in BLOCK_FORMATS or rows.ndim != 2:
        return None
    return QuantWeight(fmt, torch.from_numpy(np.ascontiguousarray(rows)), int(tensor.shape[0]))


@dataclass
class _DequantizedRows:
    """A GGUF tensor's block rows, dequantized (fp32) as they are sliced: `int8_weight` reads
    a few at a time, so a large table is never whole in fp32."""

    tensor: object
    rows: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], int(self.tensor.shape[0])

    ndim = 2

    def __getitem__(self, rows: slice) -> np.ndarray:
        return gguf_dequantize(self.rows[rows], self.tensor.tensor_type)


def _served_weight(tensor, rows: np.ndarray, looked_up: bool) -> QuantWeight | None:
    """The file's blocks where the kernels read their format. A weight in another block format
    (the IQ types, TQ1_0, TQ2_0) as int8 blocks of its values (`int8_weight`, row-major where
    `looked_up`, an embedding's): 8-8.5 bits a weight where the bf16 copy it got before took 16,
    and an int8 rounding error far below a 2-4-bit format's own. None for float tensors (F16,
    F32)."""
    weight = _block_weight(tensor, rows)
    if weight is not None or tensor.tensor_type in _FLOAT_TYPES or rows.ndim != 2:
        return weight
    weight = int8_weight(_DequantizedRows(tensor, rows), strips=not looked_up)
    release_file_pages(rows)  # read once: its pages would stay resident until loading ends
    return weight


def _quantize_(model: nn.Module, param_name: str, pieces, dtype: torch.dtype) -> bool:
    """Put the quantized pieces of a linear's or the embedding's weight in place of its module;
    False (nothing done) where any piece is a float tensor."""
    module_name, _, kind = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    if kind != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
        return False
    ordered = sorted(pieces, key=lambda piece: piece[0] or 0)
    looked_up = isinstance(module, nn.Embedding)
    weights = [_served_weight(tensor, rows, looked_up) for _, _, tensor, rows in ordered]
    if any(w is None for w in weights):
        return False
    if isinstance(module, nn.Linear):
        place_block_linear_(model, module_name, weights)
        return True
    check_block_shape(module_name, module.weight.shape, weights)
    parent_name, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, QuantEmbedding(weights[0], dtype))
    if getattr(model, "lm_head", False) is None:  # tied: the head reads the same rows
        model.cpu_head = QuantLinear(weights)
    return True


def _dequantize_into(param: torch.Tensor, shard, sizes, tensor, rows: np.ndarray, arch: str):
    block_weight = _block_weight(tensor, rows)
    if block_weight is not None:
        values = dequantize(block_weight).reshape(-1)
    else:
        if tensor.tensor_type not in _FLOAT_TYPES:
            rows = gguf_dequantize(rows, tensor.tensor_type)
        values = torch.from_numpy(np.asarray(rows, dtype=np.float32)).reshape(-1)
    if arch in _GEMMA and tensor.name.endswith("norm.weight"):
        values = values - 1.0  # stored as 1 + weight; our Gemma norms take the weight
    target = param_shard(param.data, shard, sizes)
    if target.numel() != values.numel():
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has {values.numel()} values, the model takes "
            f"{target.numel()}"
        )
    target.copy_(values.view(target.shape))
