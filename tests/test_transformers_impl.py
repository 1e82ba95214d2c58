"""The transformers-modeling path (`model_impl="transformers"`): architectures without a native
implementation (and Gemma 2 and 3, forced there) run transformers' own modules on the paged
cache, token for token like transformers (fp32), with prefix caching on and off and under
preemption; a native family gives the same tokens through it; what it cannot serve is refused
with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import save_file
from test_models import GEMMA2, GEMMA3, hf_greedy

from paged_backend import LLM, SamplingParams
from paged_backend.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SHARED = "Retrieved context: the stone bridge over the Alm was built in 1642 by the masons. "
PROMPTS = [SHARED + q for q in ("When was it built?", "Who built it?", "Over which river?")]
NUM_TOKENS = 16
# architecture -> (its config class, what differs from `make_tiny_model`'s fields)
FALLBACK = {
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", {"rotary_pct": 0.25, "num_key_value_heads": 4}),
    "Phi3ForCausalLM": ("Phi3Config", {}),  # native: here for the entry points
    "Gemma3ForCausalLM": (  # native too: its fallback parity is forced through transformers
        "Gemma3TextConfig",
        {  # a sliding layer and a global one; a query scale that is not head_dim ** -0.5
            "sliding_window": 256,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    "Gemma2ForCausalLM": (  # native too; soft-capped attention scores
        "Gemma2Config",
        {"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0},
    ),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GraniteForCausalLM": (
        "GraniteConfig",
        {  # Granite scales attention, residuals and logits by its own multipliers
            "attention_multiplier": 0.1,
            "residual_multiplier": 0.5,
            "embedding_multiplier": 2.0,
            "logits_scaling": 4.0,
        },
    ),
}


def make_fallback_model(path: Path, default_model_path: Path, architecture: str) -> Path:
    config_class, overrides = FALLBACK[architecture]
    return make_tiny_model(
        path,
        default_model_path,
        architecture,
        config_class=config_class,
        vector_noise=0.3,
        pad_token_id=0,
        **overrides,
    )


def ours(path: Path, **engine_args) -> tuple[list[list[int]], list[list[int]], LLM]:
    llm = LLM(model=str(path), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module", params=sorted(set(FALLBACK) - {"Phi3ForCausalLM"}))
def fallback_model(request, tmp_path_factory, default_model_path) -> tuple[Path, str]:
    """A model and the `model_impl` that runs it through transformers' modules ("auto" where
    there is no native path)."""
    path = tmp_path_factory.mktemp(request.param)
    impl = "transformers" if request.param in SUPPORTED_ARCHITECTURES else "auto"
    return make_fallback_model(path, default_model_path, request.param), impl


def test_the_fallback_matches_transformers(fallback_model):
    from transformers import AutoModelForCausalLM

    path, impl = fallback_model
    assert ModelConfig.from_dir(path, impl).impl == "transformers"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt_ids, cached, llm = ours(path, num_kv_blocks=128, model_impl=impl)
    assert llm.stats()["prefix_cache_hits"] > 0  # the shared context came from the cache
    want = [hf_greedy(hf, ids, NUM_TOKENS) for ids in prompt_ids]
    assert cached == want
    _, uncached, _ = ours(path, num_kv_blocks=128, enable_prefix_caching=False, model_impl=impl)
    assert uncached == want
    # Too few blocks for all three at once: some are preempted and recomputed.
    _, tight, llm = ours(path, num_kv_blocks=16, block_size=4, model_impl=impl)
    assert llm.stats()["num_preemptions"] > 0 and tight == want


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("Qwen2ForCausalLM", {}), ("Gemma3ForCausalLM", GEMMA3), ("Gemma2ForCausalLM", GEMMA2)],
    ids=["qwen2", "gemma3", "gemma2"],
)
def test_a_native_family_gives_the_same_tokens_through_transformers(
    tmp_path, default_model_path, architecture, overrides
):
    path = make_tiny_model(
        tmp_path, default_model_path, architecture, vector_noise=0.3, **overrides
    )
    native = ours(path, num_kv_blocks=128)
    assert native[2].engine.model_config.impl == "native"
    through = ours(path, num_kv_blocks=128, model_impl="transformers")
    assert through[2].engine.model_config.impl == "transformers" and through[1] == native[1]


def test_a_variant_the_native_modules_lack_runs_through_transformers(tmp_path, tiny_model):
    """A rope type our modules do not implement: "auto" takes transformers' modules, "native"
    refuses it by name."""
    path = tmp_path / "yarn"
    path.mkdir()
    for f in tiny_model.iterdir():
        (path / f.name).symlink_to(f) if f.name != "config.json" else None
    raw = json.loads((tiny_model / "config.json").read_text())
    raw["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 512,
    }
    (path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(path).impl == "transformers"
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dir(path, "native")


@pytest.mark.parametrize(
    ("architecture", "config", "reason"),
    [
        (
            "T5ForConditionalGeneration",
            {"model_type": "t5", "is_encoder_decoder": True},
            "encoder-decoder",
        ),
        ("MambaForCausalLM", {"model_type": "mamba"}, "recurrent"),
        ("BertModel", {"model_type": "bert"}, "not a causal language model"),
    ],
)
def test_what_cannot_be_served_is_refused_with_the_reason(tmp_path, architecture, config, reason):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **config}))
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"cannot serve architecture {architecture}: .*{reason}"):
        LLM(model=str(tmp_path))


def test_native_only_is_refused_for_other_families(tmp_path, default_model_path):
    path = make_fallback_model(tmp_path, default_model_path, "Olmo2ForCausalLM")
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM.*no native implementation"):
        LLM(model=str(path), model_impl="native")
    with pytest.raises(ValueError, match="model_impl must be one of auto, native, transformers"):
        LLM(model=str(path), model_impl="hf")


# A Gemma 2 style template: no system role (it raises), "model" turns.
NO_SYSTEM_ROLE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize("system_role", [True, False], ids=["system-role", "no-system-role"])
@pytest.mark.parametrize("architecture", ["Gemma3ForCausalLM", "Phi3ForCausalLM"])
def test_every_entry_point_serves_gemma3_and_phi3(
    tmp_path, default_model_path, architecture, system_role
):
    """`LLM`, `AsyncEngine`, `ChatPaged` and LlamaIndex's `PagedLLM` give the same greedy
    answer to a chat with a system prompt; where the template has no system role, the system
    prompt opens the first user turn."""
    import asyncio

    from langchain_core.messages import HumanMessage, SystemMessage
    from llama_index.core.llms import ChatMessage

    from langchain_paged import ChatPaged
    from llama_index.llms.paged import PagedLLM
    from paged_backend import AsyncEngine, get_engine, release_engine

    path = make_fallback_model(tmp_path, default_model_path, architecture)
    if not system_role:
        (path / "chat_template.jinja").write_text(NO_SYSTEM_ROLE)
    system, question = "Answer in one word.", "Which river runs under the bridge?"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    args = {"dtype": "float32", "num_kv_blocks": 64}
    params = SamplingParams(temperature=0, max_tokens=6)

    out = LLM(model=str(path), **args).chat(messages, params, use_tqdm=False)[0]
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) == 6
    if not system_role:
        assert f"<start_of_turn>user\n{system}\n\n{question}<end_of_turn>" in out.prompt

    async def streamed() -> str:
        engine = AsyncEngine.from_model(str(path), **args)
        try:
            prompt = engine.apply_chat_template(messages)
            outputs = [out async for out in engine.generate(prompt, params, request_id="r")]
            return outputs[-1].outputs[0].text
        finally:
            engine.shutdown()

    assert asyncio.run(streamed()) == text
    engine = get_engine(str(path), **args)  # shared by both adapters
    try:
        chat = ChatPaged(model=str(path), temperature=0, max_tokens=6, **args)
        assert chat.invoke([SystemMessage(system), HumanMessage(question)]).content == text
        llm = PagedLLM(model=str(path), temperature=0, max_tokens=6, engine_args=args)
        reply = llm.chat(
            [ChatMessage(role="system", content=system), ChatMessage(content=question)]
        )
        assert reply.message.content == text
    finally:
        release_engine(engine)
