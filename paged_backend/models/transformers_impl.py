"""Any decoder transformers can build, run on our paged KV cache (`model_impl="transformers"`).

transformers' own modeling code runs the layers; its attention goes through the public attention
interface: the function registered here under "paged" writes each layer's keys and values into
our cache blocks and attends with our backend, over the flattened batch (one row of all the
step's tokens, with our positions), as the native models do. So continuous batching, prefix
caching, chunked prefill and preemption work unchanged. transformers builds no attention mask:
the mask function registered with it returns none, and the backend masks by sequence.

Served: models whose transformers class takes the attention interface
(`_supports_attention_backend`). Refused with the reason (`transformers_config.check_servable`):
encoder-decoders and models without attention there (recurrent state). Sliding-window layers
pass their window to the backend, as the native models do (`ModelConfig.layer_windows` must
agree), and soft-capped layers (Gemma 2) their cap.
"""

from __future__ import annotations

import contextvars
from pathlib import Path

import torch
from torch import nn

from paged_backend.models.gemma import softcap_

_STEP: contextvars.ContextVar[tuple] = contextvars.ContextVar("paged_step")
ATTENTION = "paged"


def _paged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers' attention call for one layer: q [1, heads, T, d], k and v [1, kv_heads,
    T, d] of this step's tokens; returns [1, T, heads, d]. A sliding-window layer passes its
    window and a soft-capped one its cap, which the backend applies."""
    kv_caches, backend, meta = _STEP.get()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    head_dim = q.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:  # the backend scales by d ** -0.5
        q = q * (scaling * head_dim**0.5)
    out = backend.forward(
        *(q.contiguous(), k.contiguous(), v.contiguous(), kv_caches[module.layer_idx], meta),
        *(sliding_window, softcap),
    )
    return out.view(1, *out.shape[-3:]), None


def _no_mask(*args, **kwargs) -> None:
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _paged_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


class TransformersForCausalLM(nn.Module):
    """transformers' module for the checkpoint in `path`, called like our native models."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        _register()
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTENTION
        ).to(device)
        text = self.model.config.get_text_config()
        self.logit_softcap = getattr(text, "final_logit_softcapping", None)  # Gemma

    def forward(self, input_ids, positions, kv_caches, backend, meta, logits_indices):
        """The final hidden rows of `logits_indices` only, for `logits`."""
        token = _STEP.set((kv_caches, backend, meta))
        try:
            hidden = self.model.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            ).last_hidden_state[0]
        finally:
            _STEP.reset(token)
        return hidden[logits_indices]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden rows `x`, in fp32."""
        return softcap_(self.model.get_output_embeddings()(x).float(), self.logit_softcap)

    def logits_argmax(self, x: torch.Tensor, columns: int) -> None:
        """Never without the logits: transformers' head computes them whole."""
        return None
