"""The ``twinkle`` command: ``twinkle chat`` talks to a base model with an optional adapter
(a multi-turn conversation without ``--prompt``); ``twinkle eval`` prints a checkpoint's eval
loss and accuracy (with ``--identity-check``, how its identity and general answers compare with
the base model's); ``twinkle replay`` writes the base model's own answers to general prompts as
training rows, mixed with identity rows; ``twinkle kernels`` says what each kernel op resolves to on this machine and why; ``twinkle
verify`` checks checkpoint folders against the sizes and checksums their save recorded;
``twinkle export`` merges a checkpoint into its base model and writes it as a Hugging Face
folder and GGUF files; ``twinkle server`` serves one base model to many tenants through the Tinker
SDK (its flags are ``twinkle.server.config``'s)."""

import argparse
import sys

from twinkle.cli.evaluate import add_eval_parser, run_eval
from twinkle.cli.export import add_export_parser, run_export
from twinkle.cli.replay import add_replay_parser, run_replay
from twinkle.utils.errors import EXIT_INTERRUPTED, INTERRUPTED, UserError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinkle", description="Twinkle command-line tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="generate replies with a model and an optional LoRA checkpoint")
    chat.add_argument("--adapter", help="a checkpoint folder written by model.save(...)")
    chat.add_argument("--model-id", help="base model (default: the bundled SmolLM2-135M-Instruct)")
    chat.add_argument(
        "--prompt",
        action="append",
        help="a question; repeat for several (default: a conversation on the terminal, or one question per stdin line)",
    )
    chat.add_argument("--system", default=None, help="system prompt (default: the one used in training)")
    chat.add_argument("--max-new-tokens", type=int, default=64)
    chat.add_argument("--template-cls", default="Template", help="the template the adapter was trained with")
    kernels = sub.add_parser("kernels", help="what each kernel op resolves to on this machine, and why")
    kernels.add_argument(
        "--model-id", help="the model to resolve for (default: the bundled SmolLM2-135M-Instruct)"
    )
    kernels.add_argument("--no-model", action="store_true", help="report the machine alone, loading no model")
    verify = sub.add_parser(
        "verify", help="check checkpoints against their recorded sizes and checksums (exit 0: all intact)"
    )
    verify.add_argument(
        "paths",
        nargs="+",
        metavar="CKPT",
        help="a checkpoint folder, or an output dir to check every one in it",
    )
    sub.add_parser(
        "server",
        add_help=False,
        help="serve one base model to many tenants through the Tinker SDK (see --help)",
    )
    add_export_parser(sub)
    add_eval_parser(sub)
    add_replay_parser(sub)
    return parser


def _kernels(model_id: str | None, load: bool) -> None:
    from twinkle.kernel import describe

    model = None
    if load:
        from twinkle.model.loading import load_causal_lm

        model, _, _ = load_causal_lm(model_id, torch_device(), None)
    print(describe(model))


def torch_device():  # noqa: ANN201 - a torch.device; torch is imported late to keep --help fast
    import torch

    from twinkle.utils.framework import Torch

    kind = Torch.device_type()
    return torch.device(kind if kind == "cpu" else f"{kind}:0")


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. A ``UserError`` is one ``error:`` line and status 2;
    Ctrl-C is ``error: interrupted`` and status 130, without a traceback either."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print(f"error: {INTERRUPTED}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["server"]:  # its own flags, parsed by twinkle.server.config
        from twinkle.server import serve

        try:
            return serve(argv[1:])
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "kernels":
            _kernels(args.model_id, not args.no_model)
            return 0
        if args.command == "verify":
            from twinkle.cli.verify import verify_paths

            return verify_paths(args.paths)
        if args.command == "export":
            return run_export(args)
        if args.command == "eval":
            return run_eval(args)
        if args.command == "replay":
            return run_replay(args)
        if not args.prompt:  # a conversation: interactive on a terminal, else one question per line
            from twinkle.cli.repl import run_repl

            return run_repl(args.model_id, args.adapter, args.system, args.max_new_tokens, args.template_cls)
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
