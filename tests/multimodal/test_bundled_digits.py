"""The bundled tiny image set: small, every class in both splits, no image in both, each row a
32x32 picture read as a conversation; the script that made it makes the same rows again."""

import base64
import importlib.util
import io
import json
from collections import Counter
from pathlib import Path

from PIL import Image

from twinkle.dataset.digits import digit_trajectory, digits_file, read_digits

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_digits.py"


def _rows(split):
    return [json.loads(line) for line in digits_file(split).read_text().splitlines()]


def test_it_is_small_and_both_splits_hold_every_class():
    assert digits_file("train").stat().st_size + digits_file("eval").stat().st_size < 1_000_000
    train, held_out = _rows("train"), _rows("eval")
    assert (len(train), len(held_out)) == (312, 84)
    classes = {str(d) for d in range(10)} | {
        f"a {c} {s}" for c in ("red", "green", "blue", "black") for s in ("circle", "square", "triangle")
    }
    assert set(Counter(r["answer"] for r in train)) == classes == set(Counter(r["answer"] for r in held_out))
    assert not {r["image"] for r in train} & {r["image"] for r in held_out}


def test_each_row_is_a_32px_picture_in_a_conversation():
    trajectories = read_digits("eval")
    assert len(trajectories) == 84
    user, assistant = trajectories[0]["messages"]
    assert user["content"].startswith("<image>") and assistant["content"] == _rows("eval")[0]["answer"]
    image = Image.open(io.BytesIO(user["images"][0]))
    assert image.size == (32, 32) and image.mode == "RGB"
    # a digit's ink is darker than its paper; a shape's colour is where it is drawn
    digit = next(r for r in _rows("train") if r["kind"] == "digit")
    darkest, lightest = Image.open(io.BytesIO(base64.b64decode(digit["image"]))).convert("L").getextrema()
    assert darkest < 100 < 200 < lightest


def test_the_script_makes_the_same_rows_again():
    spec = importlib.util.spec_from_file_location("build_digits", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    train, held_out = script.build()
    # the answers and their order are fixed by the seed; the PNG bytes by the Pillow version too
    assert [r["answer"] for r in train] == [r["answer"] for r in _rows("train")]
    assert [r["answer"] for r in held_out] == [r["answer"] for r in _rows("eval")]
    first = digit_trajectory(train[0])["messages"][0]["images"][0]
    assert Image.open(io.BytesIO(first)).size == (32, 32)
