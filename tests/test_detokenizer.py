"""IncrementalDetokenizer with the real (byte-level BPE) tokenizer: streamed deltas, multi-byte
characters split over tokens, stop strings and special tokens."""

from __future__ import annotations

import pytest

from paged_backend.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Café crème, naïve façade, jalapeño, Ångström, Straße.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 plus a flag 🇫🇷!",
    "def f(x):\n    return {'a': x ** 2}  # square\n\n\tprint(f(3))\n",
    "   leading spaces,\t\ttabs,\n\n\nnewlines   and trailing   ",
    "Mixed: Ωmega → ∑ ≤ ∞, русский текст, العربية, हिन्दी.",
]
PROMPT = "Text: "


@pytest.fixture(scope="module")
def tok(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def byte_token(tok) -> dict[int, int]:
    """Byte value -> id of the single-byte token (byte-level BPE's fallback alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    ids = {b: tok.convert_tokens_to_ids(c) for b, c in chars.items()}
    return {b: i for b, i in ids.items() if i is not None and i != tok.unk_token_id}


def stream(tok, prompt: str, ids: list[int], **kwargs):
    """Feed `ids` one at a time as the engine does; returns the detokenizer, the delta after
    every token, and the stop string matched (the stream ends there)."""
    detok = IncrementalDetokenizer(tok, tok(prompt).input_ids, **kwargs)
    deltas, matched = [], None
    for i, token in enumerate(ids):
        matched = detok.add_token(token)
        deltas.append(detok.delta(finished=matched is not None or i == len(ids) - 1))
        if matched is not None:
            break
    return detok, deltas, matched


def assert_no_lag(tok, ids, deltas):
    """Whenever the tokens so far decode to whole characters, all of that text is out."""
    emitted = ""
    for i, delta in enumerate(deltas):
        emitted += delta
        so_far = tok.decode(ids[: i + 1])
        if not so_far.endswith("\ufffd"):
            assert emitted == so_far, i


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_the_decoded_text(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    detok, deltas, _ = stream(tok, PROMPT, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert_no_lag(tok, ids, deltas)


def test_text_split_into_single_byte_tokens(tok, byte_token):
    """Byte fallback: every UTF-8 byte its own token, so 2-, 3- and 4-byte characters arrive in
    pieces; nothing is shown until a character is complete, then it is shown at once."""
    text = "é 日本 😀 👨‍👩‍👧 ñ!"
    ids = [byte_token[b] for b in text.encode()]
    assert len(ids) > len(text)
    _, deltas, _ = stream(tok, PROMPT, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text
    assert_no_lag(tok, ids, deltas)


def test_invalid_utf8_does_not_stall_the_stream(tok, byte_token):
    """A stray continuation byte is not the start of a character: text after it flows on."""
    ids = [byte_token[0x80], *tok(" and then text", add_special_tokens=False).input_ids]
    _, deltas, _ = stream(tok, PROMPT, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-2].endswith("then")  # not held until the end


def test_unfinished_character_at_the_end_is_dropped(tok, byte_token):
    ids = [
        *tok("ab", add_special_tokens=False).input_ids,
        *(byte_token[b] for b in "😀".encode()[:2]),
    ]
    _, deltas, _ = stream(tok, PROMPT, ids)
    assert "".join(deltas) == "ab"


STOP_TEXT = "The answer is 42, and the question is still unknown."


def reference_held(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "stops",
    [
        ["answer is 4"],  # spans several tokens
        ["s 42, an"],  # starts and ends inside tokens
        ["question", "42"],  # the earlier one in the text wins
        ["tion", "ques"],  # both completed by one token: the earlier in the text wins
        ["still unknown."],  # completed by the last token
        ["The"],  # completed by the first token
        ["is 43", "is s"],  # prefixes seen and held, never completed
    ],
)
def test_stop_strings(tok, stops, include):
    ids = tok(STOP_TEXT, add_special_tokens=False).input_ids
    found = [(STOP_TEXT.find(s), s) for s in stops if s in STOP_TEXT]
    idx, stop = min(found) if found else (len(STOP_TEXT), None)
    expected = STOP_TEXT[: idx + len(stop)] if include and stop else STOP_TEXT[:idx]
    detok = IncrementalDetokenizer(
        tok, tok(PROMPT).input_ids, stop=stops, include_stop_str_in_output=include
    )
    emitted, matched, num_fed = "", None, 0
    for token in ids:
        num_fed += 1
        matched = detok.add_token(token)
        done = matched is not None or num_fed == len(ids)
        emitted += detok.delta(finished=done)
        if done:
            break
        # Streaming shows everything but a tail that could still grow into a stop string.
        assert emitted == detok.text[: len(detok.text) - reference_held(detok.text, stops)]
        assert expected.startswith(emitted)
    assert matched == stop
    assert emitted == detok.text == expected
    if stop is not None:  # the stream ends with the very token that completes the stop string
        assert stop in tok.decode(ids[:num_fed]) and stop not in tok.decode(ids[: num_fed - 1])


def test_stop_strings_count_only_in_generated_text(tok):
    """The prompt's tail is decoded for context but never matched against stop strings."""
    ids = tok(" 42 and more", add_special_tokens=False).input_ids
    _, deltas, matched = stream(tok, "The answer is", ids, stop=["is 42"])
    assert matched is None
    assert "".join(deltas) == " 42 and more"


def test_stop_strings_are_not_checked_while_check_stop_is_false(tok):
    """The engine passes check_stop=False before min_tokens: an earlier occurrence is ignored,
    a later one ends the text."""
    first = tok("x ab", add_special_tokens=False).input_ids
    second = tok(" ab c", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, tok(PROMPT).input_ids, stop=["ab"])
    assert all(detok.add_token(t, check_stop=False) is None for t in first)
    assert detok.text == "x ab"
    assert detok.add_token(second[0]) == "ab"
    assert detok.text == "x ab "


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [
        *tok("Hello", add_special_tokens=False).input_ids,
        im_end,
        *tok(" world", add_special_tokens=False).input_ids,
    ]
    _, deltas, _ = stream(tok, PROMPT, ids, skip_special_tokens=skip)
    assert "".join(deltas) == ("Hello world" if skip else "Hello<|im_end|> world")
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    # As a stop string, a special token's text only exists when it is not skipped.
    _, deltas, matched = stream(tok, PROMPT, ids, skip_special_tokens=skip, stop=["<|im_end|>"])
    assert matched == (None if skip else "<|im_end|>")
    assert "".join(deltas) == ("Hello world" if skip else "Hello")
