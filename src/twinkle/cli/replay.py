"""``twinkle replay``: write self-distilled replay rows for a base model.

``twinkle replay [--model-id M] [--prompts P.jsonl] [--identity-data D] --output OUT.jsonl``
answers each general prompt of ``P`` (default: the bundled ``general_prompts.jsonl``, 75 Chinese
and 75 English questions) with the base model alone, greedily, under the system prompt and
template that training uses, and writes ``{"query", "response", "tag"}`` rows. With
``--identity-data`` the identity rows come too, interleaved evenly with the replay rows
(``twinkle.preprocessor.replay.interleave``: equal counts alternate, identity first), so
``--dataset-id OUT.jsonl`` trains on the mix. The mix ratio is the ratio of the two row counts;
change it by giving more or fewer prompts. The same model, prompts and flags give the same file."""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

BUNDLED_IDENTITY = "self-cognition"  # --identity-data: the bundled identity rows alone


def add_replay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="write the base model's own answers to general prompts as training rows (self-distilled replay)",
    )
    p.add_argument("--model-id", help="base model (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument(
        "--prompts", help="a .jsonl file of {'query': ...} rows (default: the bundled general prompts)"
    )
    p.add_argument(
        "--identity-data",
        help=f"rows to mix in, a dataset file or {BUNDLED_IDENTITY!r} for the bundled identity rows",
    )
    p.add_argument("--output", required=True, help="the .jsonl file to write (it must not exist yet)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest answer, in tokens (default: 64)")
    p.add_argument("--system", default=None, help="system prompt (default: the one used in training)")
    p.add_argument("--template-cls", default="Template", help="the template training will use")
    p.add_argument("--force", action="store_true", help="replace --output when it exists")


def _identity_rows(name: str) -> list[dict[str, Any]]:
    from twinkle.hub.dataset import identity_rows_path, resolve_dataset

    data = resolve_dataset(str(identity_rows_path()) if name == BUNDLED_IDENTITY else name)
    if "query" not in data.column_names or "response" not in data.column_names:
        raise UserError(f"--identity-data {name!r} needs 'query' and 'response' fields in every row")
    return data.to_list()


def _check_output(path: Path, force: bool) -> None:
    if path.suffix.lower() != ".jsonl":
        raise UserError(f"--output {str(path)!r} must end in .jsonl")
    if path.is_dir():
        raise UserError(f"--output {str(path)!r} is a folder; pass a .jsonl file path")
    if path.exists() and not force:
        raise UserError(f"--output {str(path)!r} exists; pass --force to replace it or choose another path")


def _report_progress(done: int, total: int) -> None:
    if done % 10 == 0 or done == total:
        print(f"answered {done}/{total} prompts", file=sys.stderr, flush=True)


def run_replay(args: argparse.Namespace) -> int:
    from twinkle.cli.chat import load_for_chat
    from twinkle.hub.dataset import asset_path
    from twinkle.preprocessor.replay import interleave, read_prompts, replay_rows
    from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT
    from twinkle.template import get_template
    from twinkle.utils.fileio import atomic_write_text

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    output = Path(args.output).expanduser()
    _check_output(output, args.force)
    prompts = read_prompts(
        Path(args.prompts).expanduser() if args.prompts else asset_path("general_prompts.jsonl")
    )
    identity = _identity_rows(args.identity_data) if args.identity_data else []
    model, tokenizer = load_for_chat(args.model_id, None)
    template = get_template(args.template_cls, tokenizer)
    system = args.system or SYSTEM_PROMPT
    rows = replay_rows(model, tokenizer, template, prompts, system, args.max_new_tokens, _report_progress)
    mixed = interleave(identity, rows)
    atomic_write_text(output, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in mixed))
    print(
        f"wrote {len(mixed)} rows to {output}: {len(rows)} replay rows "
        f"({len(prompts) - len(rows)} empty answers left out), {len(identity)} identity rows",
        flush=True,
    )
    return 0
