"""LangChain messages -> the model's chat template. Text only for now: other content blocks
(images, audio, files) raise instead of being dropped silently."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jinja2 import TemplateError
from langchain_core.messages import BaseMessage

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        else:
            raise ValueError(
                f"{block.get('type')!r} content is not supported by this model (text only)"
            )
    return "".join(parts)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict]:
    """Role/content dicts as Hugging Face chat templates expect them. An AI message's tool calls
    go in the standard `tool_calls` field, for templates that render them."""
    dicts = []
    for message in messages:
        role = message.role if message.type == "chat" else _ROLES.get(message.type)
        if role is None:
            raise ValueError(f"unsupported message type {message.type!r}")
        entry = {"role": role, "content": _text(message)}
        if getattr(message, "tool_calls", None):
            entry["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
        if message.type == "tool":
            entry["tool_call_id"] = message.tool_call_id
        dicts.append(entry)
    return dicts


def _tool_as_user(entry: dict) -> dict:
    if entry["role"] != "tool":
        return entry
    return {"role": "user", "content": f"Tool result ({entry['tool_call_id']}): {entry['content']}"}


def render_chat(
    apply_template: Callable[[list[dict]], str], messages: Sequence[BaseMessage]
) -> str:
    """The prompt text for `messages`. A template that rejects the `tool` role (it raises, as
    many do for roles they do not know) gets tool results as user turns with a clear prefix."""
    dicts = to_chat_dicts(messages)
    try:
        return apply_template(dicts)
    except TemplateError:
        if not any(d["role"] == "tool" for d in dicts):
            raise
        return apply_template([_tool_as_user(d) for d in dicts])
