"""`kv_cache_dtype="float16"` (the default for quantized weights in float32 on CPU): an fp32
model's K/V kept in fp16. A token holds half the bytes; every path (prefill, decode, drafts,
prefix hits) attends the values the cache holds, so a prefix-cache hit gives a miss's tokens
and drafting keeps greedy output unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import OracleProposer

from paged_backend import LLM, SamplingParams, cpu
from paged_backend.cpu.quant import QuantLinear
from paged_backend.gguf.random_checkpoint import write_checkpoint

SHARED = [1, *range(300, 360)]  # a 61-token prefix: prefilled past the C kernel's 33 rows
PROMPTS = [[*SHARED, 7, 8, 9], [*SHARED, 11, 400, 12, 13], [*SHARED, 5]]


def _outputs(llm: LLM, prompts, max_tokens=12):
    params = SamplingParams(temperature=0, ignore_eos=True, logprobs=3, max_tokens=max_tokens)
    # one request at a time: later ones hit the blocks of the first where caching is on
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("cpu_kernels", [None, False], ids=["c-kernels", "torch"])
def test_prefix_hits_give_the_tokens_of_misses(tiny_model, one_thread, cpu_kernels):
    if cpu_kernels is None and not cpu.available():
        pytest.skip("no C compiler")
    runs, hits = [], []
    # Both engines run the same kernels at each step size: timings taken on a busy machine are
    # not kept, and two engines timing anew may pick differently (bits apart, not tokens).
    rows = {"cpu_gemm_max_rows": 32} if cpu_kernels is None else {}
    for caching in (True, False):
        llm = LLM(
            model=str(tiny_model),
            dtype="float32",
            kv_cache_dtype="float16",
            enable_prefix_caching=caching,
            cpu_kernels=cpu_kernels,
            **rows,
        )
        runs.append(_outputs(llm, PROMPTS))
        hits.append(llm.stats()["prefix_cache_hits"])
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.float16
    assert hits[0] > 0 and not hits[1]
    # the same tokens, and log-probabilities apart by summation order only (up to ~4e-5 seen:
    # a prefill of other rows may round an element of K/V to the next fp16); a path attending
    # unrounded K/V moves them ~1.5e-3
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    assert _largest_difference(runs[0], runs[1]) < 3e-4


def _largest_difference(run, other) -> float:
    return max(
        abs(a[t].logprob - b[t].logprob)
        for (_, lps), (_, other_lps) in zip(run, other, strict=True)
        for a, b in zip(lps, other_lps, strict=True)
        for t in a
    )


def test_a_token_holds_half_the_bytes(tiny_model):
    budget = 4 << 20
    engines = {
        kv: LLM(
            model=str(tiny_model), dtype="float32", kv_cache_dtype=kv, kv_cache_memory_bytes=budget
        )
        for kv in ("auto", "float16")
    }
    blocks = {kv: llm.engine.runner.num_blocks for kv, llm in engines.items()}
    assert blocks["float16"] == 2 * blocks["auto"]
    sizes = {kv: llm.stats()["kv_cache_bytes"] for kv, llm in engines.items()}
    assert sizes["float16"] == sizes["auto"]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "quantized", "want"),
    [
        ("auto", True, torch.float16),  # llama.cpp's cache type for the files it runs
        ("float32", True, torch.float32),
        ("auto", False, torch.float32),  # the model's dtype
    ],
)
def test_auto_keeps_quantized_models_k_v_in_fp16(tmp_path, kv_cache_dtype, quantized, want):
    gguf = write_checkpoint("tiny", tmp_path, ("q4_0",))[0]
    llm = LLM(
        model=str(gguf),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        quantization=None if quantized else "none",
        num_kv_blocks=16,
    )
    model = llm.engine.runner.model
    assert any(isinstance(m, QuantLinear) for m in model.modules()) == quantized
    assert llm.engine.runner.kv_caches[0][0].dtype == want


def test_fp16_cache_tracks_the_fp32_cache(llm_fp32):
    """On the real model, fp16 rounding of K/V moves log-probabilities by little and greedy
    tokens rarely."""
    prompts = ["The three primary colours are", "Water boils at", "A short poem about autumn:"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    half = LLM(dtype="float32", kv_cache_dtype="float16")
    got = half.generate(prompts, params, use_tqdm=False)
    want = llm_fp32.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        g, w = g.outputs[0], w.outputs[0]
        pairs = zip(g.token_ids, w.token_ids, strict=True)
        n = next((i for i, (a, b) in enumerate(pairs) if a != b), len(g.token_ids))
        assert n >= 8  # the first tokens agree
        for i in range(n):
            a, b = g.logprobs[i][g.token_ids[i]].logprob, w.logprobs[i][w.token_ids[i]].logprob
            assert abs(a - b) < 0.05


def test_drafting_keeps_greedy_output(tiny_model, one_thread):
    """Drafts (the plain output, wrong from a random point on) verified over fp16 caches give
    the plain tokens."""
    plain = LLM(model=str(tiny_model), dtype="float32", kv_cache_dtype="float16")
    prompts = [[301, *range(300, 340)], [302, 9, 8, 7]]  # OracleProposer: first tokens differ
    want = _outputs(plain, prompts, max_tokens=20)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(
        model=str(tiny_model), dtype="float32", kv_cache_dtype="float16", speculative_config=spec
    )
    truth = {p[0]: p + tokens for p, (tokens, _) in zip(prompts, want, strict=True)}
    for seed in range(2):
        llm.engine.scheduler.proposer = OracleProposer(truth, 4, seed)
        got = _outputs(llm, prompts, max_tokens=20)
        assert [t for t, _ in got] == [t for t, _ in want]
        # a verifying step's k/v come from linears of more rows (fp32 results ~1e-7 apart); an
        # element that lands on the other side of an fp16 rounding moves by one fp16 step
        assert _largest_difference(got, want) < 2e-3
    assert llm.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be 'auto', 'float16' or 'float32'"),
        ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "'float16' is for float32 models"),
        ({"kv_cache_dtype": "float32", "dtype": "bfloat16"}, "'float32' is for float32 models"),
    ],
)
def test_bad_kv_cache_dtypes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)
