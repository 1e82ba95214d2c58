"""The README's commands, read from README.md itself so CI can never drift from it.

    python .ci/readme.py setup      # the set-up command(s), one per line
    python .ci/readme.py test       # the test command
    python .ci/readme.py examples   # run every command of the "Run it" block, each with a time
                                    # limit and a check of what it printed

Also imported by tests/test_readme.py for the Python code blocks and the links of README.md and
every docs/*.md page.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# What each advertised command must print (a regex over its stdout): an example that runs but
# shows nothing useful fails too. Every command in the "Run it" block needs an entry here.
EXPECTED = {
    "paged-backend generate": r"\w{3}",
    "paged-backend chat": r"\w{3}",
    # The RAG examples: the retrieved context, then the answer, then the prefix cache's share.
    "python examples/langchain_rag.py": r"\[context\] \S(.|\n)*A: \S(.|\n)*\[asked again\] "
    r"[1-9]\d* of \d+ prompt tokens came from the prefix cache",
    "python examples/llamaindex_rag.py": r"\[context\] \w+ \(\d\.\d\d\): \S(.|\n)*A: \S(.|\n)*"
    r"prefix-cache hit rate [1-9]\d*%",
    "python examples/tool_calling.py": r"call get_weather\(\{'city': 'Oslo'\}\) -> Oslo: light "
    r"snow(.|\n)*call add\(\{'a': 17, 'b': 25\}\) -> 42",
    "python examples/benchmark.py": r"\[rag\]\s+ours .* tok/s(.|\n)*ours \d+\.\dx",
    "python examples/stress.py": r"stress: (\d+) of \1 scenarios ok",
}
TIME_LIMIT_S = 600


def section(title: str) -> str:
    """The text under the `## title` heading, up to the next `## ` heading."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if match is None:
        raise SystemExit(f"README.md has no '## {title}' section")
    return match.group(1)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def commands(title: str) -> list[str]:
    """The lines of the first bash block of a section (comments after `  #` dropped)."""
    block = code_blocks(section(title), "bash")[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def setup_commands() -> list[str]:
    return commands("Set up and test")[:-1]


def test_command() -> str:
    return commands("Set up and test")[-1]


def pages() -> list[Path]:
    """The documentation whose code blocks and links are tested: the README, then docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


def python_blocks() -> dict[str, str]:
    """Every distinct Python block of the pages, by a name such as `docs/api.md-1` (its page and
    index). A block shown on two pages (the README's LangChain snippet, again on
    docs/langchain.md) is named after its first page and runs once."""
    blocks: dict[str, str] = {}
    for page in pages():
        for i, block in enumerate(code_blocks(page.read_text(), "python")):
            blocks.setdefault(block, f"{page.relative_to(ROOT)}-{i}")
    return {name: block for block, name in blocks.items()}


def prose(page: Path) -> str:
    """The page without its code blocks, where `](` and `# ` are code, not links and headings."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)


def links(page: Path) -> list[str]:
    """The page's relative Markdown links (`docs/api.md`, `../README.md#layout`); web addresses
    are left out."""
    found = re.findall(r"\]\(([^)\s]+)\)", prose(page))
    return [link for link in found if not re.match(r"\w+:", link)]


def anchors(page: Path) -> set[str]:
    """The `#anchor` of each heading of the page, spelt as GitHub makes it: lower case, spaces to
    hyphens, punctuation but hyphens and underscores dropped."""
    titles = re.findall(r"^#+ (.+?)\s*$", prose(page), re.M)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file, or heading within it, does not exist."""
    broken = []
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.is_file() or (anchor and anchor not in anchors(target)):
            broken.append(link)
    return broken


def run_examples() -> int:
    failed = 0
    examples = commands("Run it")
    for command in examples:
        pattern = next((v for k, v in EXPECTED.items() if command.startswith(k)), None)
        start = time.monotonic()
        print(f"$ {command}", flush=True)
        if pattern is None:
            print(f"FAILED: no expected output is written down for {command!r} in {__file__}")
            failed += 1
            continue
        try:
            done = subprocess.run(
                command, shell=True, capture_output=True, text=True, timeout=TIME_LIMIT_S
            )
        except subprocess.TimeoutExpired:
            print(f"FAILED: still running after {TIME_LIMIT_S} s")
            failed += 1
            continue
        print(done.stdout[-3000:], flush=True)
        ok = done.returncode == 0 and re.search(pattern, done.stdout)
        took = time.monotonic() - start
        if ok:
            print(f"ok ({took:.0f} s)\n")
        else:
            print(done.stderr[-3000:])
            print(f"FAILED ({took:.0f} s): exit {done.returncode}, expected output /{pattern}/\n")
            failed += 1
    print(f"README examples: {len(examples) - failed} of {len(examples)} ran as advertised")
    return 1 if failed else 0


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "setup":
        print("\n".join(setup_commands()))
    elif what == "test":
        print(test_command())
    elif what == "examples":
        raise SystemExit(run_examples())
    else:
        raise SystemExit(__doc__)
