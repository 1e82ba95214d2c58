"""GGUF files served with their weights in the file's block formats (`paged_backend.gguf`), on
the default model's Q4_1 file: loading, parity of the dequantized load with the converted copy,
and the engine's behaviour (batching, prefix caching, no leaks) on quantized weights."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_all_blocks_free, served_format, token_agreement
from gguf import GGUFReader

from paged_backend import LLM, SamplingParams, cpu
from paged_backend import engine as engine_module
from paged_backend.cpu import quant as quant_module
from paged_backend.cpu.quant import QuantEmbedding, QuantLinear, rows8_built
from paged_backend.default_model import default_model_file
from paged_backend.gguf import weights as weights_module
from paged_backend.gguf.random_checkpoint import write_checkpoint
from paged_backend.gguf.weights import config_fixes, read_gguf_faster
from paged_backend.model_loader import convert_gguf, gguf_weights_file, resolve_model_path
from paged_backend.models.config import ModelConfig

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
    assert gguf_weights_file(directory).resolve() == gguf.resolve()  # keyed by the file
    assert (directory / "config.json").is_file() and not list(directory.glob("*.safetensors"))
    assert resolve_model_path(None) != directory  # the embedded default runs its converted copy


def test_linears_and_embedding_keep_the_files_blocks(quantized):
    model = quantized.engine.runner.model
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(model.embed_tokens, QuantEmbedding)
    assert [w.format for w in attn.qkv_proj.weights] == ["Q4_1"] * 3
    assert model.embed_tokens.weight_q.format == served_format("Q8_0")
    assert isinstance(model.cpu_head, QuantLinear)  # tied: the head reads the embedding's blocks
    weights = sum(p.numel() for p in model.parameters())
    assert weights < 100_000  # only norms: no dequantized copy of any linear


@pytest.mark.parametrize("served", ["quantized", "llm_fp32"])
def test_a_models_weights_leave_the_file_for_one_region(served, request):
    """Every weight a CPU model keeps (the file's blocks, or full-precision copies) lies in one
    region (`move_to_huge_pages_`: 2 MiB pages where Linux gives them), none in the GGUF file's
    mapping; the fused decode step's table was rebuilt for it (its tokens are the modules')."""
    from paged_backend.model_runner import _weight_tensors

    llm = request.getfixturevalue(served)
    model = llm.engine.runner.model
    tensors = [t for t in _weight_tensors(model) if t.layout == torch.strided]
    assert _storages(tensors) == 1
    if served == "quantized":
        assert model.fused_decode is not None
        table = model.fused_decode.weights
        lo = min(t.data_ptr() for t in tensors)
        hi = max(t.data_ptr() + t.nbytes for t in tensors)
        qkv = model.layers[0].self_attn.qkv_proj.weights[0].data.data_ptr()
        assert lo <= qkv < hi and qkv in table.flatten().tolist()


def _storages(tensors: list[torch.Tensor]) -> int:
    """How many storages hold `tensors` and the tensors they are views of (`_base`, which would
    keep a moved weight's old storage alive)."""
    bases = [t._base for t in tensors if t._base is not None]
    return len({t.untyped_storage().data_ptr() for t in tensors + bases})


def test_dequantized_load_gives_the_converted_models_tokens(llm_fp32):
    """quantization="none" reads the same file into full-precision weights: the same values as
    transformers' conversion, so the same greedy tokens (checks names, q/k order, norms)."""
    dequantized = LLM(model=str(default_model_file()), dtype="float32", quantization="none")
    ours = dequantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    reference = llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]


def _greedy_with_logprobs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    outs = llm.generate(prompts, replace(GREEDY, logprobs=0), use_tqdm=False)
    return [
        (o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)])
        for o in (out.outputs[0] for out in outs)
    ]


@pytest.mark.skipif(not cpu.available() or not rows8_built(), reason="AVX2 builds only")
def test_a_q4_0_file_runs_interleaved_with_the_bits_of_its_layout(tmp_path, monkeypatch):
    """Where the kernels read Q4_0 weights 8 rows interleaved, a file's are laid out so once
    loaded, in place (no second copy), its embedding too: the same tokens and logprobs as in the
    file's layout, in a batch and in the fused one-row decode steps (Q8_0's: the int8 tests;
    each format's kernels: tests/test_quant_kernels.py)."""
    from paged_backend import model_runner

    (path,) = write_checkpoint("tiny", tmp_path, ("q4_0",))
    runs = []
    for interleave in (True, False):
        if not interleave:
            monkeypatch.setattr(model_runner, "interleave_model_rows_", lambda model: None)
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
        model = llm.engine.runner.model
        formats = {w.format for m in model.modules() for w in getattr(m, "weights", [])}
        formats.add(model.embed_tokens.weight_q.format)
        assert formats == ({"Q4_0_R8"} if interleave else {"Q4_0"})
        assert model.fused_decode is not None
        runs.append((_greedy_with_logprobs(llm, PROMPTS), llm.stats()["weights_bytes"]))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("source", ["file", "converted"])
def test_a_prompts_tokens_do_not_depend_on_its_step(source, request):
    """In fp32 each row gets the bits it has alone: the file's quantized linears are exact per
    row (tests/test_quant_kernels.py), the converted model's C fp32 linear is too and serves
    steps of every size where torch does not win clearly at a prefill's (`kernel_choice`;
    forced here, as on a machine where it keeps up), and the C attention kernel runs every row,
    prompt chunks too, without a cascade. So a prompt's greedy tokens and their logprobs are the
    same computed alone and whole, in a batch whose prompts share a cached prefix, again from
    the cache, and in chunks of a small token budget (int8 activations would turn any last-bit
    difference into another level, and a near-tie into another token)."""
    if source == "converted":
        request.getfixturevalue("f32_linears_every_step")
    model = str(default_model_file()) if source == "file" else None
    shared = "Answer in one short, clear sentence and never repeat this instruction. " * 6
    prompts = [shared + p for p in PROMPTS]  # ~90 tokens: a whole prompt is a step of 64+ rows

    run = _greedy_with_logprobs
    whole = LLM(model=model, dtype="float32", enable_prefix_caching=False)
    alone = [run(whole, [p])[0] for p in prompts]
    cached = LLM(model=model, dtype="float32", num_kv_blocks=256)
    together = run(cached, prompts)
    hits = cached.engine.stats()["prefix_cache_hits"]
    again = run(cached, prompts)  # from the cache, sharing its blocks in each step
    assert cached.engine.stats()["prefix_cache_hits"] - hits >= len(prompts) * 64
    chunked = LLM(
        model=model, dtype="float32", max_num_batched_tokens=24, max_num_seqs=len(prompts)
    )
    assert run(chunked, prompts) == alone
    assert together == alone and again == alone
    assert_all_blocks_free(cached.engine)


def test_greedy_rows_take_their_tokens_from_the_head_without_their_logits(quantized, monkeypatch):
    """A quantized head gives greedy rows their argmax a slice of the vocabulary at a time
    (`QuantLinear.argmax`): a greedy batch never holds its logits, and a mixed one (past
    `SPLIT_HEAD_BYTES`) holds only its other rows', with the tokens and logprobs of the whole
    logits' sampling."""
    runner = quantized.engine.runner
    real_logits = runner.logits
    whole: list[int] = []
    monkeypatch.setattr(runner, "logits", lambda h: whole.append(len(h)) or real_logits(h))
    greedy = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert whole == []
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)
    with_lp = replace(GREEDY, logprobs=2)
    mixed = [GREEDY, seeded, with_lp, GREEDY]
    monkeypatch.setattr(engine_module, "SPLIT_HEAD_BYTES", 0)
    split = quantized.generate(PROMPTS, mixed, use_tqdm=False)
    assert whole and max(whole) == 2  # the seeded and the logprobs rows
    monkeypatch.setattr(runner, "logits_argmax", lambda h, columns: None)
    reference = quantized.generate(PROMPTS, mixed, use_tqdm=False)
    for ours, ref in zip(split, reference, strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ours.outputs[0].logprobs == ref.outputs[0].logprobs
    assert [o.outputs[0].token_ids for o in greedy] == [
        o.outputs[0].token_ids for o in quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    assert_all_blocks_free(quantized.engine)


@pytest.mark.skipif(
    not cpu.available() or not cpu.load_library().has("quant_argmax_amx"), reason="no AMX tiles"
)
def test_greedy_bf16_rows_past_the_int8_rows_take_the_argmax_from_the_tiles(monkeypatch):
    """On AMX, a bf16 step's quantized head past its int8 rows gives greedy rows their argmax
    from the tiles (`quant_argmax_bf16`, no logits written): the tokens of the whole logits
    (each run's prompts computed afresh: a cached prefix's rows may differ in their last bits)."""
    llm = LLM(
        model=str(default_model_file()),
        dtype="bfloat16",
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    head = llm.engine.runner.model.cpu_head
    assert isinstance(head, QuantLinear)
    monkeypatch.setattr(head, "int8_max_rows", 0)
    real, rows = quant_module.quant_argmax_bf16, []
    monkeypatch.setattr(
        quant_module, "quant_argmax_bf16", lambda x, *a: rows.append(len(x)) or real(x, *a)
    )
    tiles = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert rows and max(rows) == len(PROMPTS)
    monkeypatch.setattr(llm.engine.runner, "logits_argmax", lambda h, columns: None)
    whole = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiles] == [o.outputs[0].token_ids for o in whole]
    assert_all_blocks_free(llm.engine)


def test_greedy_drafting_steps_verify_against_the_heads_argmax(monkeypatch):
    """n-gram drafts of greedy requests are checked against each row's argmax from the head
    (`logits_argmax`), never their logits: the tokens of verification on whole logits."""
    llm = LLM(
        model=str(default_model_file()),
        dtype="float32",
        num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    prompts = [
        "Repeat after me: red green blue, red green blue, red green blue, red green",
        "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    ]
    runner = llm.engine.runner
    real_logits = runner.logits
    whole: list[int] = []
    monkeypatch.setattr(runner, "logits", lambda h: whole.append(len(h)) or real_logits(h))
    ours = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.num_drafting_steps > 0 and whole == []
    llm.engine.kv.pool.reset_cache()  # the same prefill steps again
    monkeypatch.setattr(runner, "logits_argmax", lambda h, columns: None)
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert whole
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]
    assert_all_blocks_free(llm.engine)


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


K_QUANT_SHAPES = [
    *("tiny", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-phi3")
]


@pytest.fixture(scope="module", params=K_QUANT_SHAPES)
def k_quant_checkpoint(request, tmp_path_factory):
    """A random checkpoint of each family our modules serve (llama: untied, q/k rows permuted in
    the file; qwen2: tied, biases; qwen3: q/k norms, head_dim neither hidden / heads nor 128;
    mistral: a `llama` file; gemma2/gemma3: sandwich norms stored as 1 + weight, sliding
    windows; gemma2's soft-caps and gemma3's linear rope scaling, neither the default; phi3:
    fused qkv and gate/up tensors) as a bf16 directory and a Q4_K_M file (Q4_K and Q6_K blocks;
    Q5_K for a fused qkv) of the same weights."""
    out = tmp_path_factory.mktemp(request.param)
    bf16, q4_k_m = write_checkpoint(request.param, out, ("bf16", "q4_k_m"))
    return bf16, q4_k_m


def _weights(llm: LLM) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in llm.engine.runner.model.state_dict().items()}


def test_k_quant_files_hold_the_weights_of_their_float_copy(k_quant_checkpoint):
    """Read dequantized, every weight of the Q4_K_M file is its float copy's but for the
    quantization error (a q or k row out of order would be off by the weights' size), and the
    configuration read from its metadata is the copy's."""
    directory, gguf = k_quant_checkpoint
    dequantized = LLM(model=str(gguf), dtype="float32", quantization="none", num_kv_blocks=64)
    float_copy = LLM(model=str(directory), dtype="float32", num_kv_blocks=64)
    # the llama file's llama3 RoPE scaling, which it keeps as a rope_freqs tensor, comes back;
    # GGUF keeps the norm's epsilon in float32; llama.cpp writes Mistral as `llama`, which runs
    # on the same modules as Llama
    config, expected = dequantized.engine.model_config, float_copy.engine.model_config
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    if expected.architecture == "MistralForCausalLM":
        assert config.architecture == "LlamaForCausalLM"
        expected = replace(expected, architecture=config.architecture)
    assert replace(config, rms_norm_eps=expected.rms_norm_eps) == expected
    # transformers' conversion (architectures we do not map) builds its model on that config
    # (the same config fixes for every family: checked on Llama's rope_freqs and on Gemma 3)
    if gguf.name.split("-Q")[0] in ("tiny", "tiny-gemma3"):
        converted = ModelConfig.from_dir(convert_gguf(gguf))
        assert replace(converted, rms_norm_eps=expected.rms_norm_eps) == expected
    ours, reference = _weights(dequantized), _weights(float_copy)
    assert ours.keys() == reference.keys()
    for name, weight in reference.items():
        error = (ours[name] - weight).norm() / weight.norm()
        assert error < (0.1 if weight.dim() == 2 else 1e-6), name


def test_k_quant_linears_compute_what_their_dequantized_weights_do(k_quant_checkpoint):
    _, gguf = k_quant_checkpoint
    quantized = LLM(model=str(gguf), dtype="float32", num_kv_blocks=64)
    dequantized = _weights(LLM(model=str(gguf), dtype="float32", quantization="none"))
    formats = set()
    for name, module in quantized.engine.runner.model.named_modules():
        if isinstance(module, QuantLinear) and name != "cpu_head":
            formats |= {w.format for w in module.weights}
            x = torch.randn(5, module.in_features)
            expected = F.linear(x, dequantized[f"{name}.weight"], dequantized.get(f"{name}.bias"))
            assert F.cosine_similarity(module(x), expected, dim=-1).min() > 0.995, name
    assert formats == {"Q4_K", "Q6_K"} | ({"Q5_K"} if "phi3" in gguf.name else set())
    out = quantized.generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_k_quant_greedy_tokens_start_as_the_dequantized_weights_do(k_quant_checkpoint):
    """The file served in its blocks and the same file read into full-precision weights give
    the same first three greedy tokens (they differ by the int8 activations only; random
    weights leave near-ties, ~0.01 apart in tiny-phi3's fourth, so a later token may flip), on
    the family's own modules."""
    _, gguf = k_quant_checkpoint
    # fp32 K/V for both (a quantized model's default is fp16): the weights' difference alone
    quantized = LLM(model=str(gguf), dtype="float32", kv_cache_dtype="float32", num_kv_blocks=64)
    dequantized = LLM(model=str(gguf), dtype="float32", quantization="none", num_kv_blocks=64)
    assert quantized.engine.model_config.impl == "native"
    runs = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for llm in (quantized, dequantized)]
    ours, reference = ([o.outputs[0].token_ids for o in run] for run in runs)
    assert sum(a[:3] == r[:3] for a, r in zip(ours, reference, strict=True)) >= 3
    assert_all_blocks_free(quantized.engine)


@pytest.fixture(scope="module")
def q3_k_m(tmp_path_factory):
    """The tiny Llama shape as a Q3_K_M file: Q3_K for q, k, gate, up and the (untied)
    embedding, Q5_K for v, Q4_K for o and down, Q6_K for the output."""
    (path,) = write_checkpoint("tiny", tmp_path_factory.mktemp("q3_k_m"), ("q3_k_m",))
    return path, LLM(model=str(path), dtype="float32", quantization="none", num_kv_blocks=64)


def _served_like_the_dequantized_file(quantized: LLM, full: LLM) -> None:
    """Every block linear computes what its dequantized weights do; the embedding's rows are
    theirs; the greedy tokens start as the dequantized load's."""
    model, reference = quantized.engine.runner.model, _weights(full)
    torch.testing.assert_close(
        model.embed_tokens(torch.arange(100)),
        reference["embed_tokens.weight"][:100],
        atol=2e-3,
        rtol=0,
    )
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and name != "cpu_head":
            x = torch.randn(5, module.in_features)
            expected = F.linear(x, reference[f"{name}.weight"])
            assert F.cosine_similarity(module(x), expected, dim=-1).min() > 0.999, name
    assert sum(p.numel() for p in model.parameters()) < 10_000  # norms only
    runs = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for llm in (quantized, full)]
    ours, theirs = ([o.outputs[0].token_ids for o in run] for run in runs)
    assert sum(a[:3] == b[:3] for a, b in zip(ours, theirs, strict=True)) >= 3
    assert_all_blocks_free(quantized.engine)


@pytest.mark.parametrize(
    ("fmt", "qkv", "gate_up"),
    [("q3_k_m", ["Q3_K", "Q3_K", "Q5_K"], "Q3_K"), ("q2_k", ["Q2_K", "Q2_K", "Q3_K"], "Q2_K")],
)
def test_2_and_3_bit_files_keep_their_blocks(q3_k_m, tmp_path, fmt, qkv, gate_up):
    if fmt == "q3_k_m":
        path, full = q3_k_m
    else:
        (path,) = write_checkpoint("tiny", tmp_path, (fmt,))
        full = LLM(model=str(path), dtype="float32", quantization="none", num_kv_blocks=64)
    quantized = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    model = quantized.engine.runner.model
    assert model.embed_tokens.weight_q.format == qkv[0]
    assert [w.format for w in model.layers[0].self_attn.qkv_proj.weights] == qkv
    assert [w.format for w in model.layers[1].mlp.gate_up_proj.weights] == [gate_up] * 2
    assert quantized.stats()["weights_bytes"] <= 1.15 * path.stat().st_size
    _served_like_the_dequantized_file(quantized, full)


def test_block_formats_the_kernels_do_not_read_are_served_as_int8_blocks(q3_k_m, monkeypatch):
    """A weight in a block format the kernels do not read (the IQ types; here Q3_K, taken off
    the formats read) becomes int8 blocks of its values, not a float copy: row-major for the
    embedding, whose rows are looked up."""
    from paged_backend.gguf import weights

    path, full = q3_k_m
    unread = {k: v for k, v in weights.BLOCK_FORMATS.items() if k != "Q3_K"}
    monkeypatch.setattr(weights, "BLOCK_FORMATS", unread)
    quantized = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    model = quantized.engine.runner.model
    assert model.embed_tokens.weight_q.format == "Q8_256"
    formats = [w.format for w in model.layers[0].self_attn.qkv_proj.weights]
    assert formats[:2] in (["Q8_256"] * 2, ["Q8_256_VNNI"] * 2) and formats[2] == "Q5_K"
    assert {w.format for w in model.layers[1].mlp.gate_up_proj.weights} <= {
        "Q8_256",
        "Q8_256_VNNI",
    }
    assert quantized.stats()["weights_bytes"] < 0.3 * full.stats()["weights_bytes"]
    _served_like_the_dequantized_file(quantized, full)


def _unrotated(monkeypatch) -> None:
    """int8 of the weights as they are: without the rotation that spreads their activations'
    outliers (`paged_backend.models.rotation`, tested in test_rotation.py)."""
    from paged_backend.models import rotation

    monkeypatch.setattr(rotation, "rotate_", lambda model: False)


def test_int8_linears_are_int8_blocks_of_the_float_weights(llm_fp32, monkeypatch):
    """quantization="int8" (any checkpoint): every linear as int8 blocks (tied head too), Q8_0
    for the default model's 576 inputs, Q8_256 for its down projection's 1536, the embedding
    table kept for lookups, at most half the bytes of bf16 for the layers."""
    from paged_backend.cpu.quant import vnni_gemm_built

    _unrotated(monkeypatch)

    int8 = LLM(dtype="float32", quantization="int8", num_kv_blocks=256)
    model, reference = int8.engine.runner.model, llm_fp32.engine.runner.model
    qkv, down = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj
    assert isinstance(qkv, QuantLinear)
    assert [w.format for w in qkv.weights] == [served_format("Q8_0")]
    q8_256 = "Q8_256_VNNI" if vnni_gemm_built() else "Q8_256"  # 576 outputs: 18 strips
    assert isinstance(down, QuantLinear) and [w.format for w in down.weights] == [q8_256]
    assert not down.weights[0].row_scales  # unrotated: activation outliers keep a scale a 256
    assert isinstance(model.cpu_head, QuantLinear)
    from paged_backend.model_runner import _weight_tensors

    assert _storages([t for t in _weight_tensors(model) if t.layout == torch.strided]) == 1
    for ours, full in (
        (qkv, reference.layers[0].self_attn.qkv_proj),
        (down, reference.layers[0].mlp.down_proj),
    ):
        x = torch.randn(3, ours.in_features)
        assert F.cosine_similarity(ours(x), full(x), dim=-1).min() > 0.999
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = int8.generate(PROMPTS, params, use_tqdm=False)
    full = llm_fp32.generate(PROMPTS, params, use_tqdm=False)
    ids = [[o.outputs[0].token_ids for o in run] for run in (ours, full)]
    assert token_agreement(*ids) >= 0.75
    assert_all_blocks_free(int8.engine)


def test_int8_runs_an_untied_head_as_q8_0_blocks(tiny_model, monkeypatch):
    """A model whose head is its own weight (not the embedding's): the head's Q8_0 blocks give
    the logits (`cpu_head`), close to the float head's, and requests run."""
    _unrotated(monkeypatch)
    full = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64).engine.runner.model
    assert full.lm_head is not None  # the tiny model's head is untied
    llm = LLM(model=str(tiny_model), dtype="float32", quantization="int8", num_kv_blocks=64)
    int8 = llm.engine.runner.model
    assert int8.lm_head is None and isinstance(int8.cpu_head, QuantLinear)
    assert [w.format for w in int8.cpu_head.weights] == [served_format("Q8_0")]
    x = torch.randn(3, full.config.hidden_size)
    assert F.cosine_similarity(int8.logits(x), full.logits(x), dim=-1).min() > 0.999
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[1, 5, 17, 923]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6
    assert_all_blocks_free(llm.engine)


def test_int8_is_refused_where_it_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=str(tiny_model), quantization="int8", model_impl="transformers")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="int3")


def test_architectures_we_do_not_map_go_through_transformers_conversion(monkeypatch, llm_fp32):
    monkeypatch.setattr("paged_backend.model_runner.GGUF_ARCHITECTURES", ())
    converted = LLM(model=str(default_model_file()), dtype="float32", num_kv_blocks=64)
    model = converted.engine.runner.model
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    ours = converted.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    reference = llm_fp32.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]


def _metadata_file(path, arch: str, layers: int, keys: dict) -> GGUFReader:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(5376)
    writer.add_head_count(32)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(path)


def test_metadata_read_faster_gives_gguf_readers_fields(tmp_path, monkeypatch):
    """`read_gguf_faster` (every GGUFReader of a GGUF file's first start) reads an array in one
    pass: the fields gguf's own reader gives, part for part, for each kind of value: scalars,
    strings (empty, multi-byte), arrays of numbers, of strings and of arrays."""
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("string", "héllo")
    for add, value in [("uint8", 7), ("int32", -5), ("uint64", 2**40), ("float32", 0.25)]:
        getattr(writer, f"add_{add}")(add, value)
    writer.add_bool("bool", True)
    writer.add_array("strings", ["a", "", "ü", "long " * 50])
    writer.add_array("ints", [1, -2, 3])
    writer.add_array("floats", [0.5, 1.5])
    writer.add_array("bools", [True, False])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_array("nested strings", [["x", "yz"], ["w"]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def fields() -> dict:
        return {
            key: (
                f.offset,
                [(part.dtype.str, part.shape, part.tobytes()) for part in f.parts],
                list(f.data),
                [int(t) for t in f.types],
                f.contents(),
            )
            for key, f in GGUFReader(path).fields.items()
        }

    read_gguf_faster()
    fast = fields()
    monkeypatch.setattr(GGUFReader, "_get_field_parts", weights_module._field_parts)
    assert fast == fields()
    assert fast["strings"][4] == ["a", "", "ü", "long " * 50]
    assert fast["nested strings"][4] == ["x", "yz", "w"]  # gguf flattens nested arrays


def test_config_fixes_are_what_the_file_holds_and_transformers_drops(tmp_path):
    """Only the keys a file has give fixes; a 27B Gemma's query scale is hidden // heads (as
    llama.cpp tells it by its layer count), a smaller one's is left to head_dim."""
    keys = {"key_length": 128, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    reader = _metadata_file(tmp_path / "g2.gguf", "gemma2", 46, keys)
    assert config_fixes(reader, "gemma2", tmp_path) == {
        "head_dim": 128,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 5376 // 32,
    }
    linear = {"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 8.0}
    reader = _metadata_file(tmp_path / "g3.gguf", "gemma3", 34, linear)
    assert config_fixes(reader, "gemma3", tmp_path) == {
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}
    }
    reader = _metadata_file(tmp_path / "g3-27b.gguf", "gemma3", 62, {})
    assert config_fixes(reader, "gemma3", tmp_path) == {"query_pre_attn_scalar": 168}
    reader = _metadata_file(tmp_path / "llama.gguf", "llama", 62, {})
    assert config_fixes(reader, "llama", tmp_path) == {}


def test_phi3_files_give_their_window_and_rotary_share_and_longrope_is_refused(tmp_path):
    """Phi-3-mini-4k's window (2047) and Phi-4-mini's rotary share (3/4 of each head), which
    transformers' phi3 keys leave out; a window of 0 and whole-head rotary give nothing. Long-
    context files (rope_factors tensors) are refused by name rather than run without them."""
    keys = {"sliding_window": 2047, "rope_dimension_count": 126}  # heads of 5376 / 32 = 168
    reader = _metadata_file(tmp_path / "phi.gguf", "phi3", 32, keys)
    assert config_fixes(reader, "phi3", tmp_path) == {
        "sliding_window": 2047,
        "partial_rotary_factor": 0.75,
    }
    keys = {"sliding_window": 0, "rope_dimension_count": 168}
    reader = _metadata_file(tmp_path / "phi-no-window.gguf", "phi3", 32, keys)
    assert config_fixes(reader, "phi3", tmp_path) == {}
    writer = gguf.GGUFWriter(tmp_path / "long.gguf", "phi3")
    writer.add_tensor("rope_factors_long.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="LongRoPE"):
        config_fixes(GGUFReader(tmp_path / "long.gguf"), "phi3", tmp_path)
