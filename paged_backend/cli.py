"""`paged-backend generate|chat`: stream text from the engine to the terminal."""

from __future__ import annotations

import argparse
import sys

from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine
from paged_backend.sampling_params import SamplingParams


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    common.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    common.add_argument("--max-tokens", type=int, default=256)
    common.add_argument("--temperature", type=float, default=0.7)
    common.add_argument("--top-p", type=float, default=0.95)
    common.add_argument("--top-k", type=int, default=0)
    common.add_argument("--min-p", type=float, default=0.0)
    common.add_argument("--repetition-penalty", type=float, default=1.0)
    common.add_argument("--seed", type=int, default=None)
    common.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen = sub.add_parser("generate", parents=[common], help="complete a raw prompt")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    chat = sub.add_parser("chat", parents=[common], help="chat with the model's template")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--message",
        default=None,
        help="one user message, then exit (default: interactive, one message per line)",
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
    args = _parser().parse_args(argv)
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
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
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
    raise SystemExit(main())
