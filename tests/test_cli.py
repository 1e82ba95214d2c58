"""`paged-backend`: user mistakes are one `error:` line and exit code 2; sampling is random run
to run unless `--seed` is given; `--help` shows every flag's default."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import QUOTED

from paged_backend import cli
from paged_backend.cli import main, parse_speculative
from paged_backend.config import SpeculativeConfig
from paged_backend.engine import LLMEngine


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_missing_model_is_one_line(capsys, tmp_path):
    assert main(["generate", "Hi", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _one_error_line(capsys)


def test_bad_sampling_value_names_the_field(capsys):
    assert main(["generate", "Hi", "--temperature", "-1"]) == 2
    assert "temperature" in _one_error_line(capsys)


def test_unparsable_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hi", "--max-tokens", "many"])
    assert exit_info.value.code == 2
    assert "--max-tokens" in _one_error_line(capsys)


def test_debug_shows_the_exception(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["generate", "Hi", "--model", str(tmp_path / "nope"), "--debug"])


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # one line: wrapping moves with the width


SAMPLING_DEFAULTS = {
    "--model": "the embedded SmolLM2-135M-Instruct",
    "--dtype": "auto",
    "--kv-cache-dtype": "auto",
    "--max-tokens": "256",
    "--temperature": "0.7",
    "--top-p": "0.95",
    "--top-k": "0",
    "--min-p": "0.0",
    "--repetition-penalty": "1.0",
    "--seed": "random each run",
    "--stop": "none",
    "--speculative": "off",
}
DEFAULTS = {
    "generate": SAMPLING_DEFAULTS,
    "chat": {
        **SAMPLING_DEFAULTS,
        "--system": "none",
        "--message": "interactive, one message per line",
    },
    "download": {"--wheel": "download it"},
}


@pytest.mark.parametrize("command", sorted(DEFAULTS))
def test_help_shows_each_flags_default(capsys, command):
    text = _help(capsys, command)
    for flag, default in DEFAULTS[command].items():
        # the flag's own entry (its metavar, then no other flag before its default) ends with it
        metavar = r"[A-Z_{},0-9a-z:\[\]]*"
        entry = rf"\s{flag} {metavar}\s(?:(?! --).)*?\(default: {re.escape(default)}\)"
        assert re.search(entry, text), (flag, default, text)
    assert text.count("(default:") == len(DEFAULTS[command])  # none twice, no "False"


def test_top_level_help_says_where_the_defaults_are(capsys):
    assert "paged-backend COMMAND --help" in _help(capsys)


def _generate(capsys, tiny_model, *extra: str) -> str:
    args = ["generate", "Once upon", "--model", str(tiny_model), "--max-tokens", "16"]
    assert main([*args, "--temperature", "1.0", "--dtype", "float32", *extra]) == 0
    return capsys.readouterr().out


def test_sampling_is_random_without_seed_and_repeats_with_it(capsys, tiny_model, one_thread):
    assert _generate(capsys, tiny_model) != _generate(capsys, tiny_model)
    assert _generate(capsys, tiny_model, "--seed", "7") == _generate(
        capsys, tiny_model, "--seed", "7"
    )


def test_chat_message_prints_a_reply(capsys, tiny_model, one_thread):
    args = ["chat", "--model", str(tiny_model), "--message", "Hello", "--max-tokens", "8"]
    assert main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_the_command_exits_with_mains_code_and_output(tmp_path, tiny_model):
    """The command leaves the process at once after `main` (`entry`): its output and exit code
    must come out whole all the same."""
    command = [sys.executable, "-m", "paged_backend.cli", "generate", "Once upon"]
    ok = subprocess.run(
        [*command, "--model", str(tiny_model), "--max-tokens", "4", "--seed", "1"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and ok.stdout.endswith("\n"), ok.stderr  # its last write
    bad = subprocess.run([*command, "--model", str(tmp_path / "nope")], capture_output=True)
    assert bad.returncode == 2 and bad.stderr.decode().startswith("error: ")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ngram:4", SpeculativeConfig(4, 5, 5)),  # vLLM's default lookup bounds
        ("ngram:4:2:3", SpeculativeConfig(4, 2, 3)),
        (" ngram:1:1:1 ", SpeculativeConfig(1, 1, 1)),
        ("none", None),
        ("None", None),
    ],
)
def test_speculative_maps_to_the_engines_speculative_config(value, expected):
    assert parse_speculative(value) == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("ngram", "is not ngram:K"),
        ("ngram:4:2", "is not ngram:K"),  # MIN without MAX
        ("ngram:-1", "is not ngram:K"),
        ("ngram:x", "is not ngram:K"),
        ("eagle:4", "is not ngram:K"),
        ("ngram:٤", "is not ngram:K"),  # a digit, but not an ASCII one
        ("ngram:0", "num_speculative_tokens"),
        ("ngram:33", "num_speculative_tokens"),
        ("ngram:4:3:2", "prompt_lookup_max"),
    ],
)
@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"]])
def test_bad_speculative_is_one_line_naming_the_flag_and_its_form(capsys, command, value, why):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--speculative", value])
    assert exit_info.value.code == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: argument --speculative: ")
    assert why in line and "ngram:K or ngram:K:MIN:MAX" in line


def test_speculative_run_drafts_and_prints_the_plain_text(capsys, monkeypatch, quoting_model):
    """On a model that quotes its prompt, drafts are accepted, and the reply is the one printed
    without `--speculative`."""
    engines: list[LLMEngine] = []

    class Recorded(LLMEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(cli, "LLMEngine", Recorded)
    args = ["generate", QUOTED, "--model", str(quoting_model), "--dtype", "float32"]
    args += ["--temperature", "0", "--max-tokens", "30"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative", "ngram:4:2:3"]) == 0
    assert capsys.readouterr().out == plain
    assert plain.startswith(QUOTED)  # the model quoted the prompt: drafts can be right
    off, on = (engine.stats() for engine in engines)
    assert off["spec_num_draft_tokens"] == 0
    assert engines[1].config.speculative_config == SpeculativeConfig(4, 2, 3)
    assert on["spec_num_accepted_tokens"] > 0
