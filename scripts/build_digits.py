"""Build the bundled tiny image set in ``src/twinkle/hub/assets``: small RGB pictures of a
rendered digit or a coloured shape, each with its question and answer, for vision-language
tests and examples that run offline.

- ``digits.jsonl`` (train) and ``digits_eval.jsonl`` (held out): one JSON object a line,
  ``{"image": <PNG, base64>, "kind": "digit" | "shape", "question": ..., "answer": ...}``;
  ``twinkle.dataset.digits`` reads them as conversations with the image in the user turn.
- Digits 0-9 in varied size, place, ink and paper colours, slightly rotated; shapes (circle,
  square, triangle) in four colours and varied size and place. Answers: ``"7"``, ``"a red
  circle"``. Both files hold every class; no image is in both.

Deterministic (seeded; the PNG bytes depend on the Pillow version's font and encoder).
Run: ``python scripts/build_digits.py``."""

import base64
import io
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ASSETS = Path(__file__).resolve().parents[1] / "src" / "twinkle" / "hub" / "assets"
SIZE = 32  # pixels a side
DIGITS_PER_CLASS = 30  # of which EVAL_SHARE go to the held-out file
SHAPES_PER_CLASS = 8  # per shape and colour
EVAL_SHARE = 0.2
COLOURS = {"red": (200, 30, 30), "green": (30, 150, 40), "blue": (30, 60, 200), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
DIGIT_QUESTION = "What digit is in the image? Answer with the digit."
SHAPE_QUESTION = "What is in the image? Answer with its colour and shape."


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _paper(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.randint(215, 255) for _ in range(3))


def draw_digit(digit: int, rng: random.Random) -> Image.Image:
    """One digit, dark ink on light paper, its size, place and tilt drawn from ``rng``."""
    font = ImageFont.load_default(size=rng.randint(20, 28))
    glyph = Image.new("L", (SIZE, SIZE), 0)
    draw = ImageDraw.Draw(glyph)
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font)
    x = (SIZE - (right - left)) // 2 - left + rng.randint(-3, 3)
    y = (SIZE - (bottom - top)) // 2 - top + rng.randint(-3, 3)
    draw.text((x, y), str(digit), fill=255, font=font)
    glyph = glyph.rotate(rng.uniform(-15, 15), resample=Image.Resampling.BILINEAR)
    ink = tuple(rng.randint(0, 90) for _ in range(3))
    image = Image.new("RGB", (SIZE, SIZE), _paper(rng))
    image.paste(Image.new("RGB", (SIZE, SIZE), ink), mask=glyph)
    return image


def draw_shape(shape: str, colour: str, rng: random.Random) -> Image.Image:
    """One filled shape of ``colour`` on light paper, its size and place drawn from ``rng``."""
    image = Image.new("RGB", (SIZE, SIZE), _paper(rng))
    draw = ImageDraw.Draw(image)
    half = rng.randint(8, 13)
    cx, cy = rng.randint(half + 1, SIZE - half - 2), rng.randint(half + 1, SIZE - half - 2)
    box = (cx - half, cy - half, cx + half, cy + half)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    return image


def build(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``(train rows, held-out rows)``."""
    rng = random.Random(seed)
    train, held_out = [], []

    def add(rows: list[dict]) -> None:
        cut = round(len(rows) * (1 - EVAL_SHARE))
        train.extend(rows[:cut])
        held_out.extend(rows[cut:])

    for digit in range(10):
        add(
            [
                {
                    "image": _png(draw_digit(digit, rng)),
                    "kind": "digit",
                    "question": DIGIT_QUESTION,
                    "answer": str(digit),
                }
                for _ in range(DIGITS_PER_CLASS)
            ]
        )
    for shape in SHAPES:
        for colour in COLOURS:
            answer = f"a {colour} {shape}"
            add(
                [
                    {
                        "image": _png(draw_shape(shape, colour, rng)),
                        "kind": "shape",
                        "question": SHAPE_QUESTION,
                        "answer": answer,
                    }
                    for _ in range(SHAPES_PER_CLASS)
                ]
            )
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train, held_out


def main() -> None:
    train, held_out = build()
    for name, rows in (("digits.jsonl", train), ("digits_eval.jsonl", held_out)):
        path = ASSETS / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} rows, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
