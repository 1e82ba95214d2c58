"""The engine's tokenizer: encoding, decoding and the EOS id, all that requests and steps need,
without importing transformers (1-2 s of a start); the model's transformers tokenizer is loaded
when anything else is asked of it (a chat template, `LLM.get_tokenizer()`).

They run on the `tokenizers` model that transformers' tokenizer wraps, in the state it sets up
(added tokens, post-processor), saved in the cache at the first start and checked by its digest
when read. That gives transformers' ids and text exactly where its tokenizer hands encoding and
decoding straight to that model: a `TokenizersBackend` (or a subclass that keeps its encode and
decode) that does not clean up spaces. Any other tokenizer is transformers' for everything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from pathlib import Path

import tokenizers

from paged_backend.chat_formats import load_tokenizer
from paged_backend.file_cache import cache_dir, read_checked, write_checked

_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")
_PASSED_THROUGH = ("__call__", "encode", "decode", "_encode_plus", "_decode")
_FORMAT = 1  # of the cache entries: a new format makes new keys


class Tokenizer:
    """`encode`, `decode` and `eos_token_id` as transformers' tokenizer of the model in `path`
    gives them; every other attribute, and a call, is that tokenizer's (`hf`), loaded at first
    use. Thread-safe."""

    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        self.path = path
        self._chat_template = chat_template
        self._hf = None
        self._lock = threading.Lock()
        entry = cache_dir() / "tokenizers" / f"{_key(path)}.json"
        loaded = _load(entry)
        if loaded is None:
            state = _fast_state(self.hf)
            if state is not None:
                write_checked(entry, json.dumps(state).encode())
                loaded = _backend(state), state["eos_token_id"]
        self._backend, self.eos_token_id = loaded or (None, self.hf.eos_token_id)

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
    origin = importlib.util.find_spec("transformers").origin
    stamp = f"{_FORMAT} {tokenizers.__version__} {origin} {Path(origin).stat().st_mtime_ns}"
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
    }


def _load(entry: Path) -> tuple[tokenizers.Tokenizer, int | None] | None:
    """The `tokenizers` model and EOS id saved in `entry`; None where it is missing, fails its
    digest or does not load (the caller rebuilds it)."""
    data = read_checked(entry)
    if data is None:
        return None
    try:
        state = json.loads(data)
        return _backend(state), state["eos_token_id"]
    except Exception:  # tokenizers raises plain Exception; a bad entry is rebuilt, never trusted
        return None


def _backend(state: dict) -> tokenizers.Tokenizer:
    """The `tokenizers` model as transformers' tokenizer runs it for a plain encode: no
    truncation, no padding, special tokens split as it says."""
    backend = tokenizers.Tokenizer.from_str(state["model"])
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = state["split_special_tokens"]
    return backend
