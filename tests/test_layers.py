"""The import structure of paged_backend, read from the source with `ast` (nothing is imported).

Every import statement counts, wherever it stands: at module level, inside a function, under
`if TYPE_CHECKING:`. Python resolves only the module-level ones at import time, so a circle
through a function-level import still imports; but the two modules stay one knot for whoever
reads, tests or moves them, and a deferred import is exactly how issue #29's two circles hid
(config -> models.transformers_impl, attention -> torch_attention). Counting every statement
also makes the layer check mean "never depends on", not "never imports first".

Checked: (1) no import cycle among paged_backend modules; (2) a module imports only its own
layer or lower ones (`LAYERS`), and every module has a layer; (3) nothing in paged_backend
imports the integrations (LangChain, LlamaIndex).
"""

from __future__ import annotations

import ast
import functools
import tomllib
from collections.abc import Collection
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "paged_backend"

# Low to high: a module may import modules of its own layer and of lower ones. A name, relative
# to paged_backend, covers its submodules ("attention" is paged_backend.attention and
# paged_backend.attention.*); the longest name that matches decides; "__init__" is
# paged_backend itself.
LAYERS: dict[str, tuple[str, ...]] = {
    # What a request is, asks for and gets back; helpers everything uses.
    "core data": (
        *("errors", "outputs", "file_cache", "metrics", "block_pool", "request"),
        *("sampling_params", "grammar_matcher", "json_bounds", "structural_tags"),
        *("completion", "structured_output", "tool_calling"),
        *("chat_template", "chat_formats", "tokenizer", "detokenizer", "prompt_dicts"),
    ),
    # Compute: the C library, its ops and linears (cpu/), every attention path (attention/).
    # They read block tables, nothing above.
    "kernels": ("cpu", "attention"),
    "kv cache": ("kv_cache_manager",),
    # The scheduler, with what decides drafts: who drafts, what, and what of it is kept.
    "scheduler": ("scheduler", "ngram_proposer", "spec_decode"),
    # The engine's and the model's configuration, the model's modules and weights, sampling.
    "model": (
        *("config", "models", "default_model", "model_loader", "gguf", "int4_checkpoint"),
        "sampler",
    ),
    "runner": ("model_runner",),
    "engine": ("engine",),
    "frontends": ("engine_client", "async_engine", "llm"),
    "scale-out": ("distributed", "shared_engines"),
    "entry points": ("adapters", "cli", "__init__"),
}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def module_files() -> dict[str, Path]:
    """Every module of paged_backend (all of it lives under paged_backend/) and its file."""
    files = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = path.relative_to(ROOT / PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join((PACKAGE, *parts))] = path
    return files


def imported_names(module: str, path: Path) -> set[str]:
    """The absolute dotted names every import statement of the file binds: `from a import b`
    gives `a.b`, whether b is a submodule or a name defined in a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: one dot is the package itself, each more goes up one
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def owner(name: str, modules: Collection[str]) -> str | None:
    """The module a dotted name lives in (its longest prefix that is a module), or None for a
    name outside `modules`."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """Each paged_backend module -> the paged_backend modules it imports."""
    files = module_files()
    return {
        module: frozenset(
            target
            for name in imported_names(module, path)
            if (target := owner(name, files)) not in (None, module)
        )
        for module, path in files.items()
    }


def layer_of(module: str) -> str | None:
    relative = module.removeprefix(PACKAGE).removeprefix(".") or "__init__"
    matches = [
        (len(name), layer)
        for layer, names in LAYERS.items()
        for name in names
        if relative == name or relative.startswith(name + ".")
    ]
    return max(matches)[1] if matches else None


def test_imports_are_read_wherever_they_stand(tmp_path):
    """Module level, in a function, under TYPE_CHECKING, relative: all count."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "import os.path\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .sub.leaf import name\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.typed import T\n"
        "def f():\n"
        "    from pkg import lazy\n"
    )
    assert imported_names("pkg.mod", package / "mod.py") == {
        *("os.path", "typing.TYPE_CHECKING", "pkg.sibling", "pkg.sub.leaf.name"),
        *("pkg.typed.T", "pkg.lazy"),
    }
    modules = {"pkg", "pkg.sub", "pkg.sub.leaf", "pkg.lazy"}
    assert owner("pkg.sub.leaf.name", modules) == "pkg.sub.leaf"
    assert owner("pkg.lazy", modules) == "pkg.lazy"
    assert owner("pkg.typed.T", modules) == "pkg"
    assert owner("os.path", modules) is None


def test_every_module_has_a_layer():
    graph = import_graph()
    assert {"paged_backend", "paged_backend.engine", "paged_backend.scheduler"} <= graph.keys()
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"add these modules to a layer of LAYERS: {unplaced}"


def test_no_import_cycles():
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as error:
        pytest.fail(f"import cycle: {' -> '.join(reversed(error.args[1]))}")


def test_no_module_imports_a_higher_layer():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if None not in (layer_of(module), layer_of(target))
        and rank[layer_of(module)] < rank[layer_of(target)]
    ]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_paged_backend_never_imports_the_integrations():
    integrations = [p for p in _setuptools()["packages"] if not p.startswith(PACKAGE)]
    assert integrations, "pyproject lists no integration packages"
    found = sorted(
        f"{module} imports {name}"
        for module, path in module_files().items()
        for name in imported_names(module, path)
        if owner(name, integrations)
    )
    assert not found, found
