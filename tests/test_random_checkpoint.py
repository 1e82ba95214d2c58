"""Random checkpoints of real shapes (`paged_backend.gguf`): the K-quant packers against gguf's
dequantizers, and the tiny shapes' files against llama.cpp's names and types, transformers' GGUF
loader and their own bf16 copy. Tiny shapes only: GGUFReader takes seconds a file over the
tokenizer's ~100k strings, so each file is read once."""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType, quant_shape_to_byte_shape
from gguf.quants import dequantize
from safetensors.torch import load_file

from paged_backend.default_model import default_model_file
from paged_backend.gguf import random_checkpoint as rc
from paged_backend.gguf.quantize import TYPES, quantize
from paged_backend.gguf.weights import apply_config_fixes, read_metadata
from paged_backend.models.config import ModelConfig

# Relative RMS error of a round trip on gaussian weights (measured: Q2_K 0.33, Q3_K 0.156, Q4_K
# 0.078, Q5_K 0.038, Q6_K 0.019; gguf's own Q4_0 0.086, Q5_0 0.043, Q8_0 0.005).
ERROR_BOUNDS = {"Q4_0": 0.1, "Q4_1": 0.1, "Q5_0": 0.05, "Q5_1": 0.05, "Q8_0": 0.01}
ERROR_BOUNDS |= {"Q2_K": 0.4, "Q3_K": 0.2, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def roundtrip(x: np.ndarray, type_name: str) -> np.ndarray:
    return dequantize(quantize(x, type_name), GGMLQuantizationType[type_name]).reshape(x.shape)


def rel_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact**2)))


def gaussian(rows: int, cols: int, std: float = 0.02, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * std).astype(np.float32)


@pytest.mark.parametrize("std", [0.02, 1.0])  # 0.02: Q6_K's d is an f16 subnormal
@pytest.mark.parametrize("type_name", TYPES)
def test_quantized_gaussian_weights_dequantize_close(type_name, std):
    x = gaussian(32, 1024, std)
    q = quantize(x, type_name)
    assert q.dtype == np.uint8
    assert q.shape == quant_shape_to_byte_shape(x.shape, GGMLQuantizationType[type_name])
    assert rel_rms(roundtrip(x, type_name), x) < ERROR_BOUNDS[type_name]


@pytest.mark.parametrize("type_name", K_TYPES)
def test_requantizing_dequantized_weights_keeps_them(type_name):
    """Values on a quantizer's grid (nearly) stay there: a second pass errs far less."""
    x = gaussian(64, 1024)
    once = roundtrip(x, type_name)
    twice = roundtrip(once, type_name)
    assert np.mean(twice == once) > 0.99
    assert rel_rms(twice, once) < 0.1 * rel_rms(once, x)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_zero_constant_and_one_signed_rows(type_name):
    g = gaussian(1, 512, 1.0)[0]
    rows = np.stack([np.zeros(512), np.full(512, 0.3), np.full(512, -2.5), -np.abs(g) - 1, g])
    rows = rows.astype(np.float32)
    out = roundtrip(rows, type_name)
    assert not out[0].any()
    np.testing.assert_allclose(out[1:3], rows[1:3], rtol=1e-3)
    assert rel_rms(out[3], rows[3]) < ERROR_BOUNDS[type_name]  # negative only


@pytest.mark.parametrize("type_name", K_TYPES)
def test_an_outlier_survives_and_spoils_only_its_super_block(type_name):
    x = gaussian(1, 512, 1.0)
    x[0, 100] = 1000.0
    out = roundtrip(x, type_name)
    assert abs(out[0, 100] - 1000.0) < 10.0
    half = quantize(x, type_name).shape[1] // 2  # super-blocks are independent
    np.testing.assert_array_equal(quantize(x, type_name)[:, half:], quantize(x[:, 256:], type_name))
    # its neighbours: coarser, yet better than zeros, where sub-block scales have the range
    # for 1/400 of it (not Q2_K's 15 steps of d, nor Q3_K's 31 with levels -4..3)
    if type_name not in ("Q2_K", "Q3_K"):
        rest = np.delete(np.arange(256), 100)
        assert rel_rms(out[0, rest], x[0, rest]) < 1.0


def test_quantize_rejects_what_no_block_holds():
    with pytest.raises(ValueError, match="Q4_K rows hold a multiple of 256"):
        quantize(np.zeros((2, 384), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="cannot quantize to 'IQ2_XS'"):
        quantize(np.zeros((2, 256), np.float32), "IQ2_XS")
    with pytest.raises(ValueError, match=r"\[rows, cols\]"):
        quantize(np.zeros(256, np.float32), "Q8_0")


def test_use_more_bits_picks_llama_cpp_s_layers():
    """Llama 3.2 1B's Q4_K_M files have Q6_K attn_v and ffn_down on these 8 of 16 layers."""
    assert [i for i in range(16) if rc.use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(2) if rc.use_more_bits(i, 2)] == [1]


def test_q4_k_m_falls_back_where_rows_are_not_whole_super_blocks():
    """Qwen2.5-0.5B: rows of 896 take Q5_0 for Q4_K and Q8_0 for Q6_K, as in llama.cpp."""
    shape = rc.SHAPES["qwen2.5-0.5b"]
    types = {spec.gguf_name: rc.gguf_type(spec, shape, "q4_k_m") for spec in rc.tensor_plan(shape)}
    assert len(types) == 1 + 24 * 12 + 1
    assert types["token_embd.weight"] == "Q8_0"  # the tied output
    assert (types["blk.0.attn_q.weight"], types["blk.0.attn_v.weight"]) == ("Q5_0", "Q8_0")
    assert types["blk.3.attn_v.weight"] == "Q5_0"
    assert (types["blk.0.ffn_down.weight"], types["blk.3.ffn_down.weight"]) == ("Q6_K", "Q4_K")
    assert (types["blk.0.attn_q.bias"], types["output_norm.weight"]) == ("F32", "F32")
    assert {rc.gguf_type(spec, shape, "q4_0") for spec in rc.tensor_plan(shape)} == {"Q4_0", "F32"}


def test_q3_k_m_gives_more_bits_where_llama_cpp_does():
    """Q3_K_M (llama.cpp's rules for it): Q3_K for q, k, gate and up; attn_v Q5_K on the first
    two layers, then Q4_K; ffn_down Q5_K on the first sixteenth, then Q4_K; attn_output Q4_K;
    the output (here the tied embeddings) Q6_K; Q4_0 and Q5_1 where rows are not whole
    super-blocks."""
    shape = rc.SHAPES["llama-3.2-1b"]
    types = {spec.gguf_name: rc.gguf_type(spec, shape, "q3_k_m") for spec in rc.tensor_plan(shape)}
    assert types["token_embd.weight"] == "Q6_K"
    layer = {
        n: [types[f"blk.{i}.{n}.weight"] for i in (0, 1, 2, 15)] for n in ("attn_v", "ffn_down")
    }
    assert layer == {
        "attn_v": ["Q5_K", "Q5_K", "Q4_K", "Q4_K"],
        "ffn_down": ["Q5_K"] + ["Q4_K"] * 3,
    }
    assert {types[f"blk.7.{n}.weight"] for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")} == {
        "Q3_K"
    }
    assert types["blk.7.attn_output.weight"] == "Q4_K"
    counts = Counter(rc.gguf_type(spec, shape, "q3_k_m") for spec in rc.tensor_plan(shape))
    assert counts == {"F32": 33, "Q3_K": 64, "Q4_K": 45, "Q5_K": 3, "Q6_K": 1}
    qwen = rc.SHAPES["qwen2.5-0.5b"]
    fallback = {rc.gguf_type(spec, qwen, "q3_k_m") for spec in rc.tensor_plan(qwen)}
    assert {"Q4_0", "Q5_1"} <= fallback and "Q3_K" not in fallback


def test_q5_k_m_is_q4_k_m_s_mix_on_q5_k():
    shape = rc.SHAPES["llama-3.2-1b"]
    q4, q5 = (
        [rc.gguf_type(spec, shape, fmt) for spec in rc.tensor_plan(shape)]
        for fmt in ("q4_k_m", "q5_k_m")
    )
    assert [t.replace("Q4_K", "Q5_K") for t in q4] == q5
    assert Counter(q5) == {"F32": 33, "Q5_K": 96, "Q6_K": 17}


@pytest.mark.parametrize(
    ("shape_name", "counts"),
    [  # llama.cpp's log of the real models' Q4_K_M files ("type q4_K: 96 tensors"...)
        ("llama-3.2-1b", {"F32": 34, "Q4_K": 96, "Q6_K": 17}),
        ("llama-3.2-3b", {"F32": 58, "Q4_K": 168, "Q6_K": 29}),
        ("llama-3.1-8b", {"F32": 66, "Q4_K": 193, "Q6_K": 33}),
        ("qwen2.5-0.5b", {"F32": 121, "Q5_0": 132, "Q8_0": 13, "Q4_K": 12, "Q6_K": 12}),
    ],
)
def test_q4_k_m_mix_counts_are_the_real_files(shape_name, counts):
    shape = rc.SHAPES[shape_name]
    types = [rc.gguf_type(spec, shape, "q4_k_m") for spec in rc.tensor_plan(shape)]
    types += ["F32"] if shape.rope_scaling else []  # rope_freqs.weight
    assert Counter(types) == counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    assert rc.write_checkpoint("tiny", out) == [
        out / "bf16",
        *(out / f"tiny-{name}.gguf" for name in ("Q4_K_M", "Q4_0", "Q8_0")),
    ]
    return out


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2")
    rc.main(["--shape", "tiny-qwen2", "--out", str(out), "--formats", "bf16,q4_k_m"])
    return out


@functools.cache
def read_gguf(path: Path) -> GGUFReader:
    return GGUFReader(path)


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's row order from llama.cpp's (transformers' reverse of the permutation)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def gguf_weights(path: Path, shape: rc.Shape) -> dict[str, np.ndarray]:
    """The file's tensors dequantized by gguf, in Hugging Face's names, row order and norm
    values (Gemma's less the one llama.cpp adds, as transformers reads them)."""
    tensors = {t.name: t for t in read_gguf(path).tensors}
    weights = {}
    for spec in rc.tensor_plan(shape):
        tensor = tensors[spec.gguf_name]
        values = dequantize(tensor.data, tensor.tensor_type).reshape(spec.shape)
        if shape.gguf_arch == "llama" and spec.role in ("attn_q.weight", "attn_k.weight"):
            values = unpermute(values, shape.heads if "attn_q" in spec.role else shape.kv_heads)
        if shape.gemma and spec.role.endswith("norm.weight"):
            values = values - np.float32(1)
        weights[spec.hf_name] = values
    return weights


def tiny_q4_k_m_types(tied: bool, qwen2: bool) -> dict[str, str]:
    """llama.cpp's Q4_K_M mix on two layers, written out: layer 1 is the last eighth."""
    types = {"token_embd.weight": "Q6_K" if tied else "Q4_K", "output_norm.weight": "F32"}
    types |= {} if tied else {"output.weight": "Q6_K"}
    types |= {} if qwen2 else {"rope_freqs.weight": "F32"}
    for i, more in ((0, "Q4_K"), (1, "Q6_K")):
        types |= {f"blk.{i}.{n}.weight": "F32" for n in ("attn_norm", "ffn_norm")}
        types |= {f"blk.{i}.{n}.weight": more for n in ("attn_v", "ffn_down")}
        plain = ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")
        types |= {f"blk.{i}.{n}.weight": "Q4_K" for n in plain}
        types |= {f"blk.{i}.attn_{p}.bias": "F32" for p in "qkv"} if qwen2 else {}
    return types


def file_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in read_gguf(path).tensors}


def test_tensor_names_and_types_are_llama_cpp_s(tiny, tiny_qwen2):
    assert file_types(tiny / "tiny-Q4_K_M.gguf") == tiny_q4_k_m_types(tied=False, qwen2=False)
    assert file_types(tiny_qwen2 / "tiny-qwen2-Q4_K_M.gguf") == tiny_q4_k_m_types(True, True)
    names = tiny_q4_k_m_types(tied=False, qwen2=False).keys()
    for fmt in ("Q4_0", "Q8_0"):  # every 2-D weight in the file's type
        expected = {n: "F32" if "norm" in n or "rope" in n else fmt for n in names}
        assert file_types(tiny / f"tiny-{fmt}.gguf") == expected


def _plain_fields(path: Path) -> dict:
    fields = read_gguf(path).fields.items()
    return {k: f.contents() for k, f in fields if not k.startswith(("GGUF.", "tokenizer."))}


def test_metadata_is_convert_hf_to_gguf_s(tiny, tiny_qwen2):
    common = {"general.type": "model", "general.quantization_version": 2}
    llama = {
        **common,
        "general.architecture": "llama",
        "general.name": "random tiny",
        "llama.block_count": 2,
        "llama.context_length": 131072,
        "llama.embedding_length": 256,
        "llama.feed_forward_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 500000.0,
        "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)),
        "llama.attention.key_length": 64,
        "llama.attention.value_length": 64,
        "llama.vocab_size": 49152,
        "llama.rope.dimension_count": 64,
    }
    for fmt, file_type in (("Q4_K_M", 15), ("Q4_0", 2), ("Q8_0", 7)):
        expected = {**llama, "general.file_type": file_type}
        assert _plain_fields(tiny / f"tiny-{fmt}.gguf") == expected
    qwen2 = {k.replace("llama.", "qwen2."): v for k, v in llama.items() if "length" in k}
    qwen2 |= {
        **common,
        "general.architecture": "qwen2",
        "general.name": "random tiny-qwen2",
        "general.file_type": 15,
        "qwen2.block_count": 2,
        "qwen2.context_length": 32768,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.rope.freq_base": 1e6,
        "qwen2.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
    }
    del qwen2["qwen2.attention.key_length"], qwen2["qwen2.attention.value_length"]
    assert _plain_fields(tiny_qwen2 / "tiny-qwen2-Q4_K_M.gguf") == qwen2


def test_the_tokenizer_is_the_default_model_s(tiny):
    fields = read_gguf(tiny / "tiny-Q8_0.gguf").fields
    ours = {k: (f.contents(), f.types) for k, f in fields.items() if k.startswith("tokenizer.")}
    default = {
        key: (value, types) for key, value, types in rc.tokenizer_fields(default_model_file())
    }
    assert ours == default
    assert len(ours["tokenizer.ggml.tokens"][0]) == 49152


def test_a_larger_vocabulary_pads_the_tokens_with_unused_ones():
    """Gemma 3's 262,144 rows: the default tokenizer's tokens, then `<unused{i}>` ones of type
    UNUSED (llama.cpp sizes the vocabulary by the token list); the other keys unchanged."""
    assert rc.SHAPES["gemma-3-270m"].vocab == 262144
    fields = rc.tokenizer_fields(default_model_file())
    padded = {key: value for key, value, _ in rc.padded_tokenizer(fields, 262144)}
    default = {key: value for key, value, _ in fields}
    tokens, types = padded["tokenizer.ggml.tokens"], padded["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 262144
    assert tokens[:49152] == default["tokenizer.ggml.tokens"]
    assert tokens[49152] == "<unused0>" and tokens[-1] == f"<unused{262144 - 49152 - 1}>"
    assert set(types[49152:]) == {int(TokenType.UNUSED)}
    rest = padded.keys() - {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
    assert {key: padded[key] for key in rest} == {key: default[key] for key in rest}
    assert {k: v for k, v, _ in rc.padded_tokenizer(fields, 49152)} == default


@pytest.mark.parametrize(
    ("shape_name", "fmt"),
    [("tiny", "Q4_K_M"), ("tiny", "Q4_0"), ("tiny", "Q8_0"), ("tiny-qwen2", "Q4_K_M")],
)
def test_gguf_weights_are_the_bf16_weights_quantized(tiny, tiny_qwen2, shape_name, fmt):
    """Un-permuted for llama (qwen2 is not permuted: the same check fails if it were)."""
    out = tiny if shape_name == "tiny" else tiny_qwen2
    path = out / f"{shape_name}-{fmt}.gguf"
    bf16 = load_file(out / "bf16" / "model.safetensors")
    types, ours = file_types(path), gguf_weights(path, rc.SHAPES[shape_name])
    for spec in rc.tensor_plan(rc.SHAPES[shape_name]):
        values, expected = ours[spec.hf_name], bf16[spec.hf_name].float().numpy()
        if types[spec.gguf_name] == "F32":
            np.testing.assert_array_equal(values, expected, err_msg=spec.hf_name)
        else:
            assert rel_rms(values, expected) < ERROR_BOUNDS[types[spec.gguf_name]], spec.hf_name


def test_transformers_loads_the_gguf_as_gguf_dequantizes_it(tiny):
    """Its weights are gguf's dequantization of our bytes (rows un-permuted as transformers
    does) and close to the bf16 copy's (which fails if we did not permute)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny, gguf_file="tiny-Q4_K_M.gguf", dtype=torch.float32
    )
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert not config.tie_word_embeddings
    state = model.state_dict()
    ours = gguf_weights(tiny / "tiny-Q4_K_M.gguf", rc.SHAPES["tiny"])
    assert ours.keys() <= state.keys()
    bf16 = load_file(tiny / "bf16" / "model.safetensors")
    for name, values in ours.items():
        np.testing.assert_array_equal(state[name].numpy(), values, err_msg=name)
        assert rel_rms(values, bf16[name].float().numpy()) < ERROR_BOUNDS["Q4_K"], name


def test_bf16_copy_is_a_hugging_face_model_of_the_shape(tiny, tiny_qwen2):
    from transformers import AutoConfig, AutoTokenizer

    for out, shape in ((tiny, rc.SHAPES["tiny"]), (tiny_qwen2, rc.SHAPES["tiny-qwen2"])):
        config = AutoConfig.from_pretrained(out / "bf16")
        assert config.architectures == [shape.architecture]
        assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
            shape.hidden,
            shape.layers,
            shape.intermediate,
        )
        assert config.tie_word_embeddings == shape.tied
        ours = ModelConfig.from_dir(out / "bf16")
        assert (ours.num_kv_heads, ours.head_dim, ours.qkv_bias) == (
            2,
            64,
            shape.gguf_arch == "qwen2",
        )
        assert ours.kv_window is None  # Qwen2.5's sliding window stays off
        assert len(AutoTokenizer.from_pretrained(out / "bf16")) == 49152
    assert ModelConfig.from_dir(tiny / "bf16").rope_scaling["rope_type"] == "llama3"


def test_weights_follow_the_seed(tiny):
    """Each tensor from its own generator: the files of any run hold the same weights."""
    bf16 = load_file(tiny / "bf16" / "model.safetensors")
    plan = rc.tensor_plan(rc.SHAPES["tiny"])
    assert set(bf16) == {spec.hf_name for spec in plan}
    for index, spec in enumerate(plan):
        assert torch.equal(bf16[spec.hf_name], rc.random_tensor(spec, 0, index))
    embed = bf16["model.embed_tokens.weight"].float()
    assert abs(embed.std().item() - rc.INIT_STD) < 1e-3
    assert not torch.equal(rc.random_tensor(plan[0], 1, 0), bf16[plan[0].hf_name])
    assert torch.equal(bf16["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))


def test_rope_freqs_divide_the_frequencies_as_transformers_scales_llama3(tiny):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(tiny / "bf16")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (5e5 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    tensors = {t.name: t for t in read_gguf(tiny / "tiny-Q4_0.gguf").tensors}
    factors = np.asarray(tensors["rope_freqs.weight"].data)
    np.testing.assert_allclose(factors, (plain / scaled).numpy(), rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 32.0  # both ends and a ramp between


def test_an_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    def fail(spec, seed, index):
        if index == 3:
            raise RuntimeError("interrupted")
        return real(spec, seed, index)

    real = rc.random_tensor
    monkeypatch.setattr(rc, "random_tensor", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        rc.write_checkpoint("tiny", tmp_path, ("bf16", "q8_0"))
    written = [p.name for p in tmp_path.rglob("*") if p.suffix in (".gguf", ".safetensors")]
    assert written == [], written
    assert not list(tmp_path.rglob("*.partial"))


def test_unknown_shapes_and_formats_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'llama-9b'"):
        rc.write_checkpoint("llama-9b", tmp_path)
    with pytest.raises(ValueError, match=r"unknown formats \['iq4_xs'\]"):
        rc.write_checkpoint("tiny", tmp_path, ("bf16", "iq4_xs"))
    assert not any(tmp_path.iterdir())  # refused before anything is written


# The other families, each written once (bf16 and Q4_K_M) for the tests below.
FAMILIES = ("tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-phi3")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[rc.Shape, Path, Path]:
    """(shape, bf16 directory, Q4_K_M file) of one of FAMILIES."""
    out = tmp_path_factory.mktemp(request.param)
    bf16, q4_k_m = rc.write_checkpoint(request.param, out, ("bf16", "q4_k_m"))
    return rc.SHAPES[request.param], bf16, q4_k_m


# Each family's tensors of one layer, as llama.cpp's converter names them.
LAYER_TENSORS = {
    "llama": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"),
    "qwen3": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm"),
    "gemma2": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm"),
    "gemma3": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm"),
}
LAYER_TENSORS["qwen3"] += ("attn_output", "ffn_norm")
LAYER_TENSORS["gemma2"] += ("ffn_norm", "post_ffw_norm")
LAYER_TENSORS["gemma3"] += ("attn_output", "post_attention_norm", "ffn_norm", "post_ffw_norm")
LAYER_TENSORS = {k: (*v, "ffn_gate", "ffn_up", "ffn_down") for k, v in LAYER_TENSORS.items()}
# Phi-3's fused projections: attn_qkv, and ffn_up holding gate and up
LAYER_TENSORS["phi3"] = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")


def test_family_tensors_are_llama_cpp_s_names_and_q4_k_m_types(family):
    """Names from gguf's own table of the architecture's tensors; Q4_K_M's types as llama.cpp
    picks them: Q6_K for the output (the embeddings where tied) and for attn_v and ffn_down on
    `use_more_bits` layers, Q5_K for a fused attn_qkv, F32 norms."""
    import gguf

    shape, _, path = family
    types = file_types(path)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == shape.gguf_arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for name in types:
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.removesuffix(".weight")) in known, name
    top = {"token_embd.weight": "Q6_K" if shape.tied else "Q4_K", "output_norm.weight": "F32"}
    expected = top | ({} if shape.tied else {"output.weight": "Q6_K"})
    for i in range(shape.layers):
        for part in LAYER_TENSORS[shape.gguf_arch]:
            more = part in ("attn_v", "ffn_down") and rc.use_more_bits(i, shape.layers)
            kind = "F32" if part.endswith("norm") else "Q6_K" if more else "Q4_K"
            kind = "Q5_K" if part == "attn_qkv" else kind
            expected[f"blk.{i}.{part}.weight"] = kind
    assert types == expected


# convert_hf_to_gguf.py's keys beyond general.*, for each family's tiny shape.
FAMILY_METADATA = {
    "tiny-qwen3": {
        "qwen3.context_length": 40960,
        "qwen3.attention.head_count_kv": 2,
        "qwen3.rope.freq_base": 1e6,
        "qwen3.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        "qwen3.attention.key_length": 192,
        "qwen3.attention.value_length": 192,
    },
    "tiny-mistral": {  # LlamaModel's keys: no key_length (no head_dim in config.json)
        "llama.context_length": 32768,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 1e6,
        "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)),
        "llama.vocab_size": 49152,
        "llama.rope.dimension_count": 64,
    },
    "tiny-gemma2": {  # Gemma2Model's keys: no rope base
        "gemma2.context_length": 8192,
        "gemma2.attention.head_count_kv": 2,
        "gemma2.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        "gemma2.attention.key_length": 256,
        "gemma2.attention.value_length": 256,
        "gemma2.attn_logit_softcapping": 40.0,
        "gemma2.final_logit_softcapping": 20.0,
        "gemma2.attention.sliding_window": 16,
    },
    "tiny-phi3": {  # Phi3MiniModel's keys: no key_length, a window of 0 (none)
        "phi3.context_length": 4096,
        "phi3.rope.scaling.original_context_length": 4096,
        "phi3.attention.head_count_kv": 2,
        "phi3.rope.freq_base": 1e4,
        "phi3.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)),
        "phi3.rope.dimension_count": 64,
        "phi3.attention.sliding_window": 0,
    },
    "tiny-gemma3": {
        "gemma3.block_count": 6,
        "gemma3.context_length": 32768,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.attention.sliding_window": 16,
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
    },
}


def test_family_metadata_is_convert_hf_to_gguf_s(family):
    shape, _, path = family
    name = path.name.removesuffix("-Q4_K_M.gguf")
    arch = shape.gguf_arch
    expected = {
        "general.type": "model",
        "general.quantization_version": 2,
        "general.architecture": arch,
        "general.name": f"random {name}",
        "general.file_type": 15,
        f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512,
        f"{arch}.attention.head_count": 4,
    }
    assert _plain_fields(path) == expected | FAMILY_METADATA[name]


def test_family_gguf_weights_are_the_bf16_weights_quantized(family):
    """Gemma's norms less one are the bf16 copy's (a file without the added one fails);
    Mistral's q/k rows un-permuted (as llama's)."""
    shape, bf16_dir, path = family
    bf16 = load_file(bf16_dir / "model.safetensors")
    types, ours = file_types(path), gguf_weights(path, shape)
    for spec in rc.tensor_plan(shape):
        values, expected = ours[spec.hf_name], bf16[spec.hf_name].float().numpy()
        if types[spec.gguf_name] == "F32":  # 1 + w rounds to float32: w within its last bit
            np.testing.assert_allclose(values, expected, rtol=0, atol=2e-7, err_msg=spec.hf_name)
        else:
            assert rel_rms(values, expected) < ERROR_BOUNDS[types[spec.gguf_name]], spec.hf_name
    norms = [bf16[s.hf_name] for s in rc.tensor_plan(shape) if s.hf_name.endswith("norm.weight")]
    assert all(bool((n == 1).all()) != shape.gemma for n in norms)  # Gemma's: offsets from 1


def test_transformers_reads_each_family_s_file(family):
    """transformers' GGUF loader, given the keys its config reader drops (`config_fixes`, as
    our conversion does), gives the bf16 copy's class and configuration (Mistral's file is a
    `llama` one: Llama's class, the same modules) and gguf's dequantization of our bytes as its
    weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape, bf16_dir, path = family
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    apply_config_fixes(config, read_metadata(path)[1])
    model = AutoModelForCausalLM.from_pretrained(path.parent, config=config, gguf_file=path.name)
    expected = AutoConfig.from_pretrained(bf16_dir)
    mistral = shape.architecture == "MistralForCausalLM"
    assert type(model).__name__ == ("LlamaForCausalLM" if mistral else shape.architecture)
    config = model.config
    for key in (
        *("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
        *("head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar"),
        *("attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings"),
        *("intermediate_size", "rope_parameters"),
    ):
        if hasattr(expected, key) and not (mistral and key == "sliding_window"):
            assert getattr(config, key) == getattr(expected, key), key
    state = model.state_dict()
    for name, values in gguf_weights(path, shape).items():
        np.testing.assert_array_equal(state[name].float().numpy(), values, err_msg=name)
