"""A chat rendered with the model's own template, and with a system prompt where the template
has no system role.

Some templates refuse a "system" turn (Gemma 1 and 2 raise "System role not supported"); their
models are trained to read instructions at the top of the first user turn, which is where Gemma
3's own template puts them. So when a template refuses a conversation that starts with a system
turn, that turn is folded into the first user turn and the template is asked again."""

from __future__ import annotations

from jinja2 import TemplateError

from paged_backend.chat_formats import missing_template_error

# apply_chat_template's arguments for its tokenizer's own work (masks, marks, continuing) rather
# than the rendered text: set, a chat goes through transformers' tokenizer (as does any call
# that does not ask for `tokenize=False`).
_TOKENIZER_WORK = (
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
    "continue_final_message",
)
# Message fields transformers 5 copies under each other's names before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check_chat_messages(messages: list[dict]) -> None:
    """A chat must give text to answer, as a completion prompt must: a conversation without
    messages, or with a user message whose content is empty, is refused (naming the message),
    where the template's framing alone would otherwise be answered. Every chat entry (LLM.chat,
    the engines' `apply_chat_template`, ChatPaged, LlamaIndex) checks here."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of chat messages, got {messages!r:.60}"
        )
    for i, message in enumerate(messages):
        user = isinstance(message, dict) and message.get("role") == "user"
        if user and _is_empty(message.get("content")):
            raise ValueError(
                f"messages[{i}] is a user message with empty content; a request must give text "
                "to answer"
            )


def _is_empty(content: object) -> bool:
    """No text: None, "", or a list of empty text parts (a part of another kind is not empty:
    `join_text_parts` names it)."""
    if content is None or isinstance(content, str):
        return not content
    if isinstance(content, list):
        return all(
            _is_empty(p.get("text")) if isinstance(p, dict) and p.get("type") == "text" else p == ""
            for p in content
        )
    return False  # not text at all: the template names what is wrong with it


def join_text_parts(messages: list[dict]) -> list[dict]:
    """`messages` with each content given as a list of parts (OpenAI's and vLLM's chat format,
    [{"type": "text", "text": ...}, ...], strings too) as its text parts joined by newlines, as
    vLLM gives them to templates that read a string: every template reads a string, not every
    one a list (SmolLM2's adds the content to a string). A part of another type (an image,
    audio, a file) is refused, naming its message: the engine serves text models."""
    joined = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            joined.append(message)
            continue
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                part = part.get("text")
            if not isinstance(part, str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"messages[{i}] has a content part of type {kind!r}; this engine serves "
                    "text models (parts of type 'text')"
                )
            texts.append(part)
        joined.append({**message, "content": "\n".join(texts)})
    return joined


def apply_chat_template(tokenizer, messages: list[dict], **kwargs) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`, folding a leading
    system turn into the first user turn where the template refuses a system role. A model
    without a template (nor a known family's) is refused in one line saying how to pass one."""
    if not tokenizer.chat_template and kwargs.get("chat_template") is None:
        raise missing_template_error(tokenizer)
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


def render_chat(
    template: str | dict | None,
    special_tokens: dict[str, str],
    messages: list[dict],
    *,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    **kwargs,
) -> str | None:
    """`apply_chat_template(messages, tokenize=False, ...)`'s text from the tokenizer's chat
    `template` (one, or a dict by name as transformers keeps several) and `special_tokens` (its
    `special_tokens_map`) alone, rendered by transformers' own Jinja renderer (its sandbox,
    filters and globals). None where the call asks for more (tokens, continuing a message,
    tools given as functions, message objects or reasoning fields, another transformers):
    the caller asks the tokenizer."""
    if kwargs.pop("tokenize", True) or any(kwargs.get(k) for k in _TOKENIZER_WORK):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in _TOKENIZER_WORK}
    kwargs.pop("return_dict", None)  # without tokens transformers returns the text alone
    if isinstance(template, dict):
        if chat_template in template:
            chat_template = template[chat_template]
        elif chat_template is None:
            named = "tool_use" if tools is not None and "tool_use" in template else "default"
            chat_template = template.get(named)
    elif chat_template is None:
        chat_template = template
    plain = all(type(m) is dict and not m.keys() & set(_REASONING_FIELDS) for m in messages)
    if chat_template is None or not plain or not all(type(t) is dict for t in tools or ()):
        return None
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return None
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = render_jinja_template(
        conversations=[chat],
        chat_template=chat_template,
        tools=tools,
        **{**special_tokens, **kwargs},
    )
    return rendered[0]
