"""The bundled tiny image set: a few hundred 32x32 pictures of a rendered digit or a coloured
shape with their answers (``scripts/build_digits.py`` makes them), read as conversations whose
user turn holds the image.

- ``digits_file(split)``: the bundled JSON-lines file of ``'train'`` or ``'eval'``; each row is
  ``{"image": <PNG, base64>, "kind", "question", "answer"}``, loadable with
  ``DatasetMeta(str(digits_file()))``.
- ``digit_trajectory(row)``: one such row -> ``Trajectory`` (the user asks about ``<image>``,
  the image as PNG bytes in ``Message.images``; the assistant answers): a ``map`` function.
- ``read_digits(split)``: every row of a split as trajectories."""

import base64
import importlib.resources
import json
from pathlib import Path
from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.utils.errors import UserError

FILES = {"train": "digits.jsonl", "eval": "digits_eval.jsonl"}


def digits_file(split: str = "train") -> Path:
    if split not in FILES:
        raise UserError(f"the bundled image set has splits {', '.join(FILES)}, not {split!r}")
    return Path(str(importlib.resources.files("twinkle.hub") / "assets" / FILES[split]))


def digit_trajectory(row: dict[str, Any]) -> Trajectory:
    image = base64.b64decode(row["image"])
    return Trajectory(
        messages=[
            Message(role="user", content="<image>" + row["question"], images=[image]),
            Message(role="assistant", content=row["answer"]),
        ]
    )


def read_digits(split: str = "train") -> list[Trajectory]:
    lines = digits_file(split).read_text(encoding="utf-8").splitlines()
    return [digit_trajectory(json.loads(line)) for line in lines if line.strip()]
