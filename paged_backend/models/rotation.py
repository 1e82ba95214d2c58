"""Rotations of a Llama-family model's weights that leave its outputs as they were but spread its
activations' outliers over many values, so that int8 activations (`quantization="int8"`, one
scale a block of 32 or 256 inputs) lose less of them: QuaRot's construction (Ashkboos et al.,
2024) with Hadamard blocks, from the weights alone (no calibration text).

- The residual stream is rotated by Q = H diag(s): Hadamard blocks the size of the hidden
  width's activation blocks (`activation_block`), random signs s. RMSNorm commutes with an
  orthogonal map once its weight is folded into the linears it feeds (the norm of a rotated row
  is its own), so the embedding rows become Q e, each linear reading the stream (q/k/v,
  gate/up) W diag(g) Q^T, each one writing it (o, down, their biases) Q W. The head's rows
  become W Q^T (a tied head: the table's, as they are), and its input, the final norm's
  rotated rows x without its weight g, turns into Q (g * Q^T x) = H (g * (H x)) at each step
  (`LlamaForCausalLM.head_rotation`, a few sampled rows): rotated again, g in place, no second
  table beside a tied one.
- Each value head is rotated by the Hadamard matrix R of head_dim (where a power of two):
  v_proj's rows R W_v, the head's columns of o_proj W_o R^T. The K/V cache holds rotated
  values, attention's output comes out rotated and o_proj turns it back; nothing runs at a
  step.
- The down projection's inputs (the gated products, whose outliers are the largest) are rotated
  at each step (`MLP.down_hadamard`, ~n log2(block) adds a row) against its weight W_d H^T.

Families whose norms do not commute with a rotation (Gemma's norms of each sublayer's output,
weights stored as offsets from 1) are left as they are.
"""

from __future__ import annotations

import torch

from paged_backend.cpu import ops as cpu_ops
from paged_backend.models.llama import DecoderLayer, LlamaForCausalLM

SEED = 0  # of the residual stream's signs: the same rotation at every load


def activation_block(width: int) -> int:
    """The Hadamard block for inputs of `width`: the block their int8 activations are scaled by
    (`int8_weight`: Q8_256 where 256 divides the inputs, else Q8_0's 32)."""
    return 256 if width % 256 == 0 else 32


def rotatable(model: torch.nn.Module) -> bool:
    """Whether `rotate_` keeps this model's outputs: a Llama-family model with plain pre-norm
    layers, inputs in whole blocks of 32 and fp32 or bf16 weights (the C op's)."""
    config = model.config
    return (
        isinstance(model, LlamaForCausalLM)
        and all(p.dtype in (torch.float32, torch.bfloat16) for p in model.parameters())
        and type(model).layer_class is DecoderLayer
        and type(model).embed is LlamaForCausalLM.embed
        and type(model).logits is LlamaForCausalLM.logits
        and config.hidden_size % 32 == 0
        and config.intermediate_size % 32 == 0
    )


def _rotate_outputs_(linear: torch.nn.Linear, block: int, signs: torch.Tensor) -> None:
    """A linear writing the residual stream: Q W and Q b."""
    cpu_ops.hadamard_columns_(linear.weight.data, block, signs)
    if linear.bias is not None:
        cpu_ops.hadamard_(linear.bias.data, block, signs)


@torch.no_grad()
def rotate_(model: LlamaForCausalLM) -> bool:
    """Rotate the model's weights in place (module docstring), where `rotatable`; returns
    whether it did. Its norms' weights become ones."""
    if not rotatable(model):
        return False
    config = model.config
    hidden, head_dim = config.hidden_size, config.head_dim
    block, down_block = activation_block(hidden), activation_block(config.intermediate_size)
    generator = torch.Generator().manual_seed(SEED)
    signs = torch.randint(0, 2, (hidden,), generator=generator).float() * 2 - 1
    cpu_ops.hadamard_(model.embed_tokens.weight.data, block, signs)
    if model.lm_head is not None:  # (tied: the table's rows, rotated above)
        cpu_ops.hadamard_(model.lm_head.weight.data, block, signs)
    model.head_rotation = (model.norm.weight.detach().float().clone(), block)
    model.norm.weight.fill_(1.0)
    v_start = (config.num_heads + config.num_kv_heads) * head_dim
    heads = head_dim & (head_dim - 1) == 0 and head_dim <= cpu_ops.HADAMARD_COLUMN_BLOCK
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for norm, linear in (
            (layer.input_layernorm, attn.qkv_proj),
            (layer.post_attention_layernorm, mlp.gate_up_proj),
        ):
            cpu_ops.hadamard_(linear.weight.data, block, norm.weight.float() * signs)
            norm.weight.fill_(1.0)
        if heads:  # R W_v head by head, and W_o R^T
            cpu_ops.hadamard_columns_(attn.qkv_proj.weight.data[v_start:], head_dim)
            if attn.qkv_proj.bias is not None:
                cpu_ops.hadamard_(attn.qkv_proj.bias.data[v_start:], head_dim)
            cpu_ops.hadamard_(attn.o_proj.weight.data, head_dim)
        cpu_ops.hadamard_(mlp.down_proj.weight.data, down_block)  # W_d H^T
        mlp.down_hadamard = down_block
        _rotate_outputs_(attn.o_proj, block, signs)
        _rotate_outputs_(mlp.down_proj, block, signs)
    return True
