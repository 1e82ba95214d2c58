"""Models without a chat template (as many GGUF files ship) chat in their family's format; an
unknown family is refused in one line naming `chat_template=`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_tiny_model

from paged_backend import LLM, SamplingParams
from paged_backend.chat_formats import FORMATS, detect_format
from paged_backend.config import EngineConfig

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Why?"},
]
# The default model's tokenizer with its special tokens renamed to a family's, so that the tiny
# model's vocabulary holds that family's control tokens as single tokens.
LLAMA3_TOKENS = {
    "<|im_start|>": "<|begin_of_text|>",
    "<|im_end|>": "<|eot_id|>",
    "<repo_name>": "<|start_header_id|>",
    "<reponame>": "<|end_header_id|>",
}
LLAMA2_TOKENS = {"<|im_start|>": "<s>", "<|im_end|>": "</s>"}
MISTRAL_TOKENS = {**LLAMA2_TOKENS, "<repo_name>": "[INST]", "<reponame>": "[/INST]"}
GEMMA_TOKENS = {
    "<|im_start|>": "<bos>",
    "<|im_end|>": "<eos>",
    "<repo_name>": "<start_of_turn>",
    "<reponame>": "<end_of_turn>",
}
PHI3_TOKENS = {
    **LLAMA2_TOKENS,
    "<repo_name>": "<|system|>",
    "<reponame>": "<|user|>",
    "<file_sep>": "<|assistant|>",
    "<filename>": "<|end|>",
}
FAMILIES = [  # architecture, config overrides, token renames, the prompt CHAT renders to
    pytest.param(
        "Gemma3ForCausalLM",
        {"pad_token_id": 0},
        GEMMA_TOKENS,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n",
        id="gemma3",
    ),
    pytest.param(
        "Gemma2ForCausalLM",
        {"pad_token_id": 0},
        GEMMA_TOKENS,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n",
        id="gemma2",
    ),
    pytest.param(
        "LlamaForCausalLM",
        {},
        LLAMA3_TOKENS,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        id="llama3",
    ),
    pytest.param(
        "LlamaForCausalLM",
        {},
        LLAMA2_TOKENS,
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Why? [/INST]",
        id="llama2",
    ),
    pytest.param(
        "MistralForCausalLM",
        {},
        MISTRAL_TOKENS,
        "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Why? [/INST]",
        id="mistral",
    ),
    pytest.param(
        "Phi3ForCausalLM",
        {"pad_token_id": 0},
        PHI3_TOKENS,
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
        "<|user|>\nWhy?<|end|>\n<|assistant|>\n",
        id="phi3",
    ),
    *(
        pytest.param(
            arch,
            {},
            {},
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n"
            "<|im_start|>assistant\n",
            id=name,
        )
        for arch, name in [
            ("Qwen2ForCausalLM", "qwen2"),
            ("Qwen3ForCausalLM", "qwen3"),
            ("LlamaForCausalLM", "smollm"),
        ]
    ),
]
ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": 32, "cpu_gemm_max_rows": 0}


def without_template(path: Path, renames: dict[str, str] | None = None) -> Path:
    """`path`'s tokenizer as a GGUF conversion without `tokenizer.chat_template` leaves it, its
    special tokens renamed by `renames` (same ids)."""
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    renames = renames or {}
    for key, value in config.items():
        if isinstance(value, str) and value in renames:
            config[key] = renames[value]
    config_file.write_text(json.dumps(config))
    tokenizer_file = path / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    for token in tokenizer["added_tokens"]:
        token["content"] = renames.get(token["content"], token["content"])
    vocab = tokenizer["model"]["vocab"]
    tokenizer["model"]["vocab"] = {renames.get(t, t): i for t, i in vocab.items()}
    tokenizer_file.write_text(json.dumps(tokenizer))
    return path


@pytest.mark.parametrize(("architecture", "overrides", "renames", "expected"), FAMILIES)
def test_a_model_without_a_template_chats_in_its_familys_format(
    tmp_path, default_model_path, one_thread, architecture, overrides, renames, expected
):
    path = make_tiny_model(tmp_path, default_model_path, architecture, **overrides)
    llm = LLM(model=str(without_template(path, renames)), **ENGINE_ARGS)
    assert llm.engine.apply_chat_template(CHAT) == expected
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == expected and len(out.outputs[0].token_ids) == 2
    for control in renames.values():  # the format's control tokens are the vocabulary's
        assert control not in expected or len(llm.engine.tokenize(control)) == 1


def test_the_models_own_template_wins_and_the_users_wins_over_both(
    tmp_path, default_model_path, one_thread
):
    path = make_tiny_model(tmp_path, default_model_path, "Gemma3ForCausalLM", pad_token_id=0)
    shipped = (path / "chat_template.jinja").read_text()  # the default model's (ChatML)
    llm = LLM(model=str(path), **ENGINE_ARGS)
    assert llm.get_tokenizer().chat_template == shipped
    assert llm.engine.apply_chat_template(CHAT[1:2]).startswith("<|im_start|>system\nYou are")
    mine = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<bot>"
    llm = LLM(model=str(path), chat_template=mine, **ENGINE_ARGS)
    assert llm.engine.apply_chat_template(CHAT[:2]) == "<system>Be brief.<user>Hi<bot>"


def test_an_unknown_family_is_refused_in_one_line_naming_chat_template(
    tmp_path, default_model_path, one_thread
):
    path = make_tiny_model(
        tmp_path, default_model_path, "Olmo2ForCausalLM", config_class="Olmo2Config"
    )
    llm = LLM(model=str(without_template(path)), **ENGINE_ARGS)
    with pytest.raises(ValueError, match=r"no chat template.*\(olmo2\).*chat_template=") as exc:
        llm.chat(CHAT, use_tqdm=False)
    assert "\n" not in str(exc.value)
    llm.generate("Plain text still runs", SamplingParams(max_tokens=1), use_tqdm=False)
    llm = LLM(model=str(path), chat_template=FORMATS["chatml"], **ENGINE_ARGS)
    assert llm.engine.apply_chat_template(CHAT[1:2]).startswith("<|im_start|>user\nHi")


@pytest.mark.parametrize(
    ("model_type", "tokens", "expected"),
    [
        ("llama", {"<|start_header_id|>", "<|eot_id|>", "<|im_start|>"}, "llama3"),
        ("llama", {"<|im_start|>"}, "chatml"),  # SmolLM, ChatML fine-tunes
        ("llama", {"[INST]"}, "mistral"),  # a Mistral v0.3 GGUF converts to a Llama
        ("llama", {"<s>"}, "llama2"),
        ("mistral", {"<s>"}, "mistral"),
        ("mixtral", {"<|im_start|>"}, "chatml"),
        ("qwen3_moe", set(), "chatml"),
        ("smollm3", set(), "chatml"),
        ("gemma3_text", set(), "gemma"),
        ("phi3", set(), "phi3"),
        ("olmo2", {"<|im_start|>"}, None),
        (None, set(), None),
    ],
)
def test_the_family_comes_from_the_model_type_and_the_llamas_from_their_tokens(
    model_type, tokens, expected
):
    assert detect_format({"model_type": model_type}, tokens) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "chat_template must be None"),
        (42, "chat_template must be None"),
        ("{% for m in messages %}", "chat_template is not a valid Jinja template"),
    ],
)
def test_a_bad_chat_template_is_refused_at_construction(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(chat_template=value)


MINE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<bot>"


@pytest.fixture
def unknown_family(tmp_path, default_model_path) -> str:
    """A model whose family has no known format, without a template (as its GGUF would be)."""
    path = make_tiny_model(
        tmp_path, default_model_path, "Olmo2ForCausalLM", config_class="Olmo2Config"
    )
    return str(without_template(path))


def test_chat_paged_passes_chat_template_to_its_engine(unknown_family, one_thread):
    from langchain_core.messages import HumanMessage

    from langchain_paged import ChatPaged

    chat = ChatPaged(model=unknown_family, chat_template=MINE, max_tokens=1, **ENGINE_ARGS)
    assert chat.engine_args["chat_template"] == MINE
    tokens = len(chat.get_token_ids("<user>Hi<bot>"))
    assert chat.get_num_tokens_from_messages([HumanMessage("Hi")]) == tokens  # no engine yet
    assert chat.invoke("Hi").usage_metadata["input_tokens"] == tokens
    with pytest.raises(ValueError, match="chat_template="):
        ChatPaged(model=unknown_family, max_tokens=1, **ENGINE_ARGS).invoke("Hi")


def test_llama_index_passes_chat_template_to_its_engine(unknown_family, one_thread):
    from llama_index.core.llms import ChatMessage

    from llama_index.llms.paged import PagedLLM

    llm = PagedLLM(model=unknown_family, chat_template=MINE, max_tokens=1, engine_args=ENGINE_ARGS)
    assert llm.engine_args == {**ENGINE_ARGS, "chat_template": MINE}
    response = llm.chat([ChatMessage(role="user", content="Hi")])
    assert response.raw["usage"]["prompt_tokens"] == len(llm.tokenize("<user>Hi<bot>"))
