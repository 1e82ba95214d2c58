"""GPTQ and AWQ int4 checkpoints (`quantization_config` in config.json) served by the GGUF block
kernels, with no float copy of their linears.

Both formats store 4-bit levels q with a scale s and a zero point z per output and group of
`group_size` inputs (-1: all of a row's): w = s * (q - z). Groups are whole 32-input blocks, so
each block of a row
becomes one GGUF block: Q4_0 (d = s, w = d * (q - 8)) where every zero point is 8, as in
symmetric GPTQ files, exactly; else Q4_1 (w = d * q + m with d = s, m = -s * z rounded to fp16,
~2^-11 of s * z off).

Layouts (int32 words of eight 4-bit values, low bits first):
- GPTQ: qweight [in / 8, out] packs 8 consecutive inputs of an output; qzeros [groups, out / 8]
  packs 8 consecutive outputs, stored as z - 1 in the original format (`checkpoint_format`
  "gptq"), as z in "gptq_v2"; scales [groups, out]; g_idx [in], each input's group.
- AWQ (`version` "gemm"): qweight [in, out / 8] and qzeros [groups, out / 8] pack 8 outputs in
  the order 0, 2, 4, 6, 1, 3, 5, 7; scales [groups, out].
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from paged_backend.cpu.quant import QuantWeight, place_block_linear_
from paged_backend.model_loader import load_safetensors

TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's, beside its bias
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # output of each nibble of an AWQ word


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # "gptq" or "awq"
    group_size: int | None  # None: one group a row (`group_size` -1)
    zero_offset: int  # added to stored zero points (GPTQ's original format stores z - 1)

    @classmethod
    def from_config(cls, config: dict) -> Int4Scheme | None:
        """The scheme of a config.json's `quantization_config`; None without one. A
        configuration the kernels cannot serve raises ValueError naming the field."""
        quant = config.get("quantization_config")
        if not quant or quant.get("quant_method") not in ("gptq", "awq"):
            return None
        method = quant["quant_method"]
        what = f"{method} checkpoint's quantization_config"
        bits, group = quant.get("bits", quant.get("w_bit")), quant.get("group_size")
        group = quant.get("q_group_size") if group is None else group
        if bits != 4:
            raise ValueError(f"{what}: bits must be 4 (the 4-bit block kernels), got {bits}")
        if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
            raise ValueError(
                f"{what}: group_size must be -1 or a positive multiple of 32 (whole 32-input "
                f"blocks), got {group}"
            )
        group = None if group == -1 else group
        if method == "awq":
            version = str(quant.get("version", "gemm")).lower()
            if version != "gemm" or quant.get("zero_point", True) is not True:
                raise ValueError(
                    f"{what}: only version 'gemm' with zero_point true is read, got version "
                    f"{version!r}, zero_point {quant.get('zero_point')!r}"
                )
            return cls("awq", group, 0)
        fmt = quant.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{what}: checkpoint_format must be gptq or gptq_v2, got {fmt!r}")
        return cls("gptq", group, 1 if fmt == "gptq" else 0)

    def unpack(self, tensors: dict[str, torch.Tensor]) -> tuple[np.ndarray, ...]:
        """(q [out, in], z [out, groups], s [out, groups] fp16, inputs a group) of one linear's
        tensors."""
        words = tensors["qweight"].numpy().view(np.uint32)
        zeros = _nibbles(tensors["qzeros"].numpy().view(np.uint32))  # [groups, out]
        scales = tensors["scales"].numpy().astype(np.float16)
        if self.method == "awq":
            q = _nibbles(words)  # [in, out] in AWQ's order within each 8 outputs
            q, zeros = _awq_reorder(q), _awq_reorder(zeros)
        else:
            q = _nibbles(words.T).T  # [in, out]: words [in / 8, out] pack inputs
        zeros = zeros + self.zero_offset
        inputs = q.shape[0]
        group = self.group_size or inputs
        if "g_idx" in tensors and self.method == "gptq":
            g_idx = tensors["g_idx"].numpy()
            if not np.array_equal(g_idx, np.arange(inputs) // group):
                raise ValueError(
                    "gptq checkpoint with act-order groups (g_idx not input // group_size, "
                    "desc_act true): its groups are not whole 32-input blocks"
                )
        groups = -(-inputs // group)
        if zeros.shape[0] != groups or scales.shape[0] != groups or inputs % 32:
            raise ValueError(
                f"{self.method} linear of {inputs} inputs: expected {groups} groups of "
                f"{group} and inputs a multiple of 32, got zeros {zeros.shape}, "
                f"scales {scales.shape}"
            )
        return q.T, zeros.T, scales.T, group


def _nibbles(words: np.ndarray) -> np.ndarray:
    """uint32 [rows, cols] as the 4-bit values [rows, cols * 8], low bits first."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    values = (words[..., None] >> shifts) & 15
    return values.reshape(words.shape[0], -1).astype(np.uint8)


def _awq_reorder(values: np.ndarray) -> np.ndarray:
    """[rows, cols] with each 8 columns in AWQ's packing order, in output order."""
    rows, cols = values.shape
    out = np.empty_like(values).reshape(rows, cols // 8, 8)
    out[..., _AWQ_ORDER] = values.reshape(rows, cols // 8, 8)
    return out.reshape(rows, cols)


def block_weight(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int) -> QuantWeight:
    """Levels q [out, in] with zero points and fp16 scales [out, groups] as Q4_0 blocks (every
    zero point 8) or Q4_1 blocks."""
    out, inputs = q.shape
    per_block = np.repeat(np.arange(-(-inputs // group)), group)[:inputs:32]
    d = scales[:, per_block]  # [out, blocks]
    z = zeros[:, per_block]
    blocks = q.reshape(out, inputs // 32, 2, 16)
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).astype(np.uint8)  # [out, blocks, 16]
    parts = [d.astype(np.float16)[..., None].view(np.uint8)]
    if (z == 8).all():
        fmt = "Q4_0"
    else:
        fmt = "Q4_1"
        m = -(d.astype(np.float32) * z.astype(np.float32))
        parts.append(m.astype(np.float16)[..., None].view(np.uint8))
    data = np.concatenate([*parts, qs], axis=-1).reshape(out, -1)
    return QuantWeight(fmt, torch.from_numpy(np.ascontiguousarray(data)), inputs)


def int4_levels(weight: torch.Tensor, group: int, sym: bool) -> tuple[np.ndarray, ...]:
    """(q [out, in], zero points [out, groups], fp16 scales [out, groups]) of a float weight
    [out, in], each group's range in 15 steps (`sym`: zero point 8), for writing checkpoints."""
    out, inputs = weight.shape
    g = weight.float().reshape(out, inputs // group, group)
    if sym:
        scale = g.abs().amax(-1) / 7
        zero = torch.full_like(scale, 8)
    else:
        low, high = g.amin(-1), g.amax(-1)
        scale = (high - low) / 15
        zero = (-low / scale).round().clamp(1, 15)  # 1+: GPTQ's first format stores z - 1
    scale = scale.clamp(min=2**-24).half().float()
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).reshape(out, inputs)
    return q.to(torch.uint8).numpy(), zero.to(torch.uint8).numpy(), scale.half().numpy()


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """[rows, cols] 4-bit values as int32 [rows, cols / 8], eight a word, low bits first."""
    v = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
    return (v << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)


def gptq_tensors(q: np.ndarray, zero: np.ndarray, scale: np.ndarray, group: int) -> dict:
    """A linear's GPTQ tensors (original format) from `int4_levels`' arrays."""
    tensors = {
        "qweight": pack_nibbles(q).T,  # [in / 8, out]: eight inputs a word
        "qzeros": pack_nibbles(zero.T.astype(np.int64) - 1),  # [groups, out / 8], z - 1
        "scales": scale.T,
        "g_idx": (np.arange(q.shape[1]) // group).astype(np.int32),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}


def int4_scheme(model_dir: Path) -> Int4Scheme | None:
    """The int4 scheme of the checkpoint in `model_dir` (None: not a GPTQ / AWQ one)."""
    config = model_dir / "config.json"
    return Int4Scheme.from_config(json.loads(config.read_text())) if config.is_file() else None


def load_int4_checkpoint(model: nn.Module, path: Path, scheme: Int4Scheme) -> None:
    """Fill `model` (our modules, parameters allocated) from the safetensors in `path`: each
    quantized linear becomes a `QuantLinear` of blocks in place of its module (the parts of a
    fused projection side by side), every other tensor loads as `load_safetensors` loads it.
    Linears convert one at a time: loading holds the blocks and one linear's int4 tensors, not
    every linear's (at the 1B shape, ~100 MB less at the loading peak)."""
    files: dict[str, dict[str, Path]] = {}  # module name in the file -> its tensors' files
    params = dict(model.named_parameters())
    unused: set[str] = set()  # zero biases GPTQ writers save for linears that have none
    with contextlib.ExitStack() as stack:
        opened = {}
        for file in sorted(path.glob("*.safetensors")):
            f = opened[file] = stack.enter_context(safe_open(file, framework="pt"))
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                prefix, _, kind = name.rpartition(".")
                if kind in TENSORS:
                    files.setdefault(prefix, {})[kind] = file
                target = model.checkpoint_name_map(name) if kind == "bias" else None
                if target is not None and target[0] not in params:
                    if f.get_tensor(name).any():
                        raise ValueError(f"{file}: {name} is a bias the model does not have")
                    unused.add(name)
        parts: dict[str, list[tuple[int, QuantWeight]]] = {}  # parameter -> (shard, weight)
        for prefix, kinds in files.items():
            target = model.checkpoint_name_map(f"{prefix}.weight")
            if target is None:
                continue
            param_name, shard, _ = target
            tensors = {
                kind: opened[file].get_tensor(f"{prefix}.{kind}") for kind, file in kinds.items()
            }
            weight = block_weight(*scheme.unpack(tensors))
            parts.setdefault(param_name, []).append((shard or 0, weight))

    def rename(name: str):
        skip = name in unused or name.rpartition(".")[2] in TENSORS
        return None if skip else model.checkpoint_name_map(name)

    load_safetensors(model, path, rename, elsewhere=frozenset(parts))
    for param_name, pieces in parts.items():
        weights = [weight for _, weight in sorted(pieces, key=lambda piece: piece[0])]
        place_block_linear_(model, param_name.rpartition(".")[0], weights)
