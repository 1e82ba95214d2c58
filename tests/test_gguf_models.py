"""GGUF files served with their weights in the file's block formats (`paged_backend.gguf`), on
the default model's Q4_1 file: loading, parity of the dequantized load with the converted copy,
and the engine's behaviour (batching, prefix caching, no leaks) on quantized weights."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free

from paged_backend import LLM, SamplingParams, cpu
from paged_backend.cpu.quant import QuantEmbedding, QuantLinear
from paged_backend.default_model import default_model_file
from paged_backend.model_loader import gguf_weights_file, resolve_model_path

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

PROMPTS = [
    "The capital of France is",
    "List three uses of copper:",
    "def fibonacci(n):",
    "Summarize: the river rose after three days of rain, and the bridge was closed.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized():
    return LLM(model=str(default_model_file()), dtype="float32", num_kv_blocks=256)


def test_a_gguf_path_resolves_to_its_config_and_tokenizer_without_weights():
    gguf = default_model_file()
    directory = resolve_model_path(gguf)
    assert gguf_weights_file(directory) == gguf.absolute()
    assert (directory / "config.json").is_file() and not list(directory.glob("*.safetensors"))
    assert resolve_model_path(None) != directory  # the embedded default runs its converted copy


def test_linears_and_embedding_keep_the_files_blocks(quantized):
    model = quantized.engine.runner.model
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(model.embed_tokens, QuantEmbedding)
    assert [w.format for w in attn.qkv_proj.weights] == ["Q4_1"] * 3
    assert model.embed_tokens.weight_q.format == "Q8_0"
    assert isinstance(model.cpu_head, QuantLinear)  # tied: the head reads the embedding's blocks
    weights = sum(p.numel() for p in model.parameters())
    assert weights < 100_000  # only norms: no dequantized copy of any linear


def test_dequantized_load_gives_the_converted_models_tokens(llm_fp32):
    """quantization="none" reads the same file into full-precision weights: the same values as
    transformers' conversion, so the same greedy tokens (checks names, q/k order, norms)."""
    dequantized = LLM(model=str(default_model_file()), dtype="float32", quantization="none")
    ours = dequantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    reference = llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [pair for row in zip(a, b, strict=True) for pair in zip(*row, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_batching_and_prefix_hits_keep_the_quantized_outputs(quantized):
    """The quantized linears are exact per row whatever the batch (tests/test_quant_kernels.py);
    attention is not bit-identical across batch shapes, and an activation a last bit apart can
    round to another int8 level, so a near-tie may flip late in a sequence: nearly all tokens
    agree, and every block comes back."""
    together = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    alone = [quantized.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    again = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)  # prompts now in the cache
    ids = [[o.outputs[0].token_ids for o in run] for run in (together, alone, again)]
    assert [seq[:4] for seq in ids[0]] == [seq[:4] for seq in ids[1]]
    assert _agreement(ids[0], ids[1]) >= 0.9 and _agreement(ids[0], ids[2]) >= 0.9
    assert again[0].num_cached_tokens > 0
    assert_all_blocks_free(quantized.engine)


def test_quantized_greedy_text_stays_close_to_the_dequantized(llm_fp32, quantized):
    """Activations go to int8 per block of 32: most greedy tokens stay those of the full-precision
    product (the measured agreement is in examples/quantized_accuracy.py)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = quantized.generate(PROMPTS, params, use_tqdm=False)
    reference = llm_fp32.generate(PROMPTS, params, use_tqdm=False)
    first = [o.outputs[0].token_ids[:4] for o in ours]
    assert sum(a == r.outputs[0].token_ids[:4] for a, r in zip(first, reference, strict=True)) >= 3


def test_stats_report_weights_near_the_file_size_and_kv_cache_committed_on_use(quantized):
    quantized.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    stats = quantized.engine.stats()
    file_size = default_model_file().stat().st_size
    # the file's blocks (its Q8_0 embedding read by the head too, once) plus fp32 norms
    assert file_size * 0.9 < stats["weights_bytes"] <= file_size * 1.15
    assert 0 < stats["weights_resident_bytes"] <= stats["weights_bytes"]
    assert 0 < stats["kv_cache_resident_bytes"] < stats["kv_cache_bytes"]
