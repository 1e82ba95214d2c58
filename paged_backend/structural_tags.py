"""Structural tags (xgrammar's format, which vLLM's `structural_tag` takes) as llguidance Lark.

A structural tag is free text with constrained regions, which is how tool calls are constrained.
The format is a tree of nodes:
- `const_string` (`value`), `json_schema` (`json_schema`, optional `max_whitespace_cnt`),
  `regex` (`pattern`), `any_text` (as a tag's content, or the whole output);
- `sequence` and `or` (`elements`), `tag` (`begin`, `content`, `end`);
- `triggered_tags` (`triggers`, `tags`, `at_least_one`, `stop_after_first`): free text in which
  each trigger starts one of the tags whose `begin` starts with it; the free text itself never
  holds a trigger, so a call the model starts is always a valid one;
- `tags_with_separator` (`tags`, `separator`, `at_least_one`, `stop_after_first`).
vLLM's older form, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, is read as
`triggered_tags`. JSON inside is bounded as `json_bounds` says.
"""

from __future__ import annotations

import json
import re
from typing import Any

from paged_backend.json_bounds import bounded_schema, compile_options


def structural_tag_lark(spec: dict, compact: bool) -> str:
    """The Lark grammar of a structural tag; ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError("must be a JSON object")
    if "structures" in spec:  # vLLM's older form
        fmt = {
            "type": "triggered_tags",
            "triggers": spec.get("triggers"),
            "tags": [
                {
                    "type": "tag",
                    "begin": s.get("begin"),
                    "content": {"type": "json_schema", "json_schema": s.get("schema")},
                    "end": s.get("end"),
                }
                for s in _list(spec, "structures")
            ],
        }
    elif spec.get("type") == "structural_tag" and "format" in spec:
        fmt = spec["format"]
    else:
        raise ValueError('needs "format" (or vLLM\'s "structures" and "triggers")')
    builder = _LarkBuilder(compact)
    start = builder.node(fmt, top=True)
    return "\n".join(["%llguidance {}", f"start: {start}", *builder.rules])


class _LarkBuilder:
    def __init__(self, compact: bool) -> None:
        self.rules: list[str] = []
        self._compact = compact
        self._names = 0

    def node(self, fmt: Any, *, top: bool = False) -> str:
        """A Lark expression for `fmt`; rules it needs go into `self.rules`."""
        if not isinstance(fmt, dict):
            raise ValueError(f"a format must be a JSON object, got {fmt!r}")
        kind = fmt.get("type")
        if kind == "const_string":
            return _literal(_text(fmt, "value"))
        if kind == "json_schema":
            return self._json(fmt)
        if kind == "regex":
            return f"/{_lark_regex(_text(fmt, 'pattern'))}/"
        if kind == "any_text" and top:
            return "/(?s:.*)/"
        if kind == "any_text":
            raise ValueError("any_text is supported only as a tag's content or the whole format")
        if kind in ("sequence", "or"):
            parts = [self.node(e) for e in _list(fmt, "elements")]
            return "(" + (" " if kind == "sequence" else " | ").join(parts) + ")"
        if kind == "tag":
            return self._tag(fmt)
        if kind == "triggered_tags":
            return self._triggered(fmt)
        if kind == "tags_with_separator":
            return self._separated(fmt)
        raise ValueError(f"unknown format type {kind!r}")

    def _rule(self, body: str, options: str = "", *, terminal: bool = False) -> str:
        """A new rule (a terminal: a single lexeme) named for `body`."""
        self._names += 1
        name = f"{'T' if terminal else 'r'}{self._names}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def _json(self, fmt: dict) -> str:
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict | bool):
            raise ValueError(f"json_schema must be a JSON schema object, got {schema!r}")
        schema = bounded_schema(schema if isinstance(schema, dict) else {})
        options = compile_options(self._compact)
        spaces = fmt.get("max_whitespace_cnt")
        if spaces is not None and not self._compact:
            options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{int(spaces)}}}"
        schema["x-guidance"] = options
        return self._rule("%json " + json.dumps(schema, ensure_ascii=False))

    def _tag(self, fmt: dict, after: str = "") -> str:
        """`begin content end`; `after`: the part of `begin` already matched (a trigger)."""
        begin, end = _text(fmt, "begin"), _text(fmt, "end")
        if not begin.startswith(after):
            raise ValueError(f"tag begin {begin!r} does not start with its trigger {after!r}")
        content = fmt.get("content")
        head = _literal(begin[len(after) :]) if begin != after else ""
        if isinstance(content, dict) and content.get("type") == "any_text":
            if not end:
                return f"{head} /(?s:.*)/"
            return f"{head} {self._rule('/(?s:.*)/', f'[suffix={_literal(end)}]')}"
        return f"{head} {self.node(content)} {_literal(end) if end else ''}".strip()

    def _triggered(self, fmt: dict) -> str:
        triggers = [t for t in _list(fmt, "triggers") if isinstance(t, str) and t]
        tags = _list(fmt, "tags")
        if not triggers or not tags:
            raise ValueError("triggered_tags needs non-empty triggers and tags")
        unmatched = [t for t in tags if not any(_text(t, "begin").startswith(g) for g in triggers)]
        if unmatched:
            raise ValueError(f"tag begin {unmatched[0].get('begin')!r} starts with no trigger")
        anything = self._rule("/(?s:.*)/", terminal=True)
        calls = []
        for trigger in triggers:
            mine = [t for t in tags if _text(t, "begin").startswith(trigger)]
            if not mine:
                raise ValueError(f"trigger {trigger!r} starts no tag's begin")
            head = self._rule(f"{anything} {_literal(trigger)}", "[lazy]")
            calls.append(f"{head} (" + " | ".join(f"({self._tag(t, trigger)})" for t in mine) + ")")
        any_trigger = _lark_regex("|".join(re.escape(t) for t in triggers))
        tail = self._rule(f"/(?s:.*)/ & ~/(?s:.*)({any_trigger})(?s:.*)/", terminal=True)
        call = self._rule(" | ".join(f"({c})" for c in calls))
        return _repeat(call, fmt, tail=tail)

    def _separated(self, fmt: dict) -> str:
        tag = self._rule(" | ".join(f"({self.node(t)})" for t in _list(fmt, "tags")))
        separator = fmt.get("separator", "")
        if not isinstance(separator, str):
            raise ValueError(f"separator must be a string, got {separator!r}")
        return _repeat(tag, fmt, separator=_literal(separator) if separator else "")


def _repeat(item: str, fmt: dict, *, tail: str = "", separator: str = "") -> str:
    """`item` once (`stop_after_first`) or any number of times, at least once with
    `at_least_one`, followed by `tail`."""
    at_least_one = fmt.get("at_least_one", False)
    if fmt.get("stop_after_first", False):
        return f"{item}" if at_least_one else (f"({tail} | {item})" if tail else f"{item}?")
    if tail:
        return f"{item}{'+' if at_least_one else '*'} {tail}"
    more = f"{item} ({separator} {item})*"
    return more if at_least_one else f"({more})?"


def _list(fmt: dict, key: str) -> list:
    value = fmt.get(key)
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list, got {value!r}")
    return value


def _text(fmt: Any, key: str) -> str:
    value = fmt.get(key) if isinstance(fmt, dict) else None
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_regex(pattern: str) -> str:
    """`pattern` made safe inside Lark's `/.../`."""
    from paged_backend.grammar_matcher import llguidance_module

    return llguidance_module().regex_to_lark(pattern)
