"""Workload W2's data: long self-cognition rows, reproducible from a seed.

Each row keeps the bundled format (``query``/``response`` with ``{{NAME}}``/``{{AUTHOR}}``), in
one language, built by joining bundled questions into a long prompt (64-256 tokens) and bundled
answers into a long reply (300-900 tokens). With the chat template around them, rows run from
about 400 tokens to past ``max_length`` 1024 (truncated there), so a batch of 4 pads a lot and
the logits of a whole batch are large: what W2 exposes.

``python bench/long_rows.py OUT.jsonl [--rows N] [--seed S]`` writes the file to look at."""

import argparse
import json
import random
from pathlib import Path

from twinkle.hub.dataset import bundled_dataset_path
from twinkle.hub.jsonrows import read_json_rows
from twinkle.template.tokenizer import load_tokenizer

PROMPT_TOKENS = (64, 256)
RESPONSE_TOKENS = (300, 900)
JOINERS = {"en": " ", "zh": ""}


def _long_text(pieces: list[str], sizes: dict[str, int], target: int, joiner: str, rng: random.Random) -> str:
    """Draw pieces (with replacement) until their token counts reach ``target``."""
    chosen, total = [], 0
    while total < target:
        piece = rng.choice(pieces)
        chosen.append(piece)
        total += sizes[piece]
    return joiner.join(chosen)


def make_long_rows(num_rows: int, seed: int = 0, tokenizer_path: str | None = None) -> list[dict[str, str]]:
    """``num_rows`` long rows, alternating English and Chinese; the same rows for the same seed
    and tokenizer. ``tokenizer_path``: a folder with the tokenizer that sizes the pieces (None: the
    bundled model's)."""
    bundled = read_json_rows(bundled_dataset_path())
    tokenizer = load_tokenizer(tokenizer_path)
    rng = random.Random(seed)
    by_tag = {tag: [r for r in bundled if r.get("tag") == tag] for tag in JOINERS}
    sizes = {
        text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
        for row in bundled
        for text in (row["query"], row["response"])
    }
    rows = []
    for index in range(num_rows):
        tag = ("en", "zh")[index % 2]
        queries = [r["query"] for r in by_tag[tag]]
        responses = [r["response"] for r in by_tag[tag]]
        prompt = _long_text(queries, sizes, rng.randint(*PROMPT_TOKENS), JOINERS[tag], rng)
        response = _long_text(responses, sizes, rng.randint(*RESPONSE_TOKENS), JOINERS[tag], rng)
        rows.append({"query": prompt, "response": response, "tag": tag})
    return rows


def write_long_rows(path: Path, num_rows: int, seed: int = 0, tokenizer_path: str | None = None) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for row in make_long_rows(num_rows, seed, tokenizer_path):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=44)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    print(write_long_rows(cli.out, cli.rows, cli.seed))
