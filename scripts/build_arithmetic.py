"""Build the bundled arithmetic word problems in GSM8K form (``question``, ``answer`` ending in
``#### N``): ``src/twinkle/hub/assets/arithmetic_gsm8k.jsonl`` (train) and
``arithmetic_gsm8k_eval.jsonl`` (held out: no question text in both).

Each problem takes two steps of addition or subtraction on numbers below 100, worded from a few
templates, so that a small model's greedy answers start mostly wrong and the reward can teach
both the answer form and the sums. Run: ``python scripts/build_arithmetic.py``."""

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "twinkle" / "hub" / "assets"
NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
THINGS = ["apples", "stickers", "marbles", "books", "coins", "shells", "pencils", "cards"]
TEMPLATES = [
    (
        "{name} has {a} {things}. {name} gets {b} more and then gives away {c}. "
        "How many {things} does {name} have now?",
        (1, -1),
    ),
    (
        "A box holds {a} {things}. {b} are taken out, then {c} are put in. How many {things} are in the box?",
        (-1, 1),
    ),
    (
        "{name} collects {a} {things} on Monday, {b} on Tuesday and {c} on Wednesday. "
        "How many {things} did {name} collect in all?",
        (1, 1),
    ),
    (
        "{name} had {a} {things}, lost {b}, and then lost {c} more. How many {things} are left?",
        (-1, -1),
    ),
]


def problem(rng: random.Random) -> dict:
    text, (first, second) = rng.choice(TEMPLATES)
    while True:  # every count the story passes through is a real count: never below zero
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 49)
        middle = a + first * b
        value = middle + second * c
        if middle >= 0 and value >= 0:
            break
    question = text.format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b, c=c)
    return {"question": question, "answer": f"The answer is {value}.\n#### {value}"}


def main(train: int = 400, held_out: int = 100, seed: int = 20261203) -> None:
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < train + held_out:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    for name, part in (
        ("arithmetic_gsm8k.jsonl", rows[:train]),
        ("arithmetic_gsm8k_eval.jsonl", rows[train:]),
    ):
        with open(ASSETS / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        print(f"{ASSETS / name}: {len(part)} rows")


if __name__ == "__main__":
    main()
