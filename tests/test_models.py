"""Our Llama-family modules and loader against transformers, on tiny random checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import QUOTED, TOKENIZER_FILES, hf_forward, longrope, make_tiny_model
from safetensors.torch import load_file, save_file

from paged_backend import LLM, SamplingParams, cpu, model_runner
from paged_backend.cpu import ops as cpu_ops
from paged_backend.model_loader import resolve_model_path
from paged_backend.models.config import ModelConfig
from paged_backend.models.gemma import softcap_
from paged_backend.models.llama import ROPE_CHUNK, RotaryEmbedding, rope_inv_freq

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]",
    "Q: 17 x 23?\nA:",
]
NUM_TOKENS = 24
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head_dim has low, medium and high frequency bands.
    "original_max_position_embeddings": 64,
}
# A sliding layer (on its own rope base) before a global one (with linear rope scaling), and a
# query scale that is not head_dim ** -0.5. Untied: with a tied head, a tiny random Gemma echoes
# its last input token (the embedding scale makes a token's own logit win).
GEMMA3 = {
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 8,
    "rope_local_base_freq": 1000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "query_pre_attn_scalar": 24,
    "pad_token_id": 0,
}
# Gemma 2's layers alternate sliding and global on one rope; attention scores capped at 2, low
# enough to change the tokens here (its default 50 does not bite on a tiny model).
GEMMA2 = {
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 2.0,
    "pad_token_id": 0,
}
# LongRoPE from an original length of 16: the second prompt (27 tokens) is longer, so it runs on
# the long factors throughout, as transformers prefills it; the others (5 and 13 tokens) start on
# the short factors and switch as they generate past 16. Phi-4-mini rotates 3/4 of each head.
PHI3_LONGROPE = {"pad_token_id": 0, **longrope(16)}
PHI4_MINI = {"pad_token_id": 0, "partial_rotary_factor": 0.75, **longrope(12)}
ARCHITECTURES = [
    pytest.param("LlamaForCausalLM", {}, id="llama"),
    pytest.param("LlamaForCausalLM", {"tie_word_embeddings": True}, id="llama-tied"),
    pytest.param("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}, id="llama3-rope"),
    pytest.param(
        "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, id="linear"
    ),
    pytest.param("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, id="llama-biases"),
    pytest.param("MistralForCausalLM", {"num_key_value_heads": 4}, id="mistral-mha"),
    pytest.param("Qwen2ForCausalLM", {"num_key_value_heads": 1}, id="qwen2-mqa"),
    pytest.param("Qwen3ForCausalLM", {"head_dim": 32}, id="qwen3"),
    pytest.param("Phi3ForCausalLM", {"pad_token_id": 0}, id="phi3"),
    pytest.param("Phi3ForCausalLM", PHI3_LONGROPE, id="phi3-longrope"),
    pytest.param(
        "Phi3ForCausalLM", {"pad_token_id": 0, "partial_rotary_factor": 0.75}, id="phi3-partial"
    ),
    pytest.param("Phi3ForCausalLM", PHI4_MINI, id="phi4-mini"),
    pytest.param("Gemma3ForCausalLM", GEMMA3, id="gemma3"),
    pytest.param("Gemma2ForCausalLM", GEMMA2, id="gemma2"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


def perturb_vectors(path: Path) -> None:
    """Randomize norm weights and biases: their init values (ones, zeros) would hide a
    weight that is loaded into the wrong place or not used at all."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if t.dim() == 1:
            tensors[name] = t + 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy loop with its own KV cache, never stopping at EOS."""
    ids, cache, tokens = torch.tensor([prompt_ids]), None, []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out, cache = hf_forward(model, ids, cache)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(ids.item())
    return tokens


def our_greedy(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]


def clone_dir(src: Path, dst: Path, skip: tuple[str, ...] = (), config: dict | None = None) -> Path:
    """Link a model directory's files into `dst`, leaving out `skip`, updating config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip and f.name != "config.json":
            (dst / f.name).symlink_to(f)
    raw = json.loads((src / "config.json").read_text())
    raw.update(config or {})
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(("architecture", "overrides"), ARCHITECTURES)
def test_greedy_matches_transformers(tmp_path, default_model_path, architecture, overrides):
    """Every supported architecture variant decodes token for token like transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, default_model_path, architecture, **overrides)
    perturb_vectors(path)
    config = ModelConfig.from_dir(path)
    assert config.architecture == architecture and config.impl == "native"
    if "rope_scaling" in overrides:
        assert config.rope_scaling["rope_type"] == overrides["rope_scaling"]["rope_type"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt_ids, ours = our_greedy(path)
    for ids, tokens in zip(prompt_ids, ours, strict=True):
        assert tokens == hf_greedy(hf, ids, NUM_TOKENS)


def test_phi3_rope_fields_in_the_checkpoints_layout(tmp_path, default_model_path):
    """Phi-3.5/Phi-4-mini config.json as the hub checkpoints write it (`rope_scaling` by `type`,
    the original length and the partial rotary factor at the top level) reads as transformers'
    own layout does."""
    path = make_tiny_model(tmp_path / "new", default_model_path, "Phi3ForCausalLM", **PHI4_MINI)
    new = ModelConfig.from_dir(path, "native")
    assert new.rotary_dim == 12 and new.long_rope_from == 16
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    old = dict(
        raw,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=0.75,
        original_max_position_embeddings=16,
        rope_scaling={
            "type": "longrope",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
        },
    )
    path = clone_dir(path, tmp_path / "old")
    (path / "config.json").write_text(json.dumps(old))
    assert ModelConfig.from_dir(path, "native") == new


def test_longrope_modes_hold_under_chunking_prefix_caching_and_preemption(
    tmp_path, default_model_path
):
    """A prompt longer than LongRoPE's original length stays on the long factors when its prefill
    is chunked and when a shorter prompt (on the short factors) has cached its first blocks: it
    neither hits those blocks nor leaves its own to short prompts, and hits them itself when
    asked again. Prompts of both kinds batched and preempted (recomputed past the original
    length) keep theirs too. transformers' tokens every time."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, default_model_path, "Phi3ForCausalLM", **PHI3_LONGROPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    chunked = dict(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=8)
    llm = LLM(num_kv_blocks=64, **chunked)
    long_ids = llm.engine.tokenize(PROMPTS[1])
    short_ids = long_ids[:12]
    assert len(long_ids) > 16 >= len(short_ids)
    for ids, cached in [(short_ids, 0), (long_ids, 0), (long_ids, 24), (short_ids, 8)]:
        out = llm.generate(ids, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NUM_TOKENS)
    tight = LLM(num_kv_blocks=20, **chunked)  # a sequence ends on 13 blocks: not three at once
    outs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, NUM_TOKENS)


def test_sharded_checkpoint_loads_the_same(tmp_path, default_model_path):
    """Weights split over several safetensors files (with an index) give the same model."""
    from transformers import AutoModelForCausalLM

    single = make_tiny_model(tmp_path / "single", default_model_path)
    perturb_vectors(single)
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for name in TOKENIZER_FILES:
        if (single / name).exists():
            (sharded / name).write_bytes((single / name).read_bytes())
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert our_greedy(sharded) == our_greedy(single)


@pytest.fixture
def read_into(monkeypatch) -> list[torch.dtype]:
    """The dtypes of the parameters a checkpoint is read into, as the engine loads it."""
    dtypes = []
    real = model_runner.load_safetensors

    def load(module, *args, **kwargs):
        dtypes.extend(p.dtype for p in module.parameters())
        return real(module, *args, **kwargs)

    monkeypatch.setattr(model_runner, "load_safetensors", load)
    return dtypes


@pytest.mark.parametrize("quantization", [None, "none"])
def test_bf16_weights_are_read_straight_into_bf16(
    tmp_path, default_model_path, read_into, quantization
):
    """A bf16 engine reads an fp32 checkpoint into bf16 parameters (no fp32 copy first, which
    doubled a load's peak memory): each weight rounded to nearest even, as a cast of the fp32
    weight gives."""
    path = make_tiny_model(tmp_path, default_model_path)
    weights = load_file(path / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=16, quantization=quantization)
    model = llm.engine.runner.model
    assert read_into and set(read_into) == {torch.bfloat16}
    embedding = model.embed_tokens.weight
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, weights["model.embed_tokens.weight"].to(torch.bfloat16))
    norm = model.norm.weight
    assert torch.equal(norm, weights["model.norm.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_int8_reads_a_checkpoint_in_the_model_dtype_only_where_it_is_stored_so(
    tmp_path, default_model_path, read_into, stored
):
    """`quantization="int8"` quantizes from the checkpoint's values: a bf16 checkpoint is read
    straight into a bf16 model (an fp32 copy first peaked at 2.7x the weights for a 1B), an
    fp32 one into fp32 (read into bf16, its values would round before they are quantized)."""
    from safetensors.torch import save_file

    path = make_tiny_model(tmp_path, default_model_path)
    weights = load_file(path / "model.safetensors")
    save_file({k: v.to(stored) for k, v in weights.items()}, path / "model.safetensors")
    LLM(model=str(path), dtype="bfloat16", num_kv_blocks=16, quantization="int8")
    assert read_into and set(read_into) == {stored}


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        LLM(model=str(missing))


def test_non_gguf_file_is_refused(tmp_path):
    file = tmp_path / "weights.pt"
    file.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=re.escape(str(file))):
        resolve_model_path(file)


def test_rotary_tables_grow_as_positions_are_reached(tiny_model):
    """The cos/sin rows are computed for the positions a step reaches, in the same chunks
    whatever the order (so the same values), and equal the whole table's."""
    config = ModelConfig.from_dir(tiny_model, "native")
    whole = RotaryEmbedding(config, 9000)
    whole.reserve(9000)
    assert whole.capacity == 9000
    grown = RotaryEmbedding(config, 9000)
    assert grown.capacity == ROPE_CHUNK  # a short model's start
    cos, sin = grown(torch.tensor([3, 5000, 17]))
    assert grown.capacity == 8192  # doubled until position 5000 fits
    assert torch.equal(cos[:, 0], whole.cos[[3, 5000, 17]])
    assert torch.equal(sin[:, 0], whole.sin[[3, 5000, 17]])
    stepwise = RotaryEmbedding(config, 9000)
    for position in (2500, 4500, 8999):
        stepwise(torch.tensor([position]))
    assert stepwise.capacity == 9000
    assert torch.equal(stepwise.cos, whole.cos) and torch.equal(stepwise.sin, whole.sin)
    positions = torch.arange(9000, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    torch.testing.assert_close(whole.cos, torch.cat((freqs, freqs), -1).cos(), atol=1e-6, rtol=0)


def test_unsupported_rope_scaling_is_named(tmp_path, tiny_model):
    """A rope type our modules do not implement is refused by the native path, not silently
    run as plain RoPE (`model_impl="auto"` hands such a variant to transformers' modules, see
    test_transformers_impl)."""
    path = clone_dir(tiny_model, tmp_path / "m", config={"rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="yarn"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=8, model_impl="native")
    with pytest.raises(ValueError, match=r"transformers cannot read .*factor"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=8)  # yarn needs its factor


def test_longrope_factors_of_the_wrong_length_are_refused(tmp_path, tiny_model):
    """One factor per rotated frequency (head_dim 16: 8): transformers' Llama only warns."""
    scaling = dict(longrope(16)["rope_scaling"], original_max_position_embeddings=16)
    scaling["short_factor"] = scaling["short_factor"][:-1]
    path = clone_dir(tiny_model, tmp_path / "m", config={"rope_scaling": scaling})
    with pytest.raises(ValueError, match="short_factor needs 8 values"):
        ModelConfig.from_dir(path, "native")


@pytest.mark.parametrize("damage", ["truncated", "bad-header", "empty"])
def test_corrupt_safetensors_names_the_file(tmp_path, tiny_model, damage):
    data = (tiny_model / "model.safetensors").read_bytes()
    broken = {
        "truncated": data[: len(data) // 2],
        "bad-header": data[:8] + b"{garbage" + data[16:],
        "empty": b"",
    }[damage]
    path = clone_dir(tiny_model, tmp_path / "m", skip=("model.safetensors",))
    (path / "model.safetensors").write_bytes(broken)
    with pytest.raises(ValueError, match=re.escape(str(path / "model.safetensors"))):
        LLM(model=str(path), dtype="float32", num_kv_blocks=8)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # One shard of a fused parameter missing: the fused qkv must not count as loaded.
        ("drop model.layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight"),
        ("drop model.norm.weight", "norm.weight"),
        ("reshape model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
        ("add model.layers.0.self_attn.extra.weight", "model.layers.0.self_attn.extra.weight"),
    ],
)
def test_incomplete_checkpoint_is_refused(tmp_path, tiny_model, edit, message):
    action, name = edit.split()
    tensors = load_file(tiny_model / "model.safetensors")
    if action == "drop":
        del tensors[name]
    elif action == "reshape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        tensors[name] = torch.zeros(4, 4)
    path = clone_dir(tiny_model, tmp_path / "m", skip=("model.safetensors",))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(path), dtype="float32", num_kv_blocks=8)


def _no_unpickling(*args, **kwargs):
    raise AssertionError("torch.load (pickle) must never run on model files")


def test_pickle_only_checkpoint_is_refused(tmp_path, tiny_model, monkeypatch):
    path = clone_dir(tiny_model, tmp_path / "m", skip=("model.safetensors",))
    torch.save({"model.norm.weight": torch.ones(64)}, path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", _no_unpickling)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=8)


def test_pickle_beside_safetensors_is_ignored(tmp_path, tiny_model, monkeypatch):
    """With both formats present only the safetensors are read (the .bin is not even valid)."""
    path = clone_dir(tiny_model, tmp_path / "m")
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    monkeypatch.setattr(torch, "load", _no_unpickling)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate("Hi", params, use_tqdm=False)[0].outputs[0].token_ids


def test_final_logits_are_capped_in_place():
    """Gemma 2's final soft cap rewrites the step's logits rather than copying them (32 rows of
    a 262,144-token vocabulary are 32 MiB a copy), with transformers' values."""
    logits = torch.randn(4, 1000) * 60
    expected = torch.tanh(logits / 30.0) * 30.0
    assert softcap_(logits, 30.0) is logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert softcap_(logits, None) is logits


@pytest.mark.skipif(not cpu.has_bf16_kernels(), reason="no AVX512-BF16 (or no C compiler)")
@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("Gemma3ForCausalLM", GEMMA3), ("Gemma2ForCausalLM", GEMMA2)],
    ids=["gemma3", "gemma2"],
)
def test_gemma_in_bf16_runs_the_cpu_fast_paths(
    tmp_path, default_model_path, architecture, overrides
):
    """A bf16 Gemma on CPU takes the C rotary, decode and prefix attention (soft-capped for
    Gemma 2) and the packed linears with the C GEMM (head_dim 64), and greedy-decodes what the
    fp32 model does for its first tokens."""
    from paged_backend.cpu.linear import CpuLinear

    fields = dict(overrides, head_dim=64)
    path = make_tiny_model(tmp_path, default_model_path, architecture, **fields)
    perturb_vectors(path)
    llm = LLM(model=str(path), dtype="bfloat16", cpu_kernels=True, num_kv_blocks=64)
    runner = llm.engine.runner
    attn = runner.model.layers[0].self_attn
    assert attn.rotary is cpu_ops.rotary_embedding and isinstance(attn.qkv_proj, CpuLinear)
    assert runner.model.cpu_head is not None and runner.gemm_rows
    assert runner.backend.c_decode and runner.backend.c_prefix
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    bf16 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    _, fp32 = our_greedy(path)
    for got, want in zip(bf16, fp32, strict=True):
        assert got[:8] == want[:8]


def test_a_long_steps_mlp_runs_in_slices_of_rows_with_the_same_result(tiny_model, monkeypatch):
    """Past MLP_SLICE_BYTES of gate/up activations a step's MLP runs a slice of rows at a time
    (a large prefill's peak memory), each row as it would alone in the whole step."""
    from paged_backend.models import llama

    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=8)
    mlp = llm.engine.runner.model.layers[0].mlp
    x = torch.randn(37, llm.engine.runner.model_config.hidden_size)
    whole = mlp(x)
    calls = []
    mlp.gate_up_proj.register_forward_hook(lambda _m, inputs, _out: calls.append(len(inputs[0])))
    monkeypatch.setattr(llama, "MLP_SLICE_BYTES", 5 * mlp.gate_up_width * x.element_size())
    sliced = mlp(x)
    assert calls == [5] * 7 + [2]
    assert sliced.shape == whole.shape
    # 5-row slices may take another linear kernel than 37 rows (timed per machine: the C fp32
    # linear or torch's), which sums in another order: ~1e-6 apart, a misplaced row ~1
    torch.testing.assert_close(sliced, whole, rtol=1e-4, atol=1e-5)


def test_loading_hands_the_tokenizers_freed_pages_back_before_the_weights_load(
    tiny_model, monkeypatch
):
    """The tokenizer's parse frees most of what it allocated (~50 MB for a 262,144-token
    vocabulary): trimmed before the weights load beside it, not only once all is loaded."""
    from paged_backend import engine as engine_module

    events = []
    monkeypatch.setattr(engine_module, "release_freed_heap", lambda: events.append("trim"))
    for name in ("Tokenizer", "ModelRunner"):
        real = getattr(engine_module, name)
        monkeypatch.setattr(
            engine_module,
            name,
            lambda *a, real=real, name=name: events.append(name) or real(*a),
        )
    LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=16)
    assert events == ["Tokenizer", "trim", "ModelRunner", "trim"]


def test_a_step_that_prefills_hands_the_heaps_freed_pages_back_and_decode_steps_keep_theirs(
    tiny_model, monkeypatch
):
    """A step that prefilled trims the heap once it has sampled (what its forwards and its
    sampling freed would stay resident); a decode step, which asks again for the same sizes next
    step, does not pay the trim and the faults after it."""
    from paged_backend import engine as engine_module

    events = []
    monkeypatch.setattr(engine_module, "release_freed_heap", lambda: events.append("trim"))
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    sample = type(engine.sampler).__call__
    monkeypatch.setattr(
        type(engine.sampler),
        "__call__",
        lambda self, logits, requests: events.append("sample") or sample(self, logits, requests),
    )
    events.clear()  # loading's own trim
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(None, params, prompt_token_ids=[5, 6, 7])
    engine.step()
    assert events == ["sample", "trim"]
    engine.step()
    assert events == ["sample", "trim", "sample"]  # a decode step
    engine.add_request(None, params, prompt_token_ids=[9, 10])  # prefill with a decode
    engine.step()
    assert events[-2:] == ["sample", "trim"]
    events.clear()
    while engine.has_unfinished_requests():
        engine.step()
    assert events and "trim" not in events  # the decode steps that followed kept their pages


def test_a_step_is_cut_into_forwards_of_at_most_forward_tokens_decodes_first():
    """Rows fill forwards in order (decodes first); a long chunk is cut where one fills up; a
    drafting request's rows move whole to the next forward."""
    from paged_backend.model_runner import ModelRunner

    runner = SimpleNamespace(forward_tokens=8)
    a, b, c, d = (object() for _ in range(4))
    scheduled = [(c, 13), (a, 1), (d, 3), (b, 1)]
    pieces = ModelRunner._pieces(runner, scheduled, {d: [7, 8]})
    assert pieces == [[(1, 0, 1), (3, 0, 1), (0, 0, 6)], [(0, 6, 7)], [(2, 0, 3)]]
    runner.forward_tokens = None
    assert ModelRunner._pieces(runner, scheduled, {}) == [
        [(1, 0, 1), (3, 0, 1), (0, 0, 13), (2, 0, 3)]
    ]


def test_forward_tokens_keep_a_forwards_mlp_activations_within_one_slice():
    """A CPU forward takes as many tokens, in whole 256s, as keep its MLP's bf16 gate/up
    product (4 x intermediate bytes a token) within one MLP slice, from 512 (llama.cpp's
    physical batch) to the default step budget: the default model's narrow MLP runs a whole
    step at once, an 8B's 512 tokens."""
    from paged_backend.config import EngineConfig
    from paged_backend.model_runner import FORWARD_TOKENS, forward_tokens
    from paged_backend.models.llama import MLP_SLICE_BYTES

    low, high = FORWARD_TOKENS
    assert (low, high) == (512, EngineConfig.max_num_batched_tokens)
    assert forward_tokens(1536) == high  # SmolLM2-135M
    assert forward_tokens(14336) == low  # Llama-3.1-8B
    for width in (576, 1536, 2048, 3000, 4864, 5120, 8192, 14336, 53248):
        tokens = forward_tokens(width)
        assert tokens % 256 == 0 and low <= tokens <= high
        assert tokens == low or tokens * 4 * width <= MLP_SLICE_BYTES
        assert tokens == high or (tokens + 256) * 4 * width > MLP_SLICE_BYTES


@pytest.mark.parametrize("speculative", [False, True])
def test_forwards_of_a_cut_step_give_the_whole_steps_outputs(
    quoting_model, monkeypatch, speculative
):
    """On CPU a step of more tokens than `forward_tokens` (a forward's activations are a peak of
    resident memory) runs as forwards of at most that many: a prompt's later pieces read the
    earlier's K/V from the cache, and the step's tokens and logprobs are those of one forward,
    with prefix hits, decodes beside prefills and drafts being verified. The head runs once a
    step, on the rows of all its forwards."""
    from paged_backend import model_runner

    prompts = [QUOTED, QUOTED + " The municipal archive", "Repeat: " + QUOTED, "guild books. The"]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3} if speculative else None
    results, sizes = [], {}
    for limit in (None, 5):
        monkeypatch.setattr(model_runner, "forward_tokens", lambda _width, limit=limit: limit)
        llm = LLM(model=str(quoting_model), dtype="float32", speculative_config=spec)
        assert llm.engine.runner.forward_tokens == limit
        model = llm.engine.runner.model
        rows = sizes.setdefault(limit, [])
        model.register_forward_pre_hook(lambda _m, args, rows=rows: rows.append(len(args[0])))
        heads, head = [], model.logits
        model.logits = lambda x, heads=heads, head=head: heads.append(len(x)) or head(x)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        assert len(heads) == llm.engine.num_steps and sum(heads) >= len(prompts) * 12
        assert llm.engine.num_draft_tokens > 0 if speculative else True
    assert max(sizes[5]) <= 5 < max(sizes[None]) and len(sizes[5]) > len(sizes[None])
    whole, cut = results
    for w, c in zip(whole, cut, strict=True):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        for lw, lc in zip(w.outputs[0].logprobs, c.outputs[0].logprobs, strict=True):
            assert lw.keys() == lc.keys()
            for token in lw:
                assert lw[token].logprob == lc[token].logprob
