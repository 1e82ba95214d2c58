"""Tool calling shared by the LangChain and LlamaIndex adapters.

Tools are OpenAI function specs (`{"type": "function", "function": {"name", "description",
"parameters"}}`). Calls use the Hermes / Qwen format, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that renders that format itself (it mentions `<tool_call>`, as Qwen2.5's does)
gets the tools and the history as they are. Any other template (SmolLM2's has no tool support)
gets the tools described in the system message, earlier calls written into the assistant turns
in the same format, and tool results as user turns inside `<tool_response>` tags.

The call format is enforced by constrained decoding with a structural tag: once the
model writes `<tool_call>`, only a call of one of the tools with arguments valid for its schema
can follow. With a required or named tool choice the whole output is such calls.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from paged_backend.structured_output import StructuredOutputsParams

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
# A constrained call: `<tool_call>\n{"name": "X", "arguments": {...}}\n</tool_call>`.
_CALL_HEAD = CALL_BEGIN + '\n{{"name": {name}, "arguments": '
_CALL_TAIL = "}\n" + CALL_END
# Whitespace runs inside constrained arguments: bounded, so a tiny model cannot loop on them.
_MAX_WHITESPACE = 1
# What a call's JSON starts with, up to its arguments (the arguments then stream as they come).
_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

ToolChoice = Literal["auto", "none", "required"] | str

_SYSTEM_PROMPT = """You can call functions to help answer the user. The functions, as JSON \
signatures inside <tools></tools> tags:
<tools>
{tools}
</tools>
To call a function, reply with a JSON object holding its name and arguments inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>
Function results come back inside <tool_response></tool_response> tags."""


def check_tools(tools: Any) -> list[dict]:
    """`tools` as a list of OpenAI function specs, each with a name. A name given twice (a
    pydantic class and its JSON schema, say) accepts arguments valid for either definition."""
    if not isinstance(tools, list | tuple) or not tools:
        raise ValueError(f"tools must be a non-empty list of OpenAI function specs, got {tools!r}")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise ValueError(
                'each tool must be {"type": "function", "function": {"name": ..., '
                f'"parameters": ...}}}}, got {tool!r}'
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(
                f"tool {name!r}: parameters must be a JSON schema object, "
                f"got {function['parameters']!r}"
            )
    return list(tools)


def tool_choice_name(tool_choice: Any, tools: list[dict]) -> ToolChoice:
    """Normalize a tool choice to "auto", "none", "required" or a tool name.

    Accepted: None or "auto"; "none"; "required", "any" or True (LangChain's spellings of
    "call some tool"); a tool name; or `{"type": "function", "function": {"name": ...}}`.
    """
    names = list(dict.fromkeys(t["function"]["name"] for t in tools))
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice in ("required", "any") or tool_choice is True:
        return "required"
    if tool_choice == "none" or tool_choice is False:
        return "none"
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    if isinstance(tool_choice, str) and tool_choice in names:
        return tool_choice
    raise ValueError(
        "tool_choice must be 'auto', 'none', 'required' / 'any', or the name of a bound tool "
        f"({', '.join(names)}), got {tool_choice!r}"
    )


def tool_call_constraint(
    tools: list[dict], tool_choice: ToolChoice, parallel_tool_calls: bool
) -> StructuredOutputsParams | None:
    """The structural tag that keeps every call valid; None for tool_choice "none".

    "auto": free text, but a `<tool_call>` the model starts must be a valid call.
    "required" or a tool name: the output is nothing but calls (of that tool).
    Without `parallel_tool_calls` generation ends after the first call.
    """
    if tool_choice == "none":
        return None
    chosen = [t for t in tools if tool_choice in ("auto", "required", t["function"]["name"])]
    tags = [
        {
            "type": "tag",
            "begin": _CALL_HEAD.format(name=json.dumps(t["function"]["name"])),
            "content": {
                "type": "json_schema",
                "json_schema": t["function"].get("parameters") or {"type": "object"},
                "max_whitespace_cnt": _MAX_WHITESPACE,
            },
            "end": _CALL_TAIL,
        }
        for t in chosen
    ]
    if tool_choice == "auto":
        fmt = {
            "type": "triggered_tags",
            "triggers": [CALL_BEGIN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel_tool_calls,
        }
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel_tool_calls,
        }
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


def pop_tool_request(kwargs: dict) -> list[dict] | None:
    """Take `tools`, `tool_choice` and `parallel_tool_calls` out of an adapter's call kwargs
    and, with tools, put their call constraint in `structured_outputs`. Returns the tools."""
    tools = kwargs.pop("tools", None)
    tool_choice = kwargs.pop("tool_choice", None)
    parallel = kwargs.pop("parallel_tool_calls", False)
    if tools is None:
        if tool_choice is not None:
            raise ValueError("tool_choice needs tools")
        return None
    tools = check_tools(tools)
    if kwargs.get("structured_outputs") is not None:
        raise ValueError("structured_outputs and tools cannot be used in one request")
    choice = tool_choice_name(tool_choice, tools)
    kwargs["structured_outputs"] = tool_call_constraint(tools, choice, bool(parallel))
    return tools


# ---- prompts -----------------------------------------------------------------------------------
def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the chat template writes tools and calls in the `<tool_call>` format itself."""
    return bool(chat_template) and CALL_BEGIN in chat_template


def format_call(name: str, arguments: dict | str) -> str:
    """One call as the model writes it (used for calls in the history)."""
    body = json.dumps({"name": name, "arguments": _as_dict(arguments)}, ensure_ascii=False)
    return f"{CALL_BEGIN}\n{body}\n{CALL_END}"


def render_tool_chat(
    apply_template: Callable[..., str],
    chat_template: str | None,
    messages: list[dict],
    tools: list[dict] | None,
) -> str:
    """The prompt for `messages`: role/content dicts where an assistant turn may carry
    `tool_calls` ([{"id", "name", "arguments"}]) and a "tool" turn a `tool_call_id`."""
    if template_renders_tools(chat_template):
        native = [_native_message(m) for m in messages]
        return apply_template(native, tools=tools) if tools else apply_template(native)
    rendered = [_plain_message(m) for m in messages]
    if tools:
        described = _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + described}
        else:
            rendered.insert(0, {"role": "system", "content": described})
    return apply_template(rendered)


def _native_message(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {
        **message,
        "tool_calls": [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": c["name"], "arguments": _as_dict(c["arguments"])},
            }
            for c in calls
        ],
    }


def _plain_message(message: dict) -> dict:
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message["content"]}
    text = "\n".join(
        [message["content"]] * bool(message["content"])
        + [format_call(c["name"], c["arguments"]) for c in calls]
    )
    return {"role": message["role"], "content": text}


def _as_dict(arguments: dict | str) -> dict:
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return arguments


# ---- parsing the output ------------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """New output of one call: its first delta has `id` and `name`, later ones only `arguments`
    text. The arguments of all deltas of an `index`, joined, are the call's JSON arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: dict


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    # Calls that do not parse (cut off by max_tokens, or written freely by an unconstrained
    # model): (id, name or None, raw arguments, error).
    invalid_tool_calls: list[tuple[str, str | None, str, str]] = field(default_factory=list)


class ToolCallParser:
    """Splits streamed output text into content text and tool-call deltas.

    Text that may be the start of `<tool_call>` is held back until it is decided; inside a call,
    the argument text is released as it arrives, except a last `}` that may close the call.
    Content comes out as a whole output's parse gives it, stripped: whitespace before the first
    content is dropped, and whitespace is held back until more content follows it.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._index = -1
        self._in_call = False
        self._head_seen = False
        self._content_started = False
        self._space = ""  # content's trailing whitespace, held back

    def feed(self, text: str, *, last: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content text, call deltas) that `text` completes, at most one delta a call; with
        `last`, also whatever was held back (the output ends with `text`)."""
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        if last:
            tail, more = self._finish()
            content.append(tail)
            deltas += more
        return self._stripped("".join(content), last), _joined(deltas)

    def _stripped(self, text: str, last: bool) -> str:
        """The content `text` adds to what was released, without the whole content's leading
        and (with `last`) trailing whitespace."""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        held = self._space + text
        released = held.rstrip()
        self._space = "" if last else held[len(released) :]
        return released

    def _finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Whatever is held back, at the end of the output."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        if self._head_seen:
            return "", [ToolCallDelta(self._index, arguments=rest)] if rest else []
        return "", [self._whole_call(rest)]

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what can be decided; True if calling again may consume more."""
        buffer = self._buffer
        if not self._in_call:
            start = buffer.find(CALL_BEGIN)
            if start < 0:
                keep = _partial_suffix(buffer, CALL_BEGIN)
                content.append(buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                return False
            content.append(buffer[:start])
            self._buffer = buffer[start + len(CALL_BEGIN) :]
            self._in_call, self._head_seen = True, False
            self._index += 1
            return True
        end = buffer.find(CALL_END)
        if not self._head_seen:
            head = _HEAD_RE.match(buffer)
            if head is None:
                if end < 0:
                    return False
                # Not in the streamed shape (e.g. "arguments" first): hand it over whole.
                deltas.append(self._whole_call(buffer[:end]))
                self._buffer, self._in_call = buffer[end + len(CALL_END) :], False
                return True
            name = json.loads(head.group(1))
            deltas.append(ToolCallDelta(self._index, id=_new_id(), name=name))
            self._buffer, self._head_seen = buffer[head.end() :], True
            return True
        if end >= 0:
            if rest := buffer[:end].rstrip().removesuffix("}"):
                deltas.append(ToolCallDelta(self._index, rest))
            self._buffer, self._in_call = buffer[end + len(CALL_END) :], False
            return True
        close = buffer.rfind("}")
        hold = close if close >= 0 and CALL_END.startswith(buffer[close + 1 :].lstrip()) else None
        released = buffer[:hold]
        if released:
            deltas.append(ToolCallDelta(self._index, released))
            self._buffer = buffer[len(released) :]
        return False

    def _whole_call(self, raw: str) -> ToolCallDelta:
        """A call in one delta; without a name when it is not a JSON call object."""
        try:
            value = json.loads(raw)
            name, arguments = value["name"], value.get("arguments", value.get("parameters", {}))
        except (ValueError, TypeError, KeyError, AttributeError):
            name = None
        if not isinstance(name, str):
            return ToolCallDelta(self._index, raw.strip(), id=_new_id())
        return ToolCallDelta(self._index, json.dumps(arguments), id=_new_id(), name=name)


def _joined(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """Each call's deltas joined into one, in the order the calls began (new objects: the
    deltas given stay as they are). `feed` hands over a call's deltas of one engine output so:
    a chunk's deltas are a message chunk's `tool_call_chunks`, and LangChain joins chunks of one
    index across chunks, never within one (a call whose name and arguments came in one output,
    as a stream under load delivers them, became ('get_weather', {}) and ('', {...}))."""
    calls: dict[int, ToolCallDelta] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = replace(delta)
        else:
            call.arguments += delta.arguments
            call.id = call.id or delta.id
            call.name = call.name or delta.name
    return list(calls.values())


def parse_tool_calls(text: str) -> ParsedOutput:
    """Content and calls of a whole output."""
    return collect_calls(*ToolCallParser().feed(text, last=True))


def collect_calls(content: str, deltas: Iterable[ToolCallDelta]) -> ParsedOutput:
    """Join the deltas of each call and parse its arguments."""
    parsed = ParsedOutput(content.strip())
    for call in _joined(deltas):
        name, arguments, error = call.name, call.arguments, None
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            value, error = None, f"the call's JSON does not parse: {exc}"
        if error is None and not (isinstance(name, str) and isinstance(value, dict)):
            error = "a call needs a string name and an object of arguments"
        if error is None:
            parsed.tool_calls.append(ParsedToolCall(call.id, name, value))
        else:
            parsed.invalid_tool_calls.append((call.id, name, arguments, error))
    return parsed


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
