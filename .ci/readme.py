"""The README's commands, read from README.md itself so CI can never drift from it.

    python .ci/readme.py setup      # the set-up command(s), one per line
    python .ci/readme.py test       # the test command
    python .ci/readme.py examples   # run every command of the "Run it" block, each with a time
                                    # limit and a check of what it printed

Also imported by tests/test_readme.py for the README's Python code blocks.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
# What each advertised command must print (a regex over its stdout): an example that runs but
# shows nothing useful fails too. Every command in the "Run it" block needs an entry here.
EXPECTED = {
    "paged-backend generate": r"\w{3}",
    "paged-backend chat": r"\w{3}",
    "python examples/langchain_rag.py": r"\[asked again\] [1-9]\d* of \d+ prompt tokens came "
    r"from the prefix cache",
    "python examples/llamaindex_rag.py": r"prefix-cache hit rate [1-9]\d*%",
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


def python_blocks() -> list[str]:
    return code_blocks(README.read_text(), "python")


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
