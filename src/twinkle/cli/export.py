"""``twinkle export --adapter CKPT --output OUT [--gguf] [--gguf-type f16,q8_0] [--dtype ...]``:
merge a checkpoint's LoRA adapter into its base model and write a Hugging Face folder, plus
GGUF files in its ``gguf/`` subfolder with ``--gguf``."""

import argparse
import re

from twinkle.utils.errors import UserError

# Spelled out rather than imported: ``twinkle.export`` imports torch, and ``--help`` stays fast.
# A test keeps them equal to ``twinkle.export.GGUF_TYPES`` and the merge's dtypes.
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
GGUF_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0")


def _gguf_types(text: str) -> tuple[str, ...]:
    types = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    if not types:
        raise argparse.ArgumentTypeError("give at least one type, e.g. f16 or f16,q8_0")
    return types


# What transformers' save_pretrained reads as a shard size: a whole number and a decimal (KB, MB,
# GB) or binary (KiB, MiB, GiB) unit; it fails on anything else only once the merge is done.
_SHARD_SIZE = re.compile(r"([0-9]+)\s*([KMG]i?B)", re.IGNORECASE)


def check_shard_size(text: str) -> str:
    """``--max-shard-size`` in the form ``save_pretrained`` takes (``5GB``), checked before the
    merge; a ``UserError`` for anything else, or for a size of zero."""
    match = _SHARD_SIZE.fullmatch(text.strip())
    if match is None or int(match.group(1)) < 1:
        raise UserError(
            f"--max-shard-size: {text!r} is not a positive size; write a whole number and a unit, e.g. 500MB, 5GB or 2GiB"
        )
    return match.group(1) + match.group(2)


def add_export_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers action
    export = sub.add_parser(
        "export", help="merge a LoRA checkpoint into its base model; write a Hugging Face folder and GGUF"
    )
    export.add_argument("--adapter", required=True, help="a checkpoint folder written by model.save(...)")
    export.add_argument(
        "--output",
        required=True,
        help="the folder to write: a new or empty one, or an earlier export with --overwrite",
    )
    export.add_argument("--model-id", help="base model (default: the one the checkpoint was trained on)")
    export.add_argument(
        "--dtype", choices=DTYPE_CHOICES, help="dtype of the safetensors (default: the base model's)"
    )
    export.add_argument("--gguf", action="store_true", help="also write OUT/gguf/<name>.<TYPE>.gguf")
    export.add_argument(
        "--gguf-type",
        type=_gguf_types,
        metavar="TYPES",
        help=f"GGUF tensor types, a comma list of {', '.join(GGUF_TYPE_NAMES)}; one file each (implies --gguf; default f16)",
    )
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT, once the new export is complete, if an earlier twinkle export wrote it "
        "(its .twinkle-export marker) and it holds no other file; any other folder is refused",
    )


def run_export(args: argparse.Namespace) -> int:
    max_shard_size = check_shard_size(args.max_shard_size)  # before the merge, not after it
    from twinkle.export import export_checkpoint

    types = args.gguf_type or (("f16",) if args.gguf else ())
    result = export_checkpoint(
        args.adapter,
        args.output,
        model_id=args.model_id,
        gguf_types=types,
        dtype=args.dtype,
        overwrite=args.overwrite,
        max_shard_size=max_shard_size,
    )
    print(f"wrote {result.folder} ({result.dtype} safetensors, config, generation config, tokenizer)")
    for path in result.gguf_files:
        print(f"wrote {path}")
    return 0
