"""The shortest completion of a constrained output, and the budget guard built on it.

A constrained request must end with a complete structure even when `max_tokens` cuts it short.
`CompletionFinder` searches, from any grammar state, for the shortest text after which the
grammar may stop (inside a number: end it, then close what is open). `BudgetGuard` keeps, per
request, such a completion as token ids and holds one invariant, written down here once:

    the completion of the current state never needs more tokens than the budget has left.

The model writes freely while the invariant holds after its token; a token that would break it
is replaced by the completion's next token, and once the completion needs every token left the
output is exactly that completion. So the wrap-up starts as late as the grammar allows (string
arguments keep the tokens that remain), and the output always parses when the request's
`max_tokens` is at least the completion of the empty output (`GrammarCache.shortest_output`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from paged_backend.grammar_matcher import allocate_bitmask

if TYPE_CHECKING:
    from paged_backend.grammar_matcher import GrammarMatcher

# Bytes tried first, in this order, when several are allowed: a quote ends a string (outside
# one, an empty string is the shortest value), brackets close, `0` is the shortest number.
_PREFERRED = b'"}])0123456789tfn,:{[-.eE'
_WHITESPACE = b" \t\n\r"
_CLOSERS = (b'"', b"}", b"]", b")")
_MAX_BRANCHES = 24  # more allowed bytes than this: free text, where one filler byte stands for all
_MAX_EXPANSIONS = 500  # search states per shortest completion, then the greedy one stands
_MAX_GREEDY_BYTES = 4096


def _rank(byte: int) -> int:
    at = _PREFERRED.find(bytes([byte]))
    if at >= 0:
        return at
    return len(_PREFERRED) + (256 if byte in _WHITESPACE else byte)


_RANK = np.array([_rank(b) for b in range(256)])


def _may_stop(state: GrammarMatcher) -> bool:
    """Whether the grammar's root is complete: a stop token may end the output here."""
    return state.is_completed() or state.is_terminated()


class _Pieces(NamedTuple):
    pieces: tuple[bytes, ...]
    free_text: bool  # more bytes allowed than `_MAX_BRANCHES`: inside a string, say


class CompletionFinder:
    """Shortest completions for one tokenizer's grammars. A search state is a forked matcher;
    each step appends one byte (a token of one byte exists for every byte a byte-level
    vocabulary can write) or the whole string the grammar forces next."""

    def __init__(
        self,
        decoded_vocab: list[bytes],
        vocab_size: int,
        encode: Callable,
    ) -> None:
        byte_token = {}
        for token, text in enumerate(decoded_vocab):
            if len(text) == 1 and text[0] not in byte_token:
                byte_token[text[0]] = token
        order = sorted(byte_token, key=_rank)
        self._bytes = np.array(order, dtype=np.int64)
        self._byte_tokens = np.array([byte_token[b] for b in order], dtype=np.int64)
        self._token_of_byte = byte_token
        self._vocab = decoded_vocab
        self._vocab_size = vocab_size
        self._encode = encode

    def find(
        self, matcher: GrammarMatcher, *, thorough: bool, hints: tuple[bytes, ...] = ()
    ) -> bytes | None:
        """A text after which `matcher` may stop (b"" if it may stop now), None when there is
        none within the search's bounds: the greedy completion, or with `thorough` the
        shortest (a best-first search over the pieces, bounded by the greedy completion).
        `hints` are the spec's literal strings (a tag's end, a trigger), tried where free text
        allows every byte and no single byte leads anywhere else."""
        bitmask = self._bitmask()
        best = self._greedy(matcher, bitmask, hints)
        if not thorough:
            return best
        order = itertools.count()
        frontier = [(0, next(order), b"", matcher, b"")]
        for _ in range(_MAX_EXPANSIONS):
            if not frontier or (best is not None and frontier[0][0] >= len(best)):
                break
            _, _, text, state, parent = heapq.heappop(frontier)
            children = self._children(state, bitmask)
            if children is None:
                return text
            # A piece that leads back to a state that allows the same bytes (string content,
            # another digit, whitespace) is left to the greedy completion: expanding it costs
            # a branch per byte, and it rarely shortens the completion.
            signature = b"|".join(children.pieces)
            if signature == parent:
                continue
            for piece in children.pieces:
                child = state.fork()
                if child.accept_string(piece):
                    cost = len(text) + len(piece)
                    heapq.heappush(frontier, (cost, next(order), text + piece, child, signature))
        return best

    def _bitmask(self):
        return allocate_bitmask(1, self._vocab_size)

    def _children(self, state: GrammarMatcher, bitmask) -> _Pieces | None:
        """The pieces worth appending to `state`, best first; None when it may stop here."""
        if _may_stop(state):
            return None
        forced = state.find_jump_forward_string()
        if forced:
            return _Pieces((forced.encode(),), free_text=False)
        state.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].numpy().view(np.uint32)
        ids = self._byte_tokens
        allowed = self._bytes[((words[ids >> 5] >> (ids & 31)) & 1).astype(bool)]
        free_text = len(allowed) > _MAX_BRANCHES
        if free_text:  # string content: the structural bytes and one filler
            filler = [b for b in allowed if _RANK[b] >= len(_PREFERRED)][:1]
            allowed = [b for b in allowed if _RANK[b] < len(_PREFERRED)] + filler
        solid = [b for b in allowed if b not in _WHITESPACE]
        digits = [b for b in solid if 48 <= b <= 57]  # all digits lead alike: keep the first
        solid = [b for b in solid if not 48 <= b <= 57 or b == digits[0]]
        return _Pieces(tuple(bytes([b]) for b in (solid or allowed)), free_text)

    def _greedy(self, matcher: GrammarMatcher, bitmask, hints: tuple[bytes, ...]) -> bytes | None:
        """Follows the best-ranked piece (then hint) that closes something (a quote or bracket
        outside string content) or leads to a state allowing other bytes, the best piece when
        none does: ends a number or a string, then closes what is open. Free text that every
        piece and hint leads back to is then followed one first piece at a time, without
        trying the others again until the state changes (each try fills a bitmask: free text
        without a way out took ~17 s to give up on)."""
        state, text = matcher.fork(), b""
        children = self._children(state, bitmask)
        stuck = None  # free text that nothing led out of, and the piece followed there
        while children is not None:
            if len(text) > _MAX_GREEDY_BYTES:
                return None
            tried = stuck[1:] if stuck and stuck[0] == children else children.pieces + hints
            step = None
            for piece in tried:
                child = state.fork()
                if not child.accept_string(piece):
                    continue
                after = self._children(child, bitmask)
                step = step or (piece, child, after)
                closes = piece in _CLOSERS and not children.free_text
                if after is None or closes or after != children:
                    step = (piece, child, after)
                    break
            if step is None:
                return None
            if step[2] == children:
                stuck = (children, step[0])
            piece, state, children = step
            text += piece
        return text

    def tokens(self, text: bytes) -> list[int]:
        """`text` as token ids: the tokenizer's own spelling where it writes exactly these
        bytes, else one token per byte. The rest of a multi-byte character that a token began
        (continuation bytes, 0x80-0xBF) goes byte by byte, the text after it as usual."""
        cut = 0
        while cut < len(text) and 0x80 <= text[cut] < 0xC0:
            cut += 1
        head = [self._token_of_byte[b] for b in text[:cut]]
        try:
            ids = self._encode(text[cut:].decode("utf-8")) if cut < len(text) else []
        except UnicodeDecodeError:
            ids = None
        if ids is None or b"".join(self._vocab[t] for t in ids) != text[cut:]:
            ids = [self._token_of_byte[b] for b in text[cut:]]
        return head + ids

    def completes(self, matcher: GrammarMatcher, text: bytes) -> bool:
        """Whether `matcher` may stop after `text`."""
        probe = matcher.fork()
        return probe.accept_string(text) and _may_stop(probe)

    def piece(self, token: int) -> bytes:
        return self._vocab[token]


class BudgetGuard:
    """One constrained request's completion from its grammar's current state, as text and as
    token ids (see the module docstring for the invariant it keeps). It starts from the
    shortest completion; later ones are the greedy completion or the rest of an earlier one:
    the search for the shortest costs ~20 ms, too much for every step, and saves few tokens."""

    def __init__(
        self, finder: CompletionFinder, text: bytes, tokens: list[int], hints: tuple[bytes, ...]
    ) -> None:
        self._finder = finder
        self._hints = hints  # the spec's literal strings (`CompletionFinder.find`)
        self._set(text, list(tokens))  # a copy: the grammar cache shares its own

    def _set(self, text: bytes, tokens: list[int]) -> None:
        self.text = text
        self.tokens = tokens

    def forced(self, budget: int) -> int | None:
        """The token the output must take with `budget` tokens left: the completion's next
        one once the completion needs them all."""
        return self.tokens[0] if self.tokens and len(self.tokens) >= budget else None

    def admit(self, matcher: GrammarMatcher, token: int, budget: int) -> int:
        """`token` if a completion of fewer than `budget` tokens follows it, else the
        completion's next token (a stop token when the output is complete already). The
        completion moves on past the returned token; `matcher` itself is not advanced."""
        if self.tokens and token == self.tokens[0]:
            return self._take_first()
        after = matcher.fork()
        if after.accept_token(token):
            for text in self._completions_after(after, self._finder.piece(token)):
                tokens = self._tokens_of(text)
                if len(tokens) < budget:
                    self._set(text, tokens)
                    return token
        if not self.tokens:
            return matcher.stop_token_ids[0]
        return self._take_first()

    def _tokens_of(self, text: bytes) -> list[int]:
        """`text`'s token ids. A suffix of the current completion keeps the current ids after
        the first whole token in it (tokenizing costs ~0.1 ms a call); the text before them
        is tokenized with that token, so that the tokens at the cut can merge (`"` + `}`)."""
        if text == self.text:
            return self.tokens
        if not self.text.endswith(text):
            return self._finder.tokens(text)
        start, begin = len(self.text) - len(text), 0
        for i, token in enumerate(self.tokens):
            end = begin + len(self._finder.piece(token))
            if begin >= start:  # the first token wholly inside `text`
                return self._finder.tokens(text[: end - start]) + self.tokens[i + 1 :]
            begin = end
        return self._finder.tokens(text)

    def _take_first(self) -> int:
        first = self.tokens[0]
        self._set(self.text[len(self._finder.piece(first)) :], self.tokens[1:])
        return first

    def _completions_after(self, after: GrammarMatcher, piece: bytes):
        """Completions of the state `after` a token that wrote `piece`, cheapest to find first:
        the rest of the current one where the token follows it; where it wrote whitespace or
        content first (`"a` in a string, an email's `@`), the current one from just past the
        token's text in it, or whole (string content and digits leave it valid); then the
        greedy completion."""
        if piece and self.text.startswith(piece):
            yield self.text[len(piece) :]
        core = piece.strip(_WHITESPACE)
        at = self.text.find(core) if core else -1
        for text in dict.fromkeys((self.text[at + len(core) :] if at >= 0 else b"", self.text)):
            if text and self._finder.completes(after, text):
                yield text
        text = self._finder.find(after, thorough=False, hints=self._hints)
        if text is not None:
            yield text
