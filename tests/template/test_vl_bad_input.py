"""Bad image rows read through ``LazyDataset`` and a vision-language template: each is one line
naming the rows file, the line, the row and the image, and with ``skip_bad_rows``
(``--skip-bad-rows``) reads as None, is counted in ``skipped_rows`` and is left out of the
``DataLoader``'s batches. An image above the processor's ``max_pixels`` is not bad: it is scaled
down to fit, as the model's own processor does; a row whose image tokens do not fit
``max_length`` is."""

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from twinkle.dataloader import DataLoader
from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.template import get_template
from twinkle.utils.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))

from tiny_vl import build_tiny_vl  # noqa: E402  (the tiny random Qwen2.5-VL of tests/multimodal)

MAX_SIDE = 64  # the tiny checkpoint's processor: max_pixels 64 * 64, 4-pixel patches merged 2x2


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture
def picture(tmp_path):
    """``picture(name, (w, h))``: the path of a one-colour PNG written into the test's folder."""

    def write(name: str, size=(32, 32)) -> str:
        path = tmp_path / name
        Image.new("RGB", size, (40, 120, 200)).save(path)
        return str(path)

    return write


def _rows_file(folder: Path, rows: list[tuple[str, list]]) -> Path:
    """A JSONL of one-question conversations: ``(user text, images)`` per row."""
    path = folder / "rows.jsonl"
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": text, "images": images},
                    {"role": "assistant", "content": "blue"},
                ]
            }
        )
        for text, images in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _dataset(path, model_dir, skip_bad_rows=False, template="Qwen2_5VLTemplate", max_length=128):
    dataset = LazyDataset(DatasetMeta(str(path)), skip_bad_rows=skip_bad_rows)
    dataset.set_template(template, model_id=str(model_dir), max_length=max_length)
    return dataset.encode()


def _bad_cases(tmp_path, picture):
    """``(user text, images, what the error says after 'row N: ')`` for each kind of bad row."""
    undecodable = tmp_path / "not-a.png"
    undecodable.write_bytes(b"these bytes are no image")
    thin = picture("thin.png", (402, 2))  # Qwen's processor refuses a side over 200x the other
    return [
        (
            "<image>Colour?",
            [str(tmp_path / "gone.png")],
            r"messages\[0\].images\[0\]: no such image file '.*gone.png'",
        ),
        (
            "<image>Colour?",
            [str(undecodable)],
            r"messages\[0\].images\[0\] \('.*not-a.png'\) cannot be decoded",
        ),
        (
            "<image> and <image>?",
            [picture("one.png")],
            r"the user turns have 2 <image> tag\(s\) but the row gives 1 image\(s\); give one image per tag",
        ),
        (
            "<image>Colour?",
            [thin],
            r"messages\[0\].images\[0\] \(402x2 pixels\) is refused by the model's image processor: "
            r"absolute aspect ratio must be smaller than 200, got 201.0; crop or pad the image",
        ),
    ]


def test_each_bad_image_row_is_one_line_naming_its_line_row_and_image(tmp_path, vl_dir, picture):
    cases = _bad_cases(tmp_path, picture)
    good = ("<image>Colour?", [picture("good.png")])
    path = _rows_file(tmp_path, [good] + [(text, images) for text, images, _ in cases])
    dataset = _dataset(path, vl_dir)
    assert dataset[0]["image_grid_thw"].tolist() == [[1, 8, 8]]
    for row, (_, _, says) in enumerate(cases, start=1):
        with pytest.raises(UserError, match=rf"^{path}:{row + 1}: row {row}: {says}") as info:
            dataset[row]
        assert "\n" not in str(info.value)
        assert str(info.value).endswith(
            "or pass --skip-bad-rows (Dataset(skip_bad_rows=True)) to drop such rows"
        )


def test_skip_bad_rows_counts_each_bad_image_row_and_the_loader_leaves_it_out(tmp_path, vl_dir, picture):
    cases = _bad_cases(tmp_path, picture)
    good = [("<image>Colour?", [picture(f"good{i}.png")]) for i in range(3)]
    rows = [good[0], *[(t, i) for t, i, _ in cases[:2]], good[1], *[(t, i) for t, i, _ in cases[2:]], good[2]]
    dataset = _dataset(_rows_file(tmp_path, rows), vl_dir, skip_bad_rows=True)
    batches = list(DataLoader(dataset=dataset, batch_size=len(rows)))
    assert [len(batch) for batch in batches] == [3]  # the good rows only
    assert dataset.skipped_rows == len(cases)
    assert [dataset[i] is None for i in range(len(rows))] == [False, True, True, False, True, True, False]
    assert dataset.skipped_rows == 2 * len(cases)  # each read of a bad row is counted


def test_over_pils_size_limit_is_a_bad_row_read_from_the_header(tmp_path, vl_dir, picture, monkeypatch):
    """PIL refuses a file whose header declares more than twice ``MAX_IMAGE_PIXELS`` before it
    decodes anything (a small file can decode to gigabytes); the limit is lowered here so that a
    64x64 picture stands for such a file."""
    path = _rows_file(tmp_path, [("<image>Colour?", [picture("big.png", (64, 64))])])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(
        UserError,
        match=rf"^{path}:1: row 0: messages\[0\].images\[0\] \('.*big.png'\) is too large to decode: "
        r"Image size \(4096 pixels\) exceeds limit of 2000 pixels.*; downscale it, or raise "
        r"PIL.Image.MAX_IMAGE_PIXELS for files you trust",
    ):
        _dataset(path, vl_dir)[0]
    lenient = _dataset(path, vl_dir, skip_bad_rows=True)
    assert lenient[0] is None and lenient.skipped_rows == 1


def test_an_image_above_max_pixels_is_scaled_down_unless_its_tokens_do_not_fit(tmp_path, vl_dir, picture):
    path = _rows_file(tmp_path, [("<image>Colour?", [picture("large.png", (1000, 500))])])
    row = _dataset(path, vl_dir)[0]
    t, h, w = row["image_grid_thw"][0].tolist()
    assert t == 1 and h * w * 4**2 <= MAX_SIDE * MAX_SIDE and w > h  # within max_pixels, wide kept wide
    image_tokens = h * w // 4
    assert (
        row["input_ids"].count(get_template("Qwen2_5VLTemplate", str(vl_dir)).image_token_id) == image_tokens
    )
    with pytest.raises(
        UserError,
        match=rf"^{path}:1: row 0: \d+ tokens, more than --max-length 20, and truncation would cut an "
        r"image's tokens; raise --max-length or use smaller images",
    ):
        _dataset(path, vl_dir, max_length=20)[0]
    lenient = _dataset(path, vl_dir, skip_bad_rows=True, max_length=20)
    assert lenient[0] is None and lenient.skipped_rows == 1


def test_fewer_tags_than_images_is_not_bad_the_untagged_image_leads_the_turn(tmp_path, vl_dir, picture):
    path = _rows_file(tmp_path, [("What is <image>?", [picture("a.png"), picture("b.png")])])
    row = _dataset(path, vl_dir)[0]
    assert row["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    template = get_template("Qwen2_5VLTemplate", str(vl_dir))
    text = template.decode(row["input_ids"])
    assert text.index("<|vision_start|>") < text.index("What is") < text.rindex("<|vision_start|>")


def test_an_image_row_on_a_text_template_is_a_bad_row(tmp_path, tiny_model_dir, picture):
    path = _rows_file(tmp_path, [("<image>Colour?", [picture("good.png")]), ("Colour?", [])])
    with pytest.raises(
        UserError,
        match=rf"^{path}:1: row 0: messages\[0\] has images, but Template reads text only; "
        r"use a vision-language template \(--template-cls Qwen2_5VLTemplate\) and model",
    ):
        _dataset(path, tiny_model_dir, template="Template")[0]
    lenient = _dataset(path, tiny_model_dir, skip_bad_rows=True, template="Template")
    assert lenient[0] is None and lenient[1] is not None and lenient.skipped_rows == 1


def test_a_vision_template_on_a_text_only_model_is_one_line(tiny_model_dir):
    with pytest.raises(
        UserError, match=r"has no image processor \(preprocessor_config.json\): a vision-language template"
    ) as info:
        get_template("Qwen2_5VLTemplate", str(tiny_model_dir))
    assert "\n" not in str(info.value)


def test_errors_name_the_rows_own_turn_when_a_default_system_is_added(tmp_path, vl_dir):
    template = get_template("Qwen2_5VLTemplate", str(vl_dir), default_system="Answer briefly.")
    messages = [
        {"role": "user", "content": "<image>Colour?", "images": [str(tmp_path / "gone.png")]},
        {"role": "assistant", "content": "blue"},
    ]
    with pytest.raises(UserError, match=r"^row 3: messages\[0\].images\[0\]: no such image file"):
        template.encode(messages, index=3)
