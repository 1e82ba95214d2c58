"""LangChain messages -> the model's chat template. Text only: other content blocks (images,
audio, files) raise instead of being dropped silently. Tool calls and tool results are rendered
as `paged_backend.tool_calling` describes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from langchain_core.messages import BaseMessage

from paged_backend.adapters import chat_message
from paged_backend.tool_calling import render_tool_chat

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
        elif block.get("type") not in ("tool_use", "tool_call"):  # also in `tool_calls`
            raise ValueError(
                f"{block.get('type')!r} content is not supported by this model (text only)"
            )
    return "".join(parts)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict]:
    """Role/content dicts; an AI message's calls go in `tool_calls` ({"id", "name",
    "arguments"}) and a tool message keeps its `tool_call_id`."""
    dicts = []
    for message in messages:
        role = message.role if message.type == "chat" else _ROLES.get(message.type)
        if role is None:
            raise ValueError(f"unsupported message type {message.type!r}")
        calls = [
            {"id": c.get("id"), "name": c["name"], "arguments": c["args"]}
            for c in getattr(message, "tool_calls", None) or []
        ]
        dicts.append(
            chat_message(role, _text(message), calls, getattr(message, "tool_call_id", None))
        )
    return dicts


def render_chat(
    apply_template: Callable[..., str],
    chat_template: str | None,
    messages: Sequence[BaseMessage],
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages`, with `tools` (OpenAI function specs) described."""
    return render_tool_chat(apply_template, chat_template, to_chat_dicts(messages), tools)
