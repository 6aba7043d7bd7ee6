"""The bundled arithmetic sets (``scripts/build_arithmetic.py``): ``arithmetic-gsm8k``, one
addition or subtraction per problem, and ``arithmetic-gsm8k-two-step``. Each row is a GSM8K row
whose ``#### N`` is the arithmetic its question states; the held-out split shares no question
with training, and at the one-step level no sum or difference either; the files are what the
seeded script writes."""

import importlib.util
import re
from pathlib import Path

import pytest

from twinkle.hub.dataset import resolve_dataset
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.utils.errors import UserError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_arithmetic.py"
ONE_STEP = re.compile(r"^(\d+) ([+-]) (\d+) = (\d+)\n#### (\d+)$")


def rows(name: str, split: str) -> list[dict]:
    return [dict(r) for r in resolve_dataset(name, split=split)]


def one_step_key(row: dict) -> tuple[str, int, int]:
    """The row's operation and numbers, checked against its question and its answer."""
    a, op, b, value, final = ONE_STEP.fullmatch(row["answer"]).groups()
    a, b = int(a), int(b)
    assert int(value) == int(final) == (a + b if op == "+" else a - b) >= 1, row
    assert re.findall(r"\d+", row["question"]) == [str(a), str(b)], row
    assert 2 <= b and 2 <= a <= 20, row
    verb = re.search(r"gets|more are put|and \d+ on|gives away|taken out|lost", row["question"]).group()
    assert (op == "+") == (verb in ("gets", "more are put") or verb.startswith("and ")), row
    return op, a, b


def test_one_step_rows_are_well_formed_and_held_out_asks_new_sums():
    train, held_out = rows("arithmetic-gsm8k", "train"), rows("twinkle://arithmetic-gsm8k", "eval")
    assert (len(train), len(held_out)) == (400, 100)
    train_keys = [one_step_key(r) for r in train]
    held_keys = [one_step_key(r) for r in held_out]
    assert not set(train_keys) & set(held_keys)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert {op for op, _, _ in held_keys} == {"+", "-"}
    prompt = GSM8KProcessor(system=None).preprocess(held_out[0], 0)
    assert prompt["user_data"] == [("ground_truth", held_out[0]["answer"].rsplit("#### ", 1)[1])]


def test_two_step_level_keeps_its_own_name_and_disjoint_splits():
    train, held_out = rows("arithmetic-gsm8k-two-step", "train"), rows("arithmetic-gsm8k-two-step", "eval")
    assert (len(train), len(held_out)) == (400, 100)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    for row in train + held_out:
        assert len(re.findall(r"\d+", row["question"])) == 3 and "####" in row["answer"], row
    with pytest.raises(
        UserError,
        match=r"^the bundled dataset arithmetic-gsm8k-two-step has no 'test' split; use split 'train' or 'eval'$",
    ):
        resolve_dataset("twinkle://arithmetic-gsm8k-two-step", split="test")


def test_the_files_are_what_the_seeded_script_writes():
    spec = importlib.util.spec_from_file_location("build_arithmetic", SCRIPT)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.one_step_rows(400, 100, 20261203) == (
        rows("arithmetic-gsm8k", "train"),
        rows("arithmetic-gsm8k", "eval"),
    )
    assert build.two_step_rows(400, 100, 20261203) == (
        rows("arithmetic-gsm8k-two-step", "train"),
        rows("arithmetic-gsm8k-two-step", "eval"),
    )
