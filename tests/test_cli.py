"""`paged-backend`: user mistakes are one `error:` line and exit code 2; sampling is random run
to run unless `--seed` is given; `--help` shows every flag's default."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from paged_backend.cli import main


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
    "--max-tokens": "256",
    "--temperature": "0.7",
    "--top-p": "0.95",
    "--top-k": "0",
    "--min-p": "0.0",
    "--repetition-penalty": "1.0",
    "--seed": "random each run",
    "--stop": "none",
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
        # the flag's own entry (no other flag before its default) ends with it
        entry = rf"\s{flag} [A-Z_{{}},0-9a-z]*\s(?:(?! --).)*?\(default: {re.escape(default)}\)"
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
