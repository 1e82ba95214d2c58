"""Sliding-window attention done properly: models generating far past their window match
transformers token for token (fp32), natively and through transformers' modules, with every layer
windowed (Mistral) or windowed layers interleaved with global ones (Qwen2's `max_window_layers`,
Gemma 2 and 3 both ways, Gemma 2 with soft-capped scores); with prefix caching on and off, chunked
prefill and preemption. Where every layer is windowed, a request holds only the blocks its window
reaches."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_tiny_model
from test_models import hf_greedy

from paged_backend import LLM, SamplingParams
from paged_backend.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 16
BLOCK = 4
SHARED = "Retrieved context: the stone bridge over the Alm was built in 1642 by the masons. "
PROMPTS = [SHARED + q for q in ("When was it built?", "Who built it?", "Over which river?")]
NUM_TOKENS = 40  # prompts of ~25 tokens: every sequence ends ~4 windows long
GEMMA3 = {  # its sliding layer on its own rope base; untied, see test_models.GEMMA3
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_local_base_freq": 1000.0,
    "query_pre_attn_scalar": 24,
    "pad_token_id": 0,
}
GEMMA2 = {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "pad_token_id": 0}
# name -> (architecture, its config class, config fields, model_impl, each layer's window)
MODELS = {
    "mistral": ("MistralForCausalLM", None, {}, "native", (WINDOW, WINDOW)),
    "qwen2-interleaved": (
        "Qwen2ForCausalLM",
        None,
        {"use_sliding_window": True, "max_window_layers": 1},
        "native",
        (None, WINDOW),
    ),
    "mistral-through-transformers": (
        "MistralForCausalLM",
        None,
        {},
        "transformers",
        (WINDOW, WINDOW),
    ),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3, "native", (WINDOW, None)),
    "gemma3-through-transformers": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        GEMMA3,
        "transformers",
        (WINDOW, None),
    ),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", GEMMA2, "native", (WINDOW, None)),
    "gemma2-through-transformers": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        GEMMA2,
        "transformers",
        (WINDOW, None),
    ),
}
ENGINES = {  # engine arguments -> what they put under test
    "cached": {},
    "uncached": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 8},  # chunks that start inside and past the window
    "preempted": {"max_num_batched_tokens": 16},  # and too few blocks for all three at once
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def windowed_model(request, tmp_path_factory, default_model_path):
    architecture, config_class, fields, impl, windows = MODELS[request.param]
    path = make_tiny_model(
        tmp_path_factory.mktemp(request.param),
        default_model_path,
        architecture,
        config_class=config_class,
        vector_noise=0.3,
        sliding_window=WINDOW,
        **fields,
    )
    return path, impl, windows


@pytest.fixture(scope="module")
def transformers_tokens(windowed_model) -> dict[tuple[int, ...], list[int]]:
    from transformers import AutoModelForCausalLM

    path, _, _ = windowed_model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    llm_tokenizer = LLM(model=str(path), dtype="float32", num_kv_blocks=2).get_tokenizer()
    ids = [tuple(llm_tokenizer(p).input_ids) for p in PROMPTS]
    return {i: hf_greedy(hf, list(i), NUM_TOKENS) for i in ids}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_past_the_window_tokens_equal_transformers(windowed_model, transformers_tokens, engine):
    path, impl, windows = windowed_model
    assert ModelConfig.from_dir(path, impl).layer_windows == windows
    args = dict(ENGINES[engine], model_impl=impl, block_size=BLOCK)
    if engine == "preempted":  # a request holds 18 blocks, or under windows only 9 at most
        args["num_kv_blocks"] = 18 if None in windows else 11
    llm = LLM(model=str(path), dtype="float32", **args)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert len(out.prompt_token_ids) + NUM_TOKENS > 3 * WINDOW
        assert out.outputs[0].token_ids == transformers_tokens[tuple(out.prompt_token_ids)]
    stats = llm.stats()
    if engine == "cached":
        assert stats["prefix_cache_hits"] > 0
    if engine == "preempted":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # nothing leaked


def held_blocks_while_generating(path: Path, prompt: str, max_tokens: int) -> tuple[int, list]:
    """The most blocks the engine held at once while generating one request, and its tokens."""
    llm = LLM(model=str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    most, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        most = max(most, engine.kv.num_blocks - engine.kv.pool.num_free)
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return most, outputs[-1].outputs[0].token_ids


def test_a_windowed_model_holds_only_its_window(tmp_path, default_model_path):
    """A 150-token generation on a Mistral with a 16-token window holds at most the window's
    blocks plus a step's chunk (8 tokens) and a partial block at each end: 8 blocks, where the
    same model with a global layer holds every block of the sequence. The tokens stay
    transformers'."""
    from transformers import AutoModelForCausalLM

    windowed = make_tiny_model(
        tmp_path / "w", default_model_path, "MistralForCausalLM", sliding_window=WINDOW
    )
    interleaved = make_tiny_model(
        tmp_path / "i",
        default_model_path,
        "Qwen2ForCausalLM",
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=1,
    )
    prompt, new = PROMPTS[0], 150
    most, tokens = held_blocks_while_generating(windowed, prompt, new)
    assert most <= (WINDOW + 8) // BLOCK + 2
    ids = LLM(model=str(windowed), num_kv_blocks=2).get_tokenizer()(prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(windowed, dtype="float32").eval()
    assert tokens == hf_greedy(hf, ids, new)
    most_global, _ = held_blocks_while_generating(interleaved, prompt, new)
    assert most_global == -(-(len(ids) + new - 1) // BLOCK)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_freed_block_is_never_read_as_another_one(tmp_path, default_model_path, dtype):
    """Freed table entries name no block (FREED_BLOCK), and every step checks the entries its
    kernels read: a window off by one block (simulated: one more leading block freed than the
    window allows) fails that request's step with a clear error, instead of reading block 0, which
    belongs to another request. The engine goes on, and nothing leaks."""
    path = make_tiny_model(
        tmp_path / "w", default_model_path, "MistralForCausalLM", sliding_window=WINDOW
    )
    llm = LLM(model=str(path), dtype=dtype, block_size=BLOCK, max_num_batched_tokens=8)
    kv = llm.engine.kv
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = llm.generate(PROMPTS[1], greedy)[0].outputs[0].token_ids
    exact = kv._num_dead_blocks
    kv._num_dead_blocks = lambda num_computed: exact(num_computed + BLOCK)
    with pytest.raises(RuntimeError, match=r"block table entry .* must be a block id"):
        llm.generate(PROMPTS[0], greedy)
    kv._num_dead_blocks = exact
    assert kv.pool.num_free == kv.num_blocks
    assert llm.generate(PROMPTS[1], greedy)[0].outputs[0].token_ids == want
