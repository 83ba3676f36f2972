"""Command line: `python -m nanoserve generate|bench|serve|bench-serve ...`."""
from __future__ import annotations

import argparse
import sys


def generate(argv) -> None:
    from nanoserve import LLM, EngineArgs, SamplingParams
    ap = argparse.ArgumentParser(prog="nanoserve generate", description="Complete prompts with a model.")
    ap.add_argument("prompts", nargs="+", help="prompt texts (use $'...' in bash for newlines)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    EngineArgs.add_cli_args(ap)   # --model, --device, --dtype, --seed, --compilation, --quantization, ...
    args = ap.parse_args(argv)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens)
        llm = LLM(**EngineArgs.from_cli_args(args).kwargs())
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"nanoserve generate: {e}")
    for out in outs:
        print(out.prompt + out.outputs[0].text)
        print(f"--- {len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}")


def bench(argv) -> None:
    from nanoserve.course.bench import main as run
    run(argv)


def serve(argv) -> None:
    from nanoserve.serve.server import main as run
    run(argv)


def bench_serve(argv) -> None:
    from nanoserve.serve.load import main as run
    run(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"generate": generate, "bench": bench, "serve": serve, "bench-serve": bench_serve}
    if not argv or argv[0] not in commands:
        sys.exit(f"usage: python -m nanoserve {{{'|'.join(commands)}}} [options]  (-h after a command for its help)")
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
