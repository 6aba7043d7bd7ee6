"""``twinkle eval --adapter CKPT --identity-check``: does the adapter know who it is, and did it
leave everything else alone?

The held-out questions (``twinkle/hub/assets/identity_check.jsonl``, or ``--identity-questions``)
are of two kinds: ``identity`` questions phrased unlike the training rows, and ``general``
questions with accepted answer keywords, none of them among the bundled training or replay
prompts. Each is answered greedily with the adapter and with it disabled (the base model), under
the training system prompt. Reported: identity answers that name the assistant (its name or
author), general answers that are correct (hold a keyword), general answers that mention the
identity, and general answers that changed from the base model's."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

KINDS = ("identity", "general")


def add_identity_check_args(p: Any) -> None:
    p.add_argument(
        "--identity-check",
        action="store_true",
        help="answer held-out identity and general questions with and without the adapter, and compare",
    )
    p.add_argument("--identity-questions", help="the questions (default: the bundled identity_check.jsonl)")
    p.add_argument("--identity-report", help="also write the questions and answers to this .json or .md file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest answer in the identity check")


def read_questions(path: Path) -> list[dict[str, Any]]:
    """Rows ``{"kind": "identity"|"general", "query", "answers": [...] (general only)}``."""
    from twinkle.hub.jsonrows import read_json_records

    if not path.is_file():
        raise UserError(f"--identity-questions {str(path)!r} does not exist; pass a .jsonl file")
    records, lines = read_json_records(path)
    for i, row in enumerate(records):
        where = f"{path}:{lines[i]}" if lines is not None else f"{path}: record {i}"
        if row.get("kind") not in KINDS or not isinstance(row.get("query"), str) or not row["query"].strip():
            raise UserError(f"{where}: needs 'kind' (identity or general) and a non-empty text 'query'")
        answers = row.get("answers")
        if row["kind"] == "general" and (
            not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers)
        ):
            raise UserError(f"{where}: a general question needs 'answers', a list of accepted keywords")
    if not any(row["kind"] == "identity" for row in records) or not any(
        row["kind"] == "general" for row in records
    ):
        raise UserError(f"{path}: needs both identity and general questions")
    return records


def identity_words(name: str, author: str) -> list[str]:
    """What counts as naming the assistant: its name, its author, and, for a name that mixes
    scripts, its Latin-letter core of four or more letters (``twinkle`` of ``twinkle大模型``)."""
    words = [name, author]
    for text in (name, author):
        if re.search(r"[^\x00-\x7f]", text):
            words += re.findall(r"[A-Za-z][A-Za-z0-9_-]{3,}", text)
    return [w for w in dict.fromkeys(words) if w.strip()]


def contains(text: str, words: list[str]) -> bool:
    """``text`` holds one of ``words``, case-insensitively; a word of Latin letters or digits
    matches only as a whole word (``7`` is not found in ``17``), others (Chinese) anywhere."""
    lowered = text.lower()
    for word in words:
        word = word.lower()
        if re.fullmatch(r"[a-z0-9₀-₉ _.-]+", word):
            if re.search(rf"(?<![a-z0-9]){re.escape(word)}(?![a-z0-9])", lowered):
                return True
        elif word in lowered:
            return True
    return False


def score(questions: list[dict[str, Any]], tuned: list[str], base: list[str], words: list[str]) -> dict:
    """Counts over the answers of the adapter (``tuned``) and of the base model (``base``)."""
    ident = [i for i, q in enumerate(questions) if q["kind"] == "identity"]
    general = [i for i, q in enumerate(questions) if q["kind"] == "general"]

    def count(indices: list[int], test: Any) -> int:
        return sum(1 for i in indices if test(i))

    return {
        "identity_questions": len(ident),
        "general_questions": len(general),
        "identity_named": {
            "adapter": count(ident, lambda i: contains(tuned[i], words)),
            "base": count(ident, lambda i: contains(base[i], words)),
        },
        "general_correct": {
            "adapter": count(general, lambda i: contains(tuned[i], questions[i]["answers"])),
            "base": count(general, lambda i: contains(base[i], questions[i]["answers"])),
        },
        "general_naming_identity": {
            "adapter": count(general, lambda i: contains(tuned[i], words)),
            "base": count(general, lambda i: contains(base[i], words)),
        },
        "general_changed": count(general, lambda i: tuned[i].strip() != base[i].strip()),
    }


def table(counts: dict) -> str:
    ni, ng = counts["identity_questions"], counts["general_questions"]
    rows = [
        ("identity answers naming the assistant", counts["identity_named"], ni),
        ("general answers correct", counts["general_correct"], ng),
        ("general answers mentioning the identity", counts["general_naming_identity"], ng),
    ]
    lines = [f"{'':42}{'adapter':>10}{'base':>10}"]
    for label, pair, n in rows:
        tuned, base = f"{pair['adapter']}/{n}", f"{pair['base']}/{n}"
        lines.append(f"{label:42}{tuned:>10}{base:>10}")
    changed = f"{counts['general_changed']}/{ng}"
    lines.append(f"{'general answers changed from the base':42}{changed:>10}{'-':>10}")
    return "\n".join(lines)


def markdown(counts: dict, questions: list[dict[str, Any]], tuned: list[str], base: list[str]) -> str:
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    out = ["```", table(counts), "```", "", "| kind | question | adapter | base |", "|---|---|---|---|"]
    out += [
        f"| {q['kind']} | {cell(q['query'])} | {cell(t)} | {cell(b)} |"
        for q, t, b in zip(questions, tuned, base, strict=True)
    ]
    return "\n".join(out) + "\n"


def write_report(
    path: Path, counts: dict, questions: list, tuned: list[str], base: list[str], meta: dict
) -> None:
    from twinkle.utils.fileio import atomic_write_text

    if path.suffix.lower() == ".md":
        text = markdown(counts, questions, tuned, base)
    else:
        answers = [
            {**q, "adapter_answer": t, "base_answer": b}
            for q, t, b in zip(questions, tuned, base, strict=True)
        ]
        text = json.dumps({**meta, "counts": counts, "answers": answers}, ensure_ascii=False, indent=1) + "\n"
    atomic_write_text(path, text)


def answer_both(model: Any, tokenizer: Any, template: Any, queries: list[str], max_new_tokens: int):
    """Greedy answers with the adapter on, then with it disabled."""
    from twinkle.preprocessor.replay import greedy_answers

    def run() -> list[str]:
        return [
            text.strip()
            for text, _ in greedy_answers(model, tokenizer, template, queries, max_new_tokens=max_new_tokens)
        ]

    tuned = run()
    with model.disable_adapter():
        base = run()
    return tuned, base


def run_identity_check(args: argparse.Namespace, folder: Path, pick: Any) -> int:
    """``twinkle eval --identity-check``; ``pick(name, default)`` gives a flag, else the training
    run's setting, else ``default``."""
    from twinkle.cli.chat import load_for_chat
    from twinkle.hub.dataset import asset_path
    from twinkle.template import get_template

    report = Path(args.identity_report).expanduser() if args.identity_report else None
    if report is not None and report.suffix.lower() not in (".json", ".md"):
        raise UserError(f"--identity-report {str(report)!r} must end in .json or .md")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    source = Path(args.identity_questions).expanduser() if args.identity_questions else None
    questions = read_questions(source or asset_path("identity_check.jsonl"))
    name, author = pick("model_name", "twinkle大模型"), pick("model_author", "ModelScope社区")
    model, tokenizer = load_for_chat(pick("model_id", None), str(folder))
    template = get_template(pick("template_cls", "Template"), tokenizer)
    tuned, base = answer_both(
        model, tokenizer, template, [q["query"] for q in questions], args.max_new_tokens
    )
    counts = score(questions, tuned, base, identity_words(name, author))
    print(table(counts), flush=True)
    if report is not None:
        meta = {"adapter": str(folder), "model_name": name, "model_author": author}
        write_report(report, counts, questions, tuned, base, {**meta, "max_new_tokens": args.max_new_tokens})
        print(f"wrote the questions and answers to {report}", flush=True)
    return 0
