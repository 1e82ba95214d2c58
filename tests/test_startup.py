"""A start reads what it can without transformers (a plain Llama's config.json; transformers'
reading of another config and the tokenizer, both saved in the cache), and gives the same outputs
as one that imports it; a cache entry that is corrupt or stale is rebuilt, never trusted."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import types
import weakref

import pytest
from conftest import longrope, make_tiny_model

from paged_backend import LLM, SamplingParams
from paged_backend import tokenizer as tokenizer_module
from paged_backend.file_cache import read_checked, write_checked
from paged_backend.models import config as config_module
from paged_backend.models.config import ModelConfig
from paged_backend.tokenizer import Tokenizer

TEXTS = [
    "Hi",
    "The three primary colours are",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Ünïcödé, 中文, emoji 🙂👍🏽 and a lone é",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>special<|im_end|> tokens inside text",
    "def f(x):\n    return x ** 2  # code",
    "",
]


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"tie_word_embeddings": None},  # absent: LlamaConfig's default
        {"sliding_window": 16},
        {
            "rope_parameters": {
                **{"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
                **{"low_freq_factor": 1.0, "high_freq_factor": 4.0},
                "original_max_position_embeddings": 1024,
            }
        },
        {"attention_bias": True, "mlp_bias": True},
    ],
)
def test_a_plain_llama_config_reads_as_transformers_reads_it(
    tmp_path, default_model_path, monkeypatch, change
):
    raw = json.loads((default_model_path / "config.json").read_text())
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert config_module.plain_llama(raw, "LlamaForCausalLM", None)
    ours = ModelConfig.from_dir(tmp_path)
    monkeypatch.setattr(config_module, "plain_llama", lambda *args: False)
    assert ours == ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("Gemma3ForCausalLM", {"sliding_window": 6, "rope_local_base_freq": 100.0}),
        ("Gemma2ForCausalLM", {"sliding_window": 6, "attn_logit_softcapping": 5.0}),
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "pad_token_id": 0, **longrope(12)}),
        ("Qwen2ForCausalLM", {}),
    ],
    ids=["gemma3", "gemma2", "phi4-mini", "qwen2"],
)
def test_a_config_transformers_reads_is_kept_and_read_back_as_it_read_it(
    tmp_path, default_model_path, monkeypatch, architecture, overrides
):
    path = make_tiny_model(tmp_path / "model", default_model_path, architecture, **overrides)
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    first = ModelConfig.from_dir(path)
    import transformers

    stub = types.ModuleType("transformers")  # found where transformers is; imports nothing
    stub.__spec__ = transformers.__spec__
    with monkeypatch.context() as no_transformers:
        no_transformers.setitem(sys.modules, "transformers", stub)
        assert ModelConfig.from_dir(path) == first
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 0.25}))
        with pytest.raises(ImportError):  # a changed config.json is read again
            ModelConfig.from_dir(path)
    assert ModelConfig.from_dir(path).rms_norm_eps == 0.25


def _hf_loads(monkeypatch) -> list[str]:
    """The paths `Tokenizer` loads transformers' tokenizer of, from now on."""
    loads = []

    def counted(path, chat_template=None):
        loads.append(path)
        return load(path, chat_template)

    load = tokenizer_module.load_tokenizer
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", counted)
    return loads


def test_the_tokenizer_encodes_and_decodes_as_transformers(default_model_path, monkeypatch):
    Tokenizer(default_model_path)  # fills the cache entry if no earlier test did
    loads = _hf_loads(monkeypatch)
    ours = Tokenizer(default_model_path)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == ours.hf(text, add_special_tokens=special).input_ids
    ids = [*ours.encode(TEXTS[4] + TEXTS[3]), 0, 1, 2, 49151]
    for skip in (True, False):
        for cut in range(len(ids)):
            expected = ours.hf.decode(ids[cut:], skip_special_tokens=skip)
            assert ours.decode(ids[cut:], skip) == expected
    assert ours.eos_token_id == ours.hf.eos_token_id == 2
    assert loads == [default_model_path]  # by `ours.hf` above, not by encoding or decoding


def test_a_first_start_lets_transformers_tokenizer_go(default_model_path, tmp_path, monkeypatch):
    """The start that fills the cache entry loads transformers' tokenizer for it, then lets it
    go: held, it kept ~90 MB of a 262,144-token vocabulary for the process's life."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    loaded = []
    load = tokenizer_module.load_tokenizer

    def watched(*args):
        hf = load(*args)
        loaded.append(weakref.ref(hf))
        return hf

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", watched)
    first = Tokenizer(default_model_path)
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None
    assert first.encode(TEXTS[0]) == Tokenizer(default_model_path).encode(TEXTS[0])
    assert len(loaded) == 1  # neither encoding nor the second start loaded it again


# A template that reads what transformers hands a template: tools (through `tojson`), documents,
# a template argument of the caller's, the special tokens, and a key whose value is None (which
# transformers drops, so `is defined` is false).
TOOLS_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}<|im_start|>system\nTools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls is defined %}[calls]{% endif %}<|im_end|>\n{% endfor %}"
    "{%- for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}{{ eos_token }}"
)
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief. Ünïcödé 中文"},
        {"role": "user", "content": "Hi", "tool_calls": None},
        {"role": "assistant", "content": "Hello.", "tool_calls": [{"id": "1"}]},
        {"role": "user", "content": "<|im_end|> in text"},
    ],
]
CALLS = [
    {},
    {"add_generation_prompt": True},
    {"chat_template": TOOLS_TEMPLATE, "tools": [TOOL], "add_generation_prompt": True},
    {"chat_template": TOOLS_TEMPLATE, "documents": [{"title": "A", "text": "B"}]},
    {"chat_template": TOOLS_TEMPLATE, "add_generation_prompt": True, "enable_thinking": False},
]


def test_chats_render_as_transformers_renders_them_without_loading_its_tokenizer(
    tmp_path, default_model_path, monkeypatch
):
    """From the cache, a chat renders from the saved template and special tokens through
    transformers' Jinja renderer, giving its tokenizer's text, and never loads that tokenizer
    (0.7-1.5 s and 120-140 MB); the engine's `chat_template` wins; a template kept by name
    (transformers' several templates) is chosen as transformers chooses; what needs the
    tokenizer (tokens, continuing a message) goes to it."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(default_model_path, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    own = config.get("chat_template") or (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink(missing_ok=True)
    named = [{"name": "default", "template": own}, {"name": "tool_use", "template": TOOLS_TEMPLATE}]
    config_file.write_text(json.dumps({**config, "chat_template": named}))
    Tokenizer(model)  # fills the cache
    loads = _hf_loads(monkeypatch)
    several, user = Tokenizer(model), Tokenizer(model, chat_template=TOOLS_TEMPLATE)
    calls = [*CALLS, {"tools": [TOOL]}, {"chat_template": "tool_use"}]
    ours = [
        [(t.apply_chat_template(chat, tokenize=False, **kw)) for chat in CHATS for kw in calls]
        for t in (several, user)
    ]
    assert loads == []
    for tokenizer, texts in zip((several, user), ours, strict=True):
        hf = tokenizer.hf
        expected = [
            hf.apply_chat_template(chat, tokenize=False, **kw) for chat in CHATS for kw in calls
        ]
        assert texts == expected
    assert isinstance(several.chat_template, dict) and user.chat_template == TOOLS_TEMPLATE
    second_chat = len(calls)  # the tool call, and not the None calls, are written
    assert ours[1][second_chat].count("[calls]") == 1
    assert "Tools:" in ours[0][5] and "Tools:" not in ours[0][0]  # tools chose "tool_use"
    fresh = Tokenizer(model)
    ids = fresh.apply_chat_template(CHATS[0], tokenize=True, return_dict=False)
    assert fresh._hf is not None and ids == fresh.encode(ours[0][0], add_special_tokens=False)


def _entries(cache) -> list:
    return sorted((cache / "tokenizers").glob("*.json"))


def test_a_corrupt_or_stale_tokenizer_entry_is_rebuilt(tmp_path, default_model_path, monkeypatch):
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(default_model_path, model, ignore=shutil.ignore_patterns("*.safetensors"))
    loads = _hf_loads(monkeypatch)
    expected = Tokenizer(model).encode(TEXTS[3])
    (entry,) = _entries(tmp_path / "cache")
    data = entry.read_bytes()
    middle = len(data) // 2
    entry.write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])
    assert Tokenizer(model).encode(TEXTS[3]) == expected
    assert len(loads) == 2 and entry.read_bytes() == data  # rebuilt as it was
    entry.write_bytes(data[: len(data) // 2])
    assert Tokenizer(model).encode(TEXTS[3]) == expected and len(loads) == 3

    # Stale: a tokenizer file changed. Here the change also leaves no fast path (transformers
    # cleans up spaces), so transformers' tokenizer serves and no entry is added.
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    changed = Tokenizer(model)
    assert len(loads) == 4 and _entries(tmp_path / "cache") == [entry]
    assert changed.decode(changed.encode("a , b")) == changed.hf.decode(changed.encode("a , b"))


def test_checked_files_refuse_changed_content(tmp_path):
    path = tmp_path / "entry"
    write_checked(path, b"payload")
    assert read_checked(path) == b"payload"
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert read_checked(path) is None
    assert read_checked(tmp_path / "missing") is None


def _outputs(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate(TEXTS[:4], params, use_tqdm=False)
    return [
        (o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].logprobs)
        for o in outs
    ]


def test_starts_from_the_caches_give_the_first_starts_outputs(
    cache_with_kernels, default_model_path, monkeypatch
):
    """A first start (filling the caches), a second (reading them) and a third after the
    tokenizer entry was corrupted: the same tokens, text and logprobs."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(cache_with_kernels))
    loads = _hf_loads(monkeypatch)
    first = _outputs(LLM(str(default_model_path), dtype="float32"))
    assert _outputs(LLM(str(default_model_path), dtype="float32")) == first
    assert len(loads) == 1
    for entry in _entries(cache_with_kernels):
        entry.write_bytes(b"0" * 64 + entry.read_bytes()[64:])
    assert _outputs(LLM(str(default_model_path), dtype="float32")) == first
    assert len(loads) == 2


@pytest.mark.parametrize("model", ["default", "gemma3"])
def test_a_warm_start_imports_no_transformers(
    tmp_path, cache_with_kernels, default_model_path, model
):
    """`LLM()` and a generate read the model's config (the default model's plain Llama one, or
    transformers' reading of a Gemma 3 one, kept in the cache) and tokenizer without
    transformers (its import takes 1-2 s of a start), once the first start filled the cache."""
    path = default_model_path
    if model == "gemma3":
        path = make_tiny_model(tmp_path / "model", default_model_path, "Gemma3ForCausalLM")
    code = (
        "import sys; from paged_backend import LLM, SamplingParams; "
        f"LLM({str(path)!r}).generate('Hi', SamplingParams(max_tokens=2), "
        "use_tqdm=False); print('transformers' in sys.modules)"
    )
    env = dict(os.environ, PAGED_BACKEND_CACHE=str(cache_with_kernels))
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], runs[-1].stderr
