"""A grammar's state for one sequence, on llguidance (the `[structured]` extra).

llguidance is the Rust grammar engine behind vLLM's `guidance` backend and llama.cpp's optional
constrained decoding; it needs no triton (xgrammar requires it on Linux x86-64, ~1 GB). Its
`LLMatcher` works on token ids; `GrammarMatcher` adds what the engine and the completion search
need: forks, text appended as bytes, and stop tokens a request adds to the model's EOS (a grammar
that may end allows each of them, and taking one ends the grammar as EOS would).

Token bitmasks are int32 rows of `ceil(vocab / 32)` words; bit `t % 32` of word `t // 32`
allows token `t`. Ids past the tokenizer's vocabulary are never allowed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import llguidance

    from paged_backend.tokenizer import Tokenizer


def llguidance_module():
    """llguidance, or an ImportError saying which extra brings it."""
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "structured output (structured_outputs, tool calls, with_structured_output) needs "
            "llguidance: pip install 'paged-backend[structured]'"
        ) from None
    return llguidance


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarTokenizer:
    """One engine's tokenizer as llguidance sees it, built once (~0.25 s) on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._vocabulary: _Vocabulary | None = None  # the token bytes the tables are built from
        self._lock = threading.Lock()  # two threads must not build it twice

    @property
    def ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = self._build()
            return self._ll

    def _build(self) -> llguidance.LLTokenizer:
        """llguidance's tables for the tokenizer, built in steps that each hold the GIL briefly
        (an event loop in another thread stalls while one runs; built in one call,
        `llguidance.hf.from_tokenizer`, they held it 0.25-0.33 s on a Zen 4):
        - each token's bytes, read in Python (`_token_bytes`; llguidance's own read of the
          tokenizer's JSON held the GIL ~0.2 s on a 2-core AVX2 EPYC);
        - the tables from those bytes, with this tokenizer's own `encode` (merges and all:
          llguidance spells forced text in the tokenizer's canonical tokens);
        - the vocabulary slices that make masks fast."""
        llg = llguidance_module()
        backend = self._tokenizer.backend_tokenizer
        if backend is None:
            raise ValueError("structured output needs a fast (Rust) tokenizer; this model has none")
        read = _token_bytes(backend)
        if read is None:
            raise ValueError(
                "structured output needs a byte-level or byte-fallback tokenizer (the decoders "
                f"llguidance reads); this tokenizer's decoder is {_decoder(backend).get('type')}"
            )
        tokens, specials = read
        tokens += [b""] * (self.vocab_size - len(tokens))  # ids the model has past the tokenizer
        self._vocabulary = _Vocabulary(tokens, specials, self._tokenizer, self.stop_token_ids)
        tables = llg.LLTokenizer(
            llg.TokenizerWrapper(self._vocabulary),
            n_vocab=self.vocab_size,
            eos_token=self.stop_token_ids,
            slices=[],
        )
        # The two Rust calls hold the GIL ~0.1 s each. Between them a thread that waits for it
        # (an event loop) must get it: dropped at a bytecode boundary, it can go to a third
        # thread instead, and the loop waits through both calls.
        time.sleep(sys.getswitchinterval())
        return tables.with_slices(llg.LLTokenizer.general_slices())

    @cached_property
    def decoded_vocab(self) -> list[bytes]:
        """Each token id's bytes (b"" for special tokens and ids past the tokenizer), as the
        tables were built from them."""
        self.ll  # noqa: B018 (builds the tables and their vocabulary once)
        tokens, specials = self._vocabulary.tokens, set(self._vocabulary.special_token_ids)
        return [b"" if t in specials else piece for t, piece in enumerate(tokens)] + [b""] * (
            self.vocab_size - len(tokens)
        )

    @cached_property
    def _byte_tokens(self) -> list[int | None]:
        """Each byte's one-byte token (None where there is none)."""
        tokens: list[int | None] = [None] * 256
        for token, piece in enumerate(self.decoded_vocab):
            if len(piece) == 1 and tokens[piece[0]] is None:
                tokens[piece[0]] = token
        return tokens

    def encode_bytes(self, text: bytes) -> list[int]:
        """Tokens that spell `text`, for the grammar (which reads bytes, however they are cut):
        one a byte where the vocabulary has them, as byte-level vocabularies do; llguidance's
        tokenizer, which calls back into Python, otherwise. The budget guard's search appends
        text a byte at a time, and the callback was half its cost."""
        tokens = [self._byte_tokens[b] for b in text]
        return self.ll.tokenize_bytes(text) if None in tokens else tokens


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level
    vocabulary (printable Latin-1 bytes themselves, the others from U+0100 on, in order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(0x100, 0x200))
    return {chr(b if b in printable else next(others)): b for b in range(256)}


def _decoder(backend) -> dict:
    """The tokenizer's decoder as its JSON reads ({} where it has none)."""
    return json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}


def _token_bytes(backend) -> tuple[list[bytes], list[int]] | None:
    """Each token's bytes and the special tokens' ids, read in Python (its loop lets other
    threads run) as llguidance reads them, for the two decoders it knows: byte-level (a
    character a byte, `_byte_level_alphabet`) and byte fallback (`<0xHH>` tokens for bytes, and
    a `Replace` decoder's space character as a space). None for any other decoder (llguidance
    refuses them too). An added token is special where the tokenizer says so or where it reads
    `<...>` (Qwen's `<tool_call>`, say), as llguidance has it; other added tokens are read as the
    vocabulary's, as they are where a byte-level one is not in the alphabet."""
    decoder = _decoder(backend)
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    byte_level = decoder.get("type") == "ByteLevel"
    byte_fallback = any(part.get("type") == "ByteFallback" for part in parts)
    if not (byte_level or byte_fallback):
        return None
    space = " "
    for part in parts:
        pattern = part.get("pattern", {}).get("String", "") if part.get("type") == "Replace" else ""
        if part.get("content") == " " and len(pattern) == 1:
            space = pattern
    alphabet = _byte_level_alphabet()
    added = backend.get_added_tokens_decoder()
    tokens: list[bytes] = []
    specials: list[int] = []
    for token in range(backend.get_vocab_size(with_added_tokens=True)):
        name = backend.id_to_token(token)
        extra = added.get(token)
        if name is None:
            piece = b""
        elif extra is not None and (extra.special or (name[:1] == "<" and name[-1:] == ">")):
            piece = name.encode()
            specials.append(token)
        elif byte_fallback and len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
            piece = bytes([int(name[3:5], 16)])
        elif byte_fallback:
            piece = name.replace(space, " ").encode()
        elif all(c in alphabet for c in name):
            piece = bytes(alphabet[c] for c in name)
        else:  # llguidance skips such a vocabulary token, and reads such an added one as text
            piece = b"" if extra is None else name.encode()
        tokens.append(piece)
    return tokens, specials


class _Vocabulary:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one."""

    def __init__(
        self, tokens: list[bytes], special_token_ids: list[int], tokenizer, stop_token_ids
    ):
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = stop_token_ids[0]
        self.bos_token_id = None  # llguidance reads it for prompts, which it never sees here
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace"), add_special_tokens=False)


class GrammarMatcher:
    """A sequence's position in its grammar. `stop_token_ids` end the grammar where it may end:
    the model's EOS ids (the tokenizer's) and the request's own."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        tokenizer: GrammarTokenizer,
        stop_token_ids: list[int],
    ) -> None:
        self._m = matcher
        self._tok = tokenizer
        self.stop_token_ids = stop_token_ids
        self._extra_stops = [t for t in stop_token_ids if t not in tokenizer.stop_token_ids]
        self._ended = False  # a stop token was taken

    def fork(self) -> GrammarMatcher:
        fork = GrammarMatcher(self._m.deep_copy(), self._tok, self.stop_token_ids)
        fork._ended = self._ended
        return fork

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False, and no change, if the grammar forbids it."""
        if token in self.stop_token_ids:
            if not self._m.is_accepting():
                return False
            self._ended = self._m.consume_token(
                self._tok.stop_token_ids[0] if token in self._extra_stops else token
            )
            return self._ended
        return self._consume([token])

    def accept_string(self, text: str | bytes) -> bool:
        """Advance past `text`; False, and no change, if the grammar forbids it."""
        data = text.encode() if isinstance(text, str) else text
        return not data or self._consume(self._tok.encode_bytes(data))

    def _consume(self, tokens: list[int]) -> bool:
        # A rejected token would leave llguidance's matcher in its error state for good.
        return self._m.validate_tokens(tokens) == len(tokens) and self._m.consume_tokens(tokens)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self._extra_stops and self._m.is_accepting():
            for token in self._extra_stops:
                words[token // 32] |= _bit(token % 32)

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next ("" when it leaves a choice), cut before a
        character it forces only in part."""
        return self._m.compute_ff_bytes().decode("utf-8", "ignore")

    def is_completed(self) -> bool:
        """Whether the grammar may end here (a stop token is allowed)."""
        return self._m.is_accepting()

    def is_terminated(self) -> bool:
        """Whether the grammar took its stop token: nothing may follow. (Where the grammar
        cannot go on, as after a top-level string's closing quote, only a stop token may
        follow, and it has not ended yet.)"""
        return self._ended


def _bit(i: int) -> int:
    """Bit `i` of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
