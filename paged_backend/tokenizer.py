"""The engine's tokenizer: encoding, decoding, the EOS id and chat rendering, all that requests
and steps need, without transformers' tokenizer (1-2 s of a start, 120-140 MB more for a chat);
that tokenizer is loaded when anything else is asked of it (`LLM.get_tokenizer()`, tokens from
a chat template).

They run on the `tokenizers` model that transformers' tokenizer wraps, in the state it sets up
(added tokens, post-processor), with its chat template and special tokens, saved in the cache
at the first start and checked by its digest when read. That gives transformers' ids and text
exactly where its tokenizer hands encoding and decoding straight to that model: a
`TokenizersBackend` (or a subclass that keeps its encode and decode) that does not clean up
spaces. Any other tokenizer is transformers' for everything.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import tokenizers

from paged_backend.chat_formats import load_tokenizer
from paged_backend.chat_template import render_chat
from paged_backend.file_cache import cache_dir, installed_stamp, read_checked, write_checked

_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")
_PASSED_THROUGH = ("__call__", "encode", "decode", "_encode_plus", "_decode")
_FORMAT = 2  # of the cache entries: a new format makes new keys


class Tokenizer:
    """`encode`, `decode`, `eos_token_id` and a chat's text as transformers' tokenizer of the
    model in `path` gives them; every other attribute, and a call, is that tokenizer's (`hf`),
    loaded at first use. Thread-safe."""

    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        self.path = path
        self._chat_template = chat_template
        self._hf = None
        self._lock = threading.Lock()
        entry = cache_dir() / "tokenizers" / f"{_key(path)}.json"
        state, self._backend = _load(entry)
        if state is None:
            hf = load_tokenizer(path)  # with the model's own template, which the state keeps
            state = _fast_state(hf)
            if state is not None:
                write_checked(entry, json.dumps(state).encode())
                self._backend = _backend(state)
            if state is None and chat_template is None:  # it runs every encode and decode
                self._hf = hf
            eos = hf.eos_token_id
        self.eos_token_id = state["eos_token_id"] if state else eos
        self._chat = (state["chat_template"], state["special_tokens"]) if state else None

    @property
    def hf(self):
        """The model's transformers tokenizer with its chat template (`load_tokenizer`)."""
        with self._lock:
            if self._hf is None:
                self._hf = load_tokenizer(self.path, self._chat_template)
            return self._hf

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer | None:
        """The `tokenizers` model that encodes and decodes (None for a slow tokenizer), without
        loading transformers where the cache has it."""
        if self._backend is not None:
            return self._backend
        return getattr(self.hf, "backend_tokenizer", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # verbose=False: past model_max_length transformers would warn of "indexing errors"; the
        # engine's limit is max_model_len, which `LLMEngine.validate` checks.
        return self.hf.encode(text, add_special_tokens=add_special_tokens, verbose=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | dict | None:
        """The template chats render with: the engine's `chat_template`, else the model's own,
        else its family's (`load_tokenizer`)."""
        if self._chat_template is not None:
            return self._chat_template
        return self._chat[0] if self._chat is not None else self.hf.chat_template

    @property
    def name_or_path(self) -> str:
        return str(self.path)

    def apply_chat_template(self, messages: list[dict], **kwargs):
        """transformers' `apply_chat_template`, rendered from the template and special tokens in
        the cache where that gives its text (`render_chat`): loading transformers' tokenizer
        for a chat took 0.7-2.4 s and 120-140 MB more resident memory (a second copy of the
        vocabulary)."""
        if self._chat is not None:
            text = render_chat(self.chat_template, self._chat[1], messages, **kwargs)
            if text is not None:
                return text
        return self.hf.apply_chat_template(messages, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not set yet (in __init__, or a copy): never transformers'
            raise AttributeError(name)
        return getattr(self.hf, name)


def _key(path: Path) -> str:
    """What transformers' tokenizer depends on: the model directory's files but its weights
    (the tokenizer's files, config.json, which names the class), and the installed transformers
    and tokenizers."""
    stamp = f"{_FORMAT} {tokenizers.__version__} {installed_stamp('transformers')}"
    digest = hashlib.sha256(stamp.encode())
    for file in sorted(path.iterdir()):
        if file.is_file() and not file.name.endswith(_WEIGHTS):
            digest.update(f"{file.name} {hashlib.sha256(file.read_bytes()).hexdigest()}".encode())
    return digest.hexdigest()[:32]


def _fast_state(hf) -> dict | None:
    """What `Tokenizer` needs to encode and decode as `hf` does without it; None where `hf` does
    more than hand them to its `tokenizers` model (see the module docstring)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(hf)
    if not isinstance(hf, TokenizersBackend) or hf.clean_up_tokenization_spaces:
        return None
    if any(getattr(kind, m) is not getattr(TokenizersBackend, m) for m in _PASSED_THROUGH):
        return None
    return {
        "model": hf.backend_tokenizer.to_str(),
        "split_special_tokens": bool(hf.split_special_tokens),
        "eos_token_id": hf.eos_token_id,
        "chat_template": hf.chat_template,
        "special_tokens": dict(hf.special_tokens_map),
    }


def _load(entry: Path) -> tuple[dict, tokenizers.Tokenizer] | tuple[None, None]:
    """The state saved in `entry` and its `tokenizers` model; Nones where it is missing, fails
    its digest or does not load (the caller rebuilds it)."""
    data = read_checked(entry)
    if data is None:
        return None, None
    try:
        state = json.loads(data)
        return state, _backend(state)
    except Exception:  # tokenizers raises plain Exception; a bad entry is rebuilt, never trusted
        return None, None


def _backend(state: dict) -> tokenizers.Tokenizer:
    """The `tokenizers` model as transformers' tokenizer runs it for a plain encode: no
    truncation, no padding, special tokens split as it says."""
    backend = tokenizers.Tokenizer.from_str(state["model"])
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = state["split_special_tokens"]
    return backend
