"""GPTQ and AWQ int4 checkpoints, written here from tiny random models in each format's own
layout, served by the GGUF block kernels: the blocks hold the checkpoint's values, and the
engine's logits follow the same weights in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import logits_of, make_tiny_model, served_format
from safetensors.torch import load_file, save_file

from paged_backend import LLM, SamplingParams, cpu
from paged_backend.cpu.quant import QuantLinear, dequantize
from paged_backend.int4_checkpoint import (
    Int4Scheme,
    block_weight,
    gptq_tensors,
    int4_levels,
    pack_nibbles,
)

needs_ops = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def checkpoint_tensors(method: str, q, zero, scale, group: int) -> dict[str, torch.Tensor]:
    if method == "gptq":
        return gptq_tensors(q, zero, scale, group)
    # AWQ: [in, out / 8], each word's outputs in AWQ's order
    order = np.concatenate([c * 8 + np.array(AWQ_ORDER) for c in range(q.shape[0] // 8)])
    tensors = {
        "qweight": pack_nibbles(q.T[:, order]),
        "qzeros": pack_nibbles(zero.T[:, order]),
        "scales": scale.T,
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}


def write_int4(source: Path, out: Path, method: str, group: int, sym: bool) -> Path:
    """`source`'s model as a `method` checkpoint in `out`, and in `out`-fp32 the fp32 weights it
    stands for (s * (q - z))."""
    reference = out.with_name(out.name + "-fp32")
    for path in (out, reference):
        shutil.copytree(source, path)
    weights = load_file(source / "model.safetensors")
    quantized, dequantized = {}, dict(weights)
    for name, w in weights.items():
        prefix, _, kind = name.rpartition(".")
        if kind != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
            quantized[name] = w
            continue
        g = w.shape[1] if group == -1 else group  # -1: a row's inputs in one group
        q, zero, scale = int4_levels(w, g, sym)
        groups = np.repeat(np.arange(q.shape[1] // g), g)
        values = scale[:, groups].astype(np.float32) * (q.astype(np.float32) - zero[:, groups])
        dequantized[name] = torch.from_numpy(values)
        for kind, t in checkpoint_tensors(method, q, zero, scale, g).items():
            quantized[f"{prefix}.{kind}"] = t
        if f"{prefix}.bias" not in weights:  # as AutoGPTQ writes a linear without one
            quantized[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
    save_file(quantized, out / "model.safetensors")
    save_file(dequantized, reference / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
         "zero_point": True}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
              "sym": sym}
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("method", "sym"), [("gptq", True), ("gptq", False), ("awq", False)])
def test_blocks_hold_the_checkpoint_values(method, sym):
    """Unpacked and packed as GGUF blocks, a linear dequantizes to s * (q - z): exactly where
    every zero point is 8 (Q4_0), else to the fp16 rounding of -s * z (Q4_1)."""
    gen = torch.Generator().manual_seed(0)
    w, group = torch.randn(48, 128, generator=gen), 64
    q, zero, scale = int4_levels(w, group, sym)
    scheme = Int4Scheme.from_config(
        {"quantization_config": {"quant_method": method, "bits": 4, "group_size": group}}
    )
    *unpacked, unpacked_group = scheme.unpack(checkpoint_tensors(method, q, zero, scale, group))
    assert all(np.array_equal(a, b) for a, b in zip(unpacked, (q, zero, scale), strict=True))
    assert unpacked_group == group
    weight = block_weight(q, zero, scale, group)
    assert weight.format == ("Q4_0" if sym else "Q4_1")
    groups = np.repeat(np.arange(2), group)
    want = scale[:, groups].astype(np.float32) * (q.astype(np.float32) - zero[:, groups])
    got = dequantize(weight).float().numpy()
    if sym:
        assert np.array_equal(got, want)
    else:
        step = scale[:, groups].astype(np.float32)
        assert np.abs(got - want).max() <= (step * zero[:, groups] * 2**-10).max()


@needs_ops
@pytest.mark.parametrize(
    ("method", "sym", "architecture", "group"),
    [
        ("gptq", True, "LlamaForCausalLM", 32),
        ("gptq", False, "Qwen2ForCausalLM", 32),  # biases on q/k/v
        ("gptq", True, "LlamaForCausalLM", -1),  # one group a row
        ("awq", False, "LlamaForCausalLM", 64),
    ],
)
def test_an_int4_checkpoint_runs_on_its_blocks(
    tmp_path, default_model_path, one_thread, method, sym, architecture, group
):
    source = make_tiny_model(
        tmp_path / "source", default_model_path, architecture, vector_noise=0.1
    )
    path = write_int4(source, tmp_path / method, method, group, sym)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    reference = LLM(model=str(path) + "-fp32", dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert model.fused_decode is not None  # the one-call decode step takes the blocks
    down_format = served_format("Q4_0") if sym else "Q4_1"
    assert {w.format for w in layer.mlp.down_proj.weights} == {down_format}
    ids = llm.get_tokenizer()("The archive of Lindenfeld holds maps of the river valley").input_ids
    got, want = logits_of(llm, ids), logits_of(reference, ids)
    # int8 activations: close to the fp32 product of the same weights (other weights, or the
    # same levels misread, are off by the logits' own size)
    assert (got - want).norm() < 0.1 * want.norm()  # 0.02-0.03 here; misread levels: > 1
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("quant", "match"),
    [
        ({"bits": 8, "group_size": 128}, "bits must be 4"),
        ({"bits": 4, "group_size": 48}, "group_size must be -1 or a positive multiple of 32"),
        ({"bits": 4, "group_size": 0}, "group_size must be -1 or a positive multiple of 32"),
        ({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ],
)
def test_int4_configurations_the_kernels_cannot_serve_are_named(quant, match):
    config = {"quantization_config": {"quant_method": "gptq", **quant}}
    with pytest.raises(ValueError, match=match):
        Int4Scheme.from_config(config)


def test_act_order_groups_are_refused():
    gen = torch.Generator().manual_seed(1)
    q, zero, scale = int4_levels(torch.randn(16, 64, generator=gen), 32, True)
    tensors = checkpoint_tensors("gptq", q, zero, scale, 32)
    tensors["g_idx"] = torch.from_numpy(np.arange(64, dtype=np.int32) % 2)  # desc_act order
    scheme = Int4Scheme("gptq", 32, 1)
    with pytest.raises(ValueError, match="act-order groups"):
        scheme.unpack(tensors)


@needs_ops
@pytest.mark.parametrize("tied", [True, False])
def test_an_fp16_head_stays_fp16_with_the_same_logits(
    tmp_path, default_model_path, one_thread, monkeypatch, tied
):
    """A GPTQ file's fp16 head (and tied embedding) is read in fp16, half the bytes of fp32,
    giving the fp32 head's logits bit for bit."""
    source = make_tiny_model(tmp_path / "source", default_model_path, tie_word_embeddings=tied)
    path = write_int4(source, tmp_path / "gptq", "gptq", 32, True)
    weights = load_file(path / "model.safetensors")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
              path / "model.safetensors")  # fmt: skip
    # the C linear at these rows either way (timed, an fp32 head may run torch's instead)
    args = dict(model=str(path), dtype="float32", num_kv_blocks=64, cpu_gemm_max_rows=64)
    halved = LLM(**args)
    model = halved.engine.runner.model
    assert model._head_weight().dtype == torch.float16
    assert model.embed_tokens(torch.tensor([5])).dtype == torch.float32
    monkeypatch.setattr(type(model), "half_head_", lambda self: None)
    full = LLM(**args)
    assert full.engine.runner.model._head_weight().dtype == torch.float32
    ids = halved.get_tokenizer()("The archive of Lindenfeld holds maps").input_ids
    assert torch.equal(logits_of(halved, ids), logits_of(full, ids))
    assert halved.stats()["weights_bytes"] < full.stats()["weights_bytes"]


def test_a_nonzero_bias_the_model_lacks_is_refused(tmp_path, default_model_path):
    source = make_tiny_model(tmp_path / "source", default_model_path)
    path = write_int4(source, tmp_path / "gptq", "gptq", 32, True)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] += 1
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"down_proj\.bias is a bias the model does not have"):
        LLM(model=str(path), num_kv_blocks=16)


def test_an_int4_checkpoint_refuses_other_quantizations(tmp_path, default_model_path):
    source = make_tiny_model(tmp_path / "source", default_model_path)
    path = write_int4(source, tmp_path / "gptq", "gptq", 32, True)
    with pytest.raises(ValueError, match="gptq checkpoint runs on CPU with quantization=None"):
        LLM(model=str(path), quantization="int8", num_kv_blocks=16)
