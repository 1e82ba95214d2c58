"""Structured output: every constrained output parses and validates, greedy and sampled, on the
real model; unconstrained requests in the same batch are untouched; bad specs fail at submission;
preemption, n > 1, stop tokens and a vocabulary wider than the tokenizer's on tiny models."""

from __future__ import annotations

import json
import re
import sys
import threading
from types import SimpleNamespace
from typing import Annotated, Literal

import pytest
import tokenizers
from conftest import make_tiny_model
from pydantic import BaseModel, ConfigDict, Field

from paged_backend import LLM, AsyncEngine, SamplingParams, StructuredOutputsParams
from paged_backend.grammar_matcher import GrammarTokenizer, _token_bytes
from paged_backend.json_bounds import MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS, MAX_WHITESPACE_RUN
from paged_backend.structured_output import GrammarCache, apply_grammar_bitmask
from paged_backend.tokenizer import Tokenizer

try:
    import jsonschema
except ImportError:  # pydantic's strict validation below still checks every output
    jsonschema = None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Address(Strict):
    city: str = Field(max_length=20)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(Strict):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    nickname: str | None = Field(default=None, max_length=12)
    tags: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)


class Item(Strict):
    name: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=10)


class Order(Strict):
    items: list[Item] = Field(min_length=1, max_length=3)
    priority: Literal["low", "normal", "high"]


class Code(Strict):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    valid: bool


DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
NUMBER_LIST = 'root ::= "[" num ("," num)? ("," num)? "]"\nnum ::= [0-9] | [1-9] [0-9]'


def _model_check(model: type[BaseModel]):
    def check(text: str) -> None:
        model.model_validate_json(text)
        if jsonschema is not None:
            jsonschema.validate(json.loads(text), model.model_json_schema())

    return check


def _compact_check(model: type[BaseModel]):
    def check(text: str) -> None:
        assert "\n" not in text, text
        _model_check(model)(text)

    return check


def _object_check(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def _regex_check(pattern: str):
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


# name -> (question, structured output spec, check of the text)
CASES = {
    "person_dict": (
        "Describe a person as JSON.",
        StructuredOutputsParams(json=Person.model_json_schema()),
        _model_check(Person),
    ),
    "order_pydantic": (
        "Write a small shopping order as JSON.",
        StructuredOutputsParams(json=Order),
        _model_check(Order),
    ),
    "code_string": (
        "Give a product code as JSON.",
        StructuredOutputsParams(json=json.dumps(Code.model_json_schema())),
        _model_check(Code),
    ),
    "order_compact": (
        "Write a small shopping order as JSON.",
        StructuredOutputsParams(json=Order, disable_any_whitespace=True),
        _compact_check(Order),
    ),
    "json_object": (
        "Return a JSON object with the keys name and age.",
        StructuredOutputsParams(json_object=True),
        _object_check,
    ),
    "date": (
        "When did the first person land on the moon?",
        StructuredOutputsParams(regex=DATE),
        _regex_check(DATE),
    ),
    "phone": (
        "Give me a phone number for a pizza shop.",
        StructuredOutputsParams(regex=PHONE),
        _regex_check(PHONE),
    ),
    "choice": (
        "Sentiment of: 'I loved this film!'",
        StructuredOutputsParams(choice=CHOICES),
        lambda text: text in CHOICES,
    ),
    "grammar": (
        "List a few small numbers.",
        StructuredOutputsParams(grammar=NUMBER_LIST),
        _regex_check(r"\[\d{1,2}(,\d{1,2}){0,2}\]"),
    ),
}
PLAIN = ["Tell me about the sea.", "Why is the sky blue?"]


def chat(llm: LLM, question: str) -> str:
    return llm.engine.apply_chat_template([{"role": "user", "content": question}])


@pytest.fixture(scope="module")
def batch(llm_fp32):
    """One continuous batch: every case greedy and sampled, an n=3 request, and two
    unconstrained requests. Returns {label: RequestOutput}."""
    labels, prompts, params = [], [], []
    for name, (question, spec, _) in CASES.items():
        for mode, extra in (
            ("greedy", dict(temperature=0)),
            ("sampled", dict(temperature=0.8, seed=7)),
        ):
            labels.append((name, mode))
            prompts.append(chat(llm_fp32, question))
            params.append(SamplingParams(max_tokens=200, structured_outputs=spec, **extra))
    labels.append(("person_n3", "sampled"))
    prompts.append(chat(llm_fp32, CASES["person_dict"][0]))
    params.append(
        SamplingParams(
            n=3, temperature=1.0, seed=1, max_tokens=200, structured_outputs=CASES["person_dict"][1]
        )
    )
    for i, question in enumerate(PLAIN):
        labels.append(("plain", i))
        prompts.append(chat(llm_fp32, question))
        params.append(PLAIN_PARAMS[i])
    outs = llm_fp32.generate(prompts, params, use_tqdm=False)
    return dict(zip(labels, outs, strict=True))


PLAIN_PARAMS = [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0.9, seed=3, max_tokens=24),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("name", list(CASES))
def test_outputs_follow_their_spec(batch, name, mode):
    completion = batch[(name, mode)].outputs[0]
    assert completion.finish_reason == "stop", completion.text
    CASES[name][2](completion.text)


@pytest.mark.slow
def test_each_of_n_sequences_follows_the_schema(batch):
    completions = batch[("person_n3", "sampled")].outputs
    assert len(completions) == 3
    for c in completions:
        assert c.finish_reason == "stop", c.text
        Person.model_validate_json(c.text)
    assert len({c.text for c in completions}) > 1


@pytest.mark.slow
def test_unconstrained_requests_are_untouched(batch, llm_fp32):
    alone = llm_fp32.generate([chat(llm_fp32, q) for q in PLAIN], PLAIN_PARAMS, use_tqdm=False)
    for i, out in enumerate(alone):
        assert batch[("plain", i)].outputs[0].token_ids == out.outputs[0].token_ids
    stats = llm_fp32.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
        (dict(json={"$ref": "#/$defs/Missing"}), "json"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= undefined_rule"), "grammar"),
        (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "struct"),
        (dict(structural_tag="{not json"), "structural_tag"),
    ],
)
def test_invalid_specs_fail_at_submission(llm_fp32, spec, field):
    good = SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=rf"invalid structured_outputs\.{field}"):
        llm_fp32.generate(["Yes or no?", "Really?"], [good, bad], use_tqdm=False)
    engine = llm_fp32.engine
    assert not engine.parents and not engine.has_unfinished_requests()
    out = llm_fp32.generate(["Yes or no?"], good, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")


LOOPING = {  # greedy SmolLM2 repeats itself inside "story" for as long as it may
    "type": "object",
    "properties": {
        "story": {"type": "string"},
        "moral": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["story", "moral", "tags", "rating"],
}


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [48, 80])
def test_the_budget_guard_closes_json_before_max_tokens(llm_fp32, max_tokens):
    """Without the budget guard these are cut off inside "story"; with it, every one parses
    and validates, and the greedy one, which loops, uses its whole budget."""
    spec = StructuredOutputsParams(json=LOOPING, disable_any_whitespace=True)
    prompts = [chat(llm_fp32, q) for q in ("Tell me a very long story.", "Write a poem.")]
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec),
        SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, structured_outputs=spec),
    ]
    greedy, sampled = (o.outputs[0] for o in llm_fp32.generate(prompts, params, use_tqdm=False))
    assert len(greedy.token_ids) == max_tokens and len(sampled.token_ids) <= max_tokens
    for completion in (greedy, sampled):
        jsonschema.validate(json.loads(completion.text), LOOPING)


def test_forced_text_goes_in_the_tokenizers_own_tokens(llm_fp32):
    """Required keys are forced by the grammar; they come out as the tokenizer writes them
    (`{"`, `story`, `":`), not spelled in fragments."""
    spec = StructuredOutputsParams(json=LOOPING, disable_any_whitespace=True)
    out = llm_fp32.generate(
        [chat(llm_fp32, "Tell me a story.")],
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec),
        use_tqdm=False,
    )[0].outputs[0]
    tokenizer = llm_fp32.engine.tokenizer
    assert out.token_ids[:3] == tokenizer.encode('{"story":', add_special_tokens=False)


# ---- parameters ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"regex": "a+", "choice": ["a"]}, "exactly one"),
        ({"json": 5}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": {"type": "object", "default": {1, 2}}}, "structured_outputs.json"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": "abc"}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"grammar": 3}, "structured_outputs.grammar"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"})


def test_equal_specs_share_one_compilation(default_model_path):
    cache = GrammarCache(Tokenizer(default_model_path), 49152, [2])
    schema = Person.model_json_schema()
    specs = [
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(json=json.dumps(schema, indent=2)),
        StructuredOutputsParams(json=Person),
    ]
    results: list = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(cache.compile(s))) for s in specs * 4
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12
    assert len({id(cache.compile(s)) for s in specs}) == 1
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert cache.compile(compact) is not cache.compile(specs[0])


def _sentencepiece_like() -> tokenizers.Tokenizer:
    """A byte-fallback BPE behind a Metaspace pre-tokenizer (Llama-2's and Gemma's kind),
    trained here on a few sentences."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog. Zoë's café."] * 4, trainer
    )
    return tok


def _unigram() -> tokenizers.Tokenizer:
    """A Unigram model (T5's kind) behind a byte-fallback decoder."""
    from tokenizers import decoders, models, pre_tokenizers

    pieces = [("<unk>", 0.0), ("\u2581a", -1.0), ("b", -2.0), ("\u2581", -3.0)]
    tok = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def _llama2_like() -> tokenizers.Tokenizer:
    """`_sentencepiece_like` with Llama 2's decoder: `▁` replaced by a space, bytes, a stripped
    first space."""
    from tokenizers import decoders

    tok = _sentencepiece_like()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


# Added tokens of every kind llguidance tells apart: special, non-special read as `<...>`,
# text with and without characters outside the byte-level alphabet, a byte token's name.
_ADDED = [
    "<tool>",
    "</tool_call>",
    "<a b>",
    "hello world",
    "café",
    "ĠaĠb",
    "Ġa b",
    "x<y>",
    "<0x41>",
]


def _with_added(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    tok.add_tokens([tokenizers.AddedToken(name, special=False) for name in _ADDED])
    tok.add_tokens([tokenizers.AddedToken("\u2581hi", special=False)])
    tok.add_special_tokens(["<|mine|>"])
    return tok


@pytest.mark.parametrize(
    "kind",
    ["default", "default+added", "sentencepiece-like", "unigram", "llama2-like", "llama2+added"],
)
def test_token_bytes_read_in_python_are_llguidances(kind, default_model_path):
    """`_token_bytes` reads each token's bytes and the special ids in Python (llguidance's read
    of the JSON held the GIL ~0.2 s): the same as llguidance reads from the whole JSON."""
    llguidance = pytest.importorskip("llguidance")

    def default():
        return tokenizers.Tokenizer.from_str(
            Tokenizer(default_model_path).backend_tokenizer.to_str()
        )

    tok = {
        "default": default,
        "default+added": lambda: _with_added(default()),
        "sentencepiece-like": _sentencepiece_like,
        "unigram": _unigram,
        "llama2-like": _llama2_like,
        "llama2+added": lambda: _with_added(_llama2_like()),
    }[kind]()
    tokens, specials = _token_bytes(tok)
    spelling = llguidance.LLTokenizer(tok.to_str(), slices=[])
    assert len(tokens) == spelling.vocab_size == tok.get_vocab_size()
    assert tokens == [spelling.decode_bytes([t]) for t in range(len(tokens))]
    assert specials == [t for t in range(len(tokens)) if spelling.is_special_token(t)]
    if kind.endswith("added"):
        assert len(specials) >= 4  # the special token and three read as `<...>`


def test_a_tokenizer_llguidance_cannot_read_is_refused_by_its_decoder():
    from tokenizers import decoders

    tok = _sentencepiece_like()
    tok.decoder = decoders.Metaspace()  # llguidance itself refuses it
    assert _token_bytes(tok) is None
    pytest.importorskip("llguidance")
    grammar_tokenizer = GrammarTokenizer(SimpleNamespace(backend_tokenizer=tok), 400, [2])
    with pytest.raises(ValueError, match=r"byte-level or byte-fallback.*decoder is Metaspace"):
        grammar_tokenizer.ll  # noqa: B018 (builds the tables)


def test_bitmask_bans_exactly_what_the_matcher_rejects_on_constrained_rows_only(
    default_model_path,
):
    import torch

    vocab = 49280  # wider than the tokenizer: the extra ids must be banned too
    cache = GrammarCache(Tokenizer(default_model_path), vocab, [2])
    matchers = [cache.matcher(StructuredOutputsParams(json=Person), []) for _ in range(3)]
    matchers[1].accept_string('{"name": "Al')  # inside a string: most tokens allowed
    matchers[2].accept_string('{"name": "Al", "age": 1')
    rows = [0, 2, 3]
    with torch.inference_mode():  # as the model runner's logits are
        logits = torch.randn(5, vocab)
    before = logits.clone()
    apply_grammar_bitmask(logits, rows, matchers)
    assert torch.equal(logits[[1, 4]], before[[1, 4]])
    for row, matcher in zip(rows, matchers, strict=True):
        kept = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert torch.equal(logits[row, kept], before[row, kept])
        assert 0 < len(kept) < 49152
        probe = [t for t in range(0, 49152, 97)] + kept[:50]  # a sample of both kinds
        for token in probe:
            assert matcher.fork().accept_token(token) == (token in kept), token
    assert torch.isinf(logits[rows][:, 49152:]).all()


# ---- tiny models: engine mechanics -----------------------------------------------------------
@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, default_model_path):
    """Logits wider than the tokenizer's vocabulary (49152), as padded vocabularies are."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-wide"), default_model_path, vocab_size=49280
    )


@pytest.fixture(scope="module")
def wide_llm(wide_model):
    return LLM(model=str(wide_model), dtype="float32", num_kv_blocks=256)


def test_ids_beyond_the_tokenizer_are_masked(wide_llm):
    bias = {49152 + i: 100.0 for i in range(0, 128, 7)}  # would win every step unmasked
    params = SamplingParams(
        temperature=0,
        max_tokens=32,
        logit_bias=bias,
        structured_outputs=StructuredOutputsParams(regex=DATE),
    )
    out = wide_llm.generate(["Today is"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch(DATE, out.text)
    assert max(out.token_ids) < 49152


def test_stop_token_ids_may_end_the_grammar(wide_llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=16,
        stop_token_ids=[13],
        logit_bias={13: 50.0},
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    out = wide_llm.generate(["Mood:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES
    assert (out.finish_reason, out.stop_reason) == ("stop", 13)


@pytest.mark.parametrize("extra", [dict(ignore_eos=True), dict(min_tokens=12)])
def test_grammar_end_stops_the_request(wide_llm, extra):
    """With EOS ignored or banned, the end of the grammar still ends the request."""
    params = SamplingParams(
        temperature=0,
        max_tokens=16,
        **extra,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    out = wide_llm.generate(["Mood:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text in CHOICES
    assert len(out.token_ids) < 12  # nothing after the grammar's end (at most its EOS)


def test_preemption_does_not_advance_the_grammar_twice(tiny_model):
    pattern = r"(\d{1,3},){15}\d{1,3}"
    prompts = [f"Numbers {i}: " + "one two three four five six seven " * (2 + i) for i in range(4)]
    params = SamplingParams(
        temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    roomy = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256)
    tight = LLM(model=str(tiny_model), dtype="float32", block_size=16, num_kv_blocks=14)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, b.outputs[0].text)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_async_engine_rejects_bad_specs_in_the_callers_thread(wide_model):
    engine = AsyncEngine.from_model(str(wide_model), dtype="float32", num_kv_blocks=64)
    try:
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))
        with pytest.raises(ValueError, match=r"invalid structured_outputs\.regex"):
            engine.generate_stream("Hi", bad)
        with pytest.raises(ValueError, match=r"invalid structured_outputs\.regex"):
            async for _ in engine.generate("Hi", bad):
                pass
        good = SamplingParams(
            temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=CHOICES)
        )
        async for out in engine.generate("Mood:", good):
            last = out
        assert last.outputs[0].text in CHOICES
    finally:
        engine.shutdown()


def test_without_llguidance_only_constrained_requests_fail(tiny_model, monkeypatch, one_thread):
    """llguidance is the `[structured]` extra: an engine without it serves plain requests and
    refuses a constrained one at submission, saying what to install."""
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now raises
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=16)
    plain = SamplingParams(temperature=0, max_tokens=4)
    assert len(llm.generate("Hello", plain, use_tqdm=False)[0].outputs[0].token_ids) == 4
    constrained = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with pytest.raises(ImportError, match=r"paged-backend\[structured\]"):
        llm.generate("Hello", constrained, use_tqdm=False)
    assert llm.engine.stats()["kv_blocks_free"] == llm.engine.stats()["kv_blocks_total"]


NUMBERS = {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}


@pytest.mark.parametrize(
    ("compact", "prefix", "run", "limit"),
    [
        (False, "[1.", "1", MAX_FRACTION_DIGITS),  # a fraction's digits
        (False, "[1", "2", MAX_INTEGER_DIGITS - 1),  # an integer part's digits after the first
        (False, "[-", "3", MAX_INTEGER_DIGITS),  # a negative number's
        (False, "[", " ", MAX_WHITESPACE_RUN),  # whitespace between two tokens
        (True, "[1, ", " ", 0),  # compact: the separator's one space, no more
    ],
)
def test_no_unbounded_run_inside_a_json_value(default_model_path, compact, prefix, run, limit):
    """The grammar itself ends a number or a whitespace run: a model looping on one cannot
    go on until max_tokens and leave JSON that does not parse."""
    cache = GrammarCache(Tokenizer(default_model_path), 49152, [2])
    spec = StructuredOutputsParams(json=NUMBERS, disable_any_whitespace=compact)
    matcher = cache.matcher(spec, [])
    assert matcher.accept_string(prefix + run * limit)
    assert not matcher.accept_string(run)


@pytest.mark.parametrize("value", ["éa", "ÿ0", "aéF", "ບb", "你好", "😀1"])
def test_non_ascii_literals_survive_the_grammar_rewrite(default_model_path, value):
    """A schema's non-ASCII enum allows exactly its own text, in a JSON schema and inside a tool
    call (xgrammar, the engine's grammar library before llguidance, printed "é" followed by a
    hex digit as `\\xe9a`, which it read back as one other character)."""
    from paged_backend.tool_calling import tool_call_constraint

    cache = GrammarCache(Tokenizer(default_model_path), 49152, [2])
    literal = json.dumps(value, ensure_ascii=False)
    parameters = {"type": "object", "properties": {"x": {"enum": [value]}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    cases = [
        (StructuredOutputsParams(json={"enum": [value]}), ""),
        (
            tool_call_constraint(tools, "required", False),
            '<tool_call>\n{"name": "f", "arguments": {"x": ',
        ),
    ]
    for spec, head in cases:
        assert cache.matcher(spec, []).accept_string(head + literal)
        shortest = cache.shortest_output(spec)
        assert shortest is not None and literal in shortest[1]


def test_no_unbounded_number_inside_a_tool_call(default_model_path):
    """Tool calls' arguments are JSON inside tags: their numbers are bounded the same way."""
    from paged_backend.tool_calling import tool_call_constraint

    cache = GrammarCache(Tokenizer(default_model_path), 49152, [2])
    parameters = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("auto", "required"):
        matcher = cache.matcher(tool_call_constraint(tools, choice, False), [])
        head = '<tool_call>\n{"name": "f", "arguments": {"x": 1'
        assert matcher.accept_string(head + "2" * (MAX_INTEGER_DIGITS - 1))
        assert not matcher.accept_string("2")
        assert matcher.accept_string("}}\n</tool_call>")


def test_a_model_pushed_to_loop_on_digits_still_ends_in_json(tiny_model, one_thread):
    llm = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=64)
    one = llm.get_tokenizer().convert_tokens_to_ids("1")
    params = SamplingParams(
        temperature=0,
        max_tokens=64,
        logit_bias={one: 100},  # the model wants nothing but "1"
        structured_outputs=StructuredOutputsParams(json=NUMBERS),
    )
    text = llm.generate("Numbers:", params, use_tqdm=False)[0].outputs[0].text
    values = json.loads(text)
    assert 1 <= len(values) <= 4
    assert all(len(part) <= MAX_INTEGER_DIGITS for part in re.findall(r"\d+", text))
