"""Build the bundled arithmetic word problems in GSM8K form (``question``, ``answer`` ending in
``#### N``), two levels, each a train file and a held-out file in ``src/twinkle/hub/assets``:

- ``one-step`` (``arithmetic_gsm8k.jsonl`` / ``arithmetic_gsm8k_eval.jsonl``, the bundled
  ``arithmetic-gsm8k``): one addition or subtraction of two numbers from 2 to ONE_STEP_MAX. The
  base SmolLM2-135M-Instruct answers some of these greedily (with the cookbook's one worked
  example) but not most, so GRPO's groups disagree and the accuracy reward has a signal.
  No held-out problem has the operation and both numbers of a training problem.
- ``two-step`` (``arithmetic_gsm8k_two_step*.jsonl``, ``arithmetic-gsm8k-two-step``): two
  steps on numbers below 100; beyond the base model (its greedy held-out accuracy is 0).
  No question text is in both files.

Deterministic (seeded). Run: ``python scripts/build_arithmetic.py``."""

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
ONE_STEP_MAX = 20
ONE_STEP_TEMPLATES = [
    ("{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?", 1),
    ("A box holds {a} {things}. {b} more are put in. How many {things} are in the box?", 1),
    ("{name} finds {a} {things} on Monday and {b} on Tuesday. How many {things} did {name} find in all?", 1),
    ("{name} has {a} {things} and gives away {b}. How many {things} does {name} have left?", -1),
    ("A box holds {a} {things}. {b} are taken out. How many {things} are in the box now?", -1),
    ("{name} had {a} {things} and lost {b}. How many {things} are left?", -1),
]


def problem(rng: random.Random) -> dict:
    """A two-step problem."""
    text, (first, second) = rng.choice(TEMPLATES)
    while True:  # every count the story passes through is a real count: never below zero
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 49)
        middle = a + first * b
        value = middle + second * c
        if middle >= 0 and value >= 0:
            break
    question = text.format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b, c=c)
    return {"question": question, "answer": f"The answer is {value}.\n#### {value}"}


def one_step_keys(high: int = ONE_STEP_MAX) -> list[tuple[int, int, int]]:
    """Every ``(sign, a, b)`` a one-step problem can ask: ``a + b`` or ``a - b`` (``a > b``) with
    both numbers from 2 to ``high``."""
    plus = [(1, a, b) for a in range(2, high + 1) for b in range(2, high + 1)]
    return plus + [(-1, a, b) for a in range(3, high + 1) for b in range(2, a)]


def one_step(rng: random.Random, key: tuple[int, int, int]) -> dict:
    """A one-step problem asking for ``key`` (``(sign, a, b)``) in one of the templates' words."""
    sign, a, b = key
    text = rng.choice([t for t, s in ONE_STEP_TEMPLATES if s == sign])
    value = a + sign * b
    question = text.format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b)
    op = "+" if sign > 0 else "-"
    return {"question": question, "answer": f"{a} {op} {b} = {value}\n#### {value}"}


def one_step_rows(train: int, held_out: int, seed: int, high: int = ONE_STEP_MAX) -> tuple[list, list]:
    """``train`` and ``held_out`` one-step problems, each asking a different ``(sign, a, b)``:
    no held-out problem asks a sum or difference that a training problem asks."""
    rng = random.Random(seed)
    keys = one_step_keys(high)
    if train + held_out > len(keys):
        raise ValueError(f"{train + held_out} problems need more than the {len(keys)} keys up to {high}")
    picked = rng.sample(keys, train + held_out)
    rows = [one_step(rng, key) for key in picked]
    return rows[:train], rows[train:]


def two_step_rows(train: int, held_out: int, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < train + held_out:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows[:train], rows[train:]


def write(name: str, rows: list[dict]) -> None:
    with open(ASSETS / name, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    print(f"{ASSETS / name}: {len(rows)} rows")


def main(train: int = 400, held_out: int = 100, seed: int = 20261203) -> None:
    one_train, one_eval = one_step_rows(train, held_out, seed)
    write("arithmetic_gsm8k.jsonl", one_train)
    write("arithmetic_gsm8k_eval.jsonl", one_eval)
    two_train, two_eval = two_step_rows(train, held_out, seed)
    write("arithmetic_gsm8k_two_step.jsonl", two_train)
    write("arithmetic_gsm8k_two_step_eval.jsonl", two_eval)


if __name__ == "__main__":
    main()
