"""Structured output (constrained decoding) with xgrammar, with vLLM's `StructuredOutputsParams`.

A request's spec is compiled once per engine (cached by its canonical form) when the request is
validated, so a bad schema, regex or grammar raises before anything is queued. Each sequence
gets its own `GrammarMatcher`: the sampler masks the logits of constrained rows to the tokens
the matcher allows, and the engine advances the matcher with every token it appends.

xgrammar is the `[structured]` extra, imported on the first constrained request: every
xgrammar release requires triton on Linux x86-64 (~1 GB, for its GPU mask kernel), which an
engine that never constrains its output should not have to install.
"""

from __future__ import annotations

import json as jsonlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paged_backend.completion import BudgetGuard, CompletionFinder
from paged_backend.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
_CACHE_SIZE = 256  # compiled specs kept per engine; xgrammar keeps its own cache under ours
# No unbounded runs inside a JSON value: at most this much whitespace between two tokens (room
# for pretty-printing a few levels deep), and at most this many digits in each part of a number
# (a double holds ~15 significant digits: longer runs are a model looping, and would otherwise
# go on until max_tokens).
MAX_WHITESPACE_RUN = 12
MAX_NUMBER_DIGITS = 15


@dataclass
class StructuredOutputsParams:
    """Constrain the output to exactly one of: a JSON schema (`json`: a dict, a JSON string or a
    pydantic model class), any JSON object (`json_object=True`), a regular expression (`regex`),
    one of a list of strings (`choice`), an EBNF grammar in xgrammar's syntax (`grammar`,
    start rule `root`) or an xgrammar structural tag (`structural_tag`, a dict or JSON string:
    free text with constrained tagged regions, which is how tool calls are constrained).
    `disable_any_whitespace` makes JSON compact: small models may otherwise emit whitespace
    between tokens for a long time."""

    json: dict | str | type | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False
    key: tuple[str, str, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; "
                f"got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        _require(
            isinstance(self.disable_any_whitespace, bool),
            "disable_any_whitespace",
            "a bool",
            self.disable_any_whitespace,
        )
        self.key = (kind, _canonical_spec(kind, getattr(self, kind)), self.disable_any_whitespace)


def _canonical_spec(kind: str, value: Any) -> str:
    """The spec as one string that names its grammar: equal specs share one compilation."""
    if kind == "json":
        return _schema_text(value)
    if kind == "structural_tag" and isinstance(value, dict):
        return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if kind == "json_object":
        _require(value is True, "json_object", "True", value)
        return ""
    if kind == "choice":
        _require(
            isinstance(value, list | tuple)
            and value
            and all(isinstance(s, str) and s for s in value),
            "choice",
            "a non-empty list of non-empty strings",
            value,
        )
        return jsonlib.dumps(list(value), ensure_ascii=False)
    _require(isinstance(value, str) and value.strip(), kind, "a non-empty string", value)
    return value


def _schema_text(value: Any) -> str:
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # pydantic model
        value = value.model_json_schema()
    elif isinstance(value, str):
        try:
            value = jsonlib.loads(value)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    _require(
        isinstance(value, dict),
        "json",
        "a JSON schema object (a dict, a JSON string or a pydantic model class)",
        value,
    )
    try:  # key order is kept: it is the order the properties are generated in
        return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except TypeError as exc:
        raise ValueError(f"structured_outputs.json is not JSON-serializable: {exc}") from None


def _require(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"structured_outputs.{name} must be {allowed}, got {value!r}")


_Shortest = tuple[bytes, list[int]] | None  # a spec's shortest complete output: text, token ids


class GrammarCache:
    """Compiles specs for one engine's tokenizer and hands out matchers. Thread-safe: callers
    validate requests in their own threads while the engine thread creates matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.stop_token_ids = stop_token_ids
        self._vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._first_tokens: dict[str, int] = {}
        self._compiled: OrderedDict[tuple, tuple[xgr.CompiledGrammar, _Shortest]] = OrderedDict()
        self._lock = threading.Lock()  # guards only the dict: compiles may run concurrently

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params`; raises ValueError if the spec is invalid."""
        return self._entry(params)[0]

    def _entry(self, params: StructuredOutputsParams) -> tuple[xgr.CompiledGrammar, _Shortest]:
        """The compiled grammar of `params` and the shortest completion of its start (text and
        token ids, or None where the search gave up), both once per spec."""
        with self._lock:
            entry = self._compiled.get(params.key)
            if entry is not None:
                self._compiled.move_to_end(params.key)
                return entry
        compiled = self._compile(*params.key)
        text = self._finder.find(_xgrammar().GrammarMatcher(compiled), thorough=True)
        entry = (compiled, None if text is None else (text, self._finder.tokens(text)))
        with self._lock:
            self._compiled[params.key] = entry
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return entry

    @cached_property
    def _info(self) -> xgr.TokenizerInfo:
        # `vocab_size` is the model's: ids the tokenizer does not know are never allowed.
        return _xgrammar().TokenizerInfo.from_huggingface(
            self._tokenizer.hf, vocab_size=self._vocab_size, stop_token_ids=self.stop_token_ids
        )

    @cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        return _xgrammar().GrammarCompiler(self._info)

    def _compile(self, kind: str, spec: str, compact: bool) -> xgr.CompiledGrammar:
        try:
            if kind in ("json", "json_object"):
                grammar = _xgrammar().Grammar.from_json_schema(
                    spec if kind == "json" else _ANY_OBJECT_SCHEMA,
                    any_whitespace=not compact,
                    max_whitespace_cnt=None if compact else MAX_WHITESPACE_RUN,
                )
                return self._compiler.compile_grammar(json_ebnf(grammar))
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "structural_tag":  # tool calls: JSON inside tags, its numbers bounded too
                grammar = _xgrammar().Grammar.from_structural_tag(spec)
                return self._compiler.compile_grammar(json_ebnf(grammar))
            if kind == "choice":
                # JSON string literals are valid EBNF string literals.
                alternatives = (jsonlib.dumps(c, ensure_ascii=False) for c in jsonlib.loads(spec))
                return self._compiler.compile_grammar("root ::= " + " | ".join(alternatives))
            return self._compiler.compile_grammar(spec)
        except RuntimeError as exc:  # xgrammar reports every invalid spec this way
            raise ValueError(f"invalid structured_outputs.{kind}: {_clean(exc)}") from None

    @cached_property
    def _finder(self) -> CompletionFinder:
        return CompletionFinder(
            self._info.decoded_vocab,
            self._vocab_size,
            lambda text: self._tokenizer.encode(text, add_special_tokens=False),
        )

    def shortest_output(self, params: StructuredOutputsParams) -> tuple[int, str] | None:
        """The fewest new tokens a complete output of `params` takes, and that output; None
        when the search for it gave up (a grammar with no end in reach)."""
        shortest = self._entry(params)[1]
        if shortest is None:
            return None
        text, tokens = shortest
        return len(tokens), text.decode("utf-8", "replace")

    def budget_guard(self, params: StructuredOutputsParams) -> BudgetGuard | None:
        """A fresh request's `BudgetGuard`; None when its grammar has no completion in reach."""
        shortest = self._entry(params)[1]
        return None if shortest is None else BudgetGuard(self._finder, *shortest)

    def forced_token(self, matcher: xgr.GrammarMatcher) -> int | None:
        """The first token of the text the grammar forces next (a key, `": "`, a closing
        bracket), as the tokenizer would write it; None when the grammar leaves a choice.
        Constrained models otherwise spell forced keys in odd fragments ("s", "et", "u",
        "p"), which costs steps and puts the model off its usual text."""
        forced = matcher.find_jump_forward_string()
        if not forced:
            return None
        token = self._first_tokens.get(forced)
        if token is None:
            token = self._tokenizer.encode(forced, add_special_tokens=False)[0]
            if len(self._first_tokens) < 65536:  # bounded: forced strings repeat across requests
                self._first_tokens[forced] = token
        return token

    def matcher(
        self, params: StructuredOutputsParams, stop_token_ids: list[int]
    ) -> xgr.GrammarMatcher:
        """A fresh matcher whose grammar ends with EOS or one of the request's stop tokens."""
        extra = [t for t in stop_token_ids if t not in self.stop_token_ids]
        return _xgrammar().GrammarMatcher(
            self.compile(params), override_stop_tokens=self.stop_token_ids + extra
        )


def json_ebnf(grammar: xgr.Grammar) -> str:
    """`grammar` (xgrammar's JSON rules inside) as EBNF text, corrected where xgrammar's rules
    let a model write JSON that does not parse or loop without end:
    - the digit runs of its number rules are bounded: `[0-9]*` after a leading digit and
      `digits{1, -1}` (fraction, exponent) get `MAX_NUMBER_DIGITS` at most;
    - the characters of a string with a length bound exclude control characters, which JSON
      strings may hold only escaped (xgrammar's rule excludes only `"`, `\\`, CR and LF);
    - U+0080-U+00FF are written `\\u00HH`: xgrammar prints them `\\xHH` but reads `\\x` with
      every hex digit that follows (`"\\xe9a"`, printed for "éa", reads as U+0E9A).
      Compiling the Grammar object itself goes through the same printer and is wrong alike."""
    text = re.sub(
        r"\\(\\|x([0-9a-fA-F]{2}))",
        lambda m: m[0] if m[1] == "\\" else "\\u00" + m[2],
        str(grammar),
    )
    text = text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)
    rules = []
    for rule in text.splitlines():
        if rule.startswith(("basic_number", "basic_integer")):
            rule = rule.replace("[0-9]*", f"[0-9]{{0, {MAX_NUMBER_DIGITS - 1}}}")
            rule = rule.replace("{1, -1}", f"{{1, {MAX_NUMBER_DIGITS}}}")
        rules.append(rule)
    return "\n".join(rules)


_BOUNDED_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\u001f\"\\]"


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(
            "structured output (structured_outputs, tool calls, with_structured_output) needs "
            "xgrammar: pip install 'paged-backend[structured]'"
        ) from None
    return xgrammar


def _clean(exc: RuntimeError) -> str:
    """xgrammar's message without its C++ log prefix ("[10:38:29] /project/cpp/x.cc:94: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


@torch.inference_mode()  # the model's logits are inference tensors: in place only in here
def apply_grammar_bitmask(
    logits: torch.Tensor,
    rows: list[int],
    matchers: list[xgr.GrammarMatcher],
    forced_tokens: list[int | None] | None = None,
) -> None:
    """Set to -inf, in place, the logits of `rows` that their matcher does not allow; other rows
    are not touched. `logits` is as wide as the model's vocabulary. A row's allowed forced token
    (`GrammarCache.forced_token`), when given, is the only one left.

    The bitmask is unpacked with numpy and applied with `masked_fill_` rather than with xgrammar's
    `apply_token_bitmask_inplace`: its CPU kernel took 5.3 ms for 32 rows of 49152 where this
    takes 1.6 ms (masks recorded from a JSON-schema batch)."""
    vocab = logits.shape[1]
    bitmask = _xgrammar().allocate_token_bitmask(len(rows), vocab)
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, i)
    # Bit t of a row is bit t % 8 of byte t // 8 on a little-endian host: bitorder="little".
    banned = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    banned = torch.from_numpy(banned).view(torch.bool)
    for i, row in enumerate(rows):
        forced = forced_tokens[i] if forced_tokens else None
        if forced is not None and not banned[i, forced]:
            kept = logits[row, forced].item()
            logits[row].fill_(float("-inf"))
            logits[row, forced] = kept
        else:
            logits[row].masked_fill_(banned[i], float("-inf"))
