"""The ``twinkle`` command: ``twinkle chat`` talks to a base model with an optional adapter."""

import argparse
import sys

from twinkle.utils.errors import UserError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinkle", description="Twinkle command-line tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="generate replies with a model and an optional LoRA checkpoint")
    chat.add_argument("--adapter", help="a checkpoint folder written by model.save(...)")
    chat.add_argument("--model-id", help="base model (default: the bundled SmolLM2-135M-Instruct)")
    chat.add_argument(
        "--prompt", action="append", help="a question; repeat for several (default: read stdin)"
    )
    chat.add_argument("--system", default=None, help="system prompt (default: the one used in training)")
    chat.add_argument("--max-new-tokens", type=int, default=64)
    chat.add_argument("--template-cls", default="Template", help="the template the adapter was trained with")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        from twinkle.cli.chat import chat

        prompts = args.prompt or [line.strip() for line in sys.stdin if line.strip()]
        for prompt, reply in chat(
            args.model_id, args.adapter, prompts, args.system, args.max_new_tokens, args.template_cls
        ):
            print(f"> {prompt}\n{reply}\n", flush=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
