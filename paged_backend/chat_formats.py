"""The chat formats of the families we serve, for models that ship no chat template.

A GGUF file may carry no `tokenizer.chat_template` (a Gemma 3 270M Q4_K_M does not), and
transformers then refuses every chat deep inside `apply_chat_template`. llama.cpp falls back on
the family's known format; so do we. The family comes from config.json's `model_type`, and for
the Llama types (a GGUF of Mistral converts to one too) from the vocabulary's special tokens:
Llama 3's header tokens, ChatML's `<|im_start|>` (SmolLM and many fine-tunes), Mistral's
`[INST]`, else Llama 2. A tokenizer's template is, first that exists: the user's
`chat_template=` engine argument, the model's own, its family's."""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path

from jinja2 import Environment, TemplateSyntaxError


def _system_prefix(open_: str, close: str) -> str:
    """Jinja that sets `first` (1 when the chat opens with a system turn, which the format has no
    turn for) and `prefix` (that turn's text, framed, for the first turn after it)."""
    return (
        "{% set first = 1 if messages[0]['role'] == 'system' else 0 %}"
        "{% set prefix = '" + open_ + "' + messages[0]['content'] + '" + close + "' "
        "if first else '' %}"
    )


CHATML = (
    "{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token or '' }}{% for message in messages %}"
    r"{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Llama 2 and Mistral have no generation prompt: a chat ending in a user turn ends in [/INST].
LLAMA2 = (
    _system_prefix(r"<<SYS>>\n", r"\n<</SYS>>\n\n") + "{% for message in messages[first:] %}"
    "{% if message['role'] == 'user' %}{{ (bos_token or '') + '[INST] ' "
    "+ (prefix if loop.first else '') + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + (eos_token or '') }}{% endif %}"
    "{% endfor %}"
)
MISTRAL = (
    "{{ bos_token or '' }}" + _system_prefix("", r"\n\n") + "{% for message in messages[first:] %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (prefix if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + (eos_token or '') }}{% endif %}"
    "{% endfor %}"
)
# Gemma has user and model turns only; its system text opens the first turn, as Gemma 3's own
# template writes it.
GEMMA = (
    "{{ bos_token or '' }}" + _system_prefix("", r"\n\n") + "{% for message in messages[first:] %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) "
    r"+ '\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}"
    r"{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
FORMATS = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "llama2": LLAMA2,
    "mistral": MISTRAL,
    "gemma": GEMMA,
    "phi3": PHI3,
}
_BY_MODEL_TYPE = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text"), "gemma"),
    **dict.fromkeys(("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3"), "chatml"),
    "phi3": "phi3",
}
_LLAMA_TYPES = ("llama", "mistral", "mixtral")
KNOWN = "Llama 2/3, Mistral, ChatML (Qwen, SmolLM), Gemma, Phi-3"


def detect_format(config: dict, vocab: Container[str]) -> str | None:
    """The name (a key of `FORMATS`) of the chat format of a model with this config.json and
    vocabulary; None for a family we know no format of."""
    model_type = config.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    if model_type not in _LLAMA_TYPES:
        return None
    if "<|start_header_id|>" in vocab and "<|eot_id|>" in vocab:
        return "llama3"
    if "<|im_start|>" in vocab:
        return "chatml"
    if "[INST]" in vocab or model_type != "llama":
        return "mistral"
    return "llama2"


def load_tokenizer(path: Path, chat_template: str | None = None):
    """The model's tokenizer with the chat template it should render: `chat_template`, else its
    own, else its family's; None (refused at the first chat) for an unknown family."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif not tokenizer.chat_template:
        name = detect_format(_config(path), tokenizer.get_vocab())
        tokenizer.chat_template = FORMATS.get(name)
    return tokenizer


def missing_template_error(tokenizer) -> ValueError:
    """One line for a chat on a model with no template of its own and no known family: what is
    missing and how to pass a template."""
    path = Path(tokenizer.name_or_path)
    config = _config(path)
    family = config.get("model_type") or config.get("architectures") or "unknown"
    return ValueError(
        f"model {path.name} has no chat template and its family ({family}) has no known chat "
        f"format (known: {KNOWN}); pass a Jinja template as chat_template= in the engine args "
        "(LLM(..., chat_template=...), get_engine, ChatPaged(chat_template=...), "
        "PagedLLM(chat_template=...))"
    )


def check_chat_template(chat_template: object) -> None:
    """An engine's `chat_template` is None or a Jinja template that parses, checked at
    construction rather than at the first chat."""
    if chat_template is None:
        return
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise ValueError(
            "chat_template must be None (the model's own, else its family's) or a non-empty "
            f"Jinja template string, got {chat_template!r:.60}"
        )
    try:
        Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"chat_template is not a valid Jinja template: {exc.message} (line {exc.lineno})"
        ) from None


def _config(path: Path) -> dict:
    config_file = path / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}
