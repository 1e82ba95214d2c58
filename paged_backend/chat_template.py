"""A chat rendered with the model's own template, and with a system prompt where the template
has no system role.

Some templates refuse a "system" turn (Gemma 1 and 2 raise "System role not supported"); their
models are trained to read instructions at the top of the first user turn, which is where Gemma
3's own template puts them. So when a template refuses a conversation that starts with a system
turn, that turn is folded into the first user turn and the template is asked again."""

from __future__ import annotations

from jinja2 import TemplateError


def apply_chat_template(tokenizer, messages: list[dict], **kwargs) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`, folding a leading
    system turn into the first user turn where the template refuses a system role."""
    kwargs.setdefault("add_generation_prompt", True)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError:
        folded = fold_system_prompt(messages)
        if folded is None:
            raise
        return tokenizer.apply_chat_template(folded, tokenize=False, **kwargs)


def fold_system_prompt(messages: list[dict]) -> list[dict] | None:
    """`messages` with a leading system turn merged into the first user turn (or made one);
    None when there is no leading system turn."""
    if not messages or messages[0].get("role") != "system":
        return None
    system, rest = messages[0].get("content") or "", list(messages[1:])
    if rest and rest[0].get("role") == "user" and isinstance(rest[0].get("content"), str):
        return [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]
