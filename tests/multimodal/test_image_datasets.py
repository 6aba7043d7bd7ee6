"""Image rows through the data path: ``LazyDataset`` encodes them when read (with the bundled
image set, a missing image and ``skip_bad_rows``); a whole-dataset ``Dataset.encode`` reads
the same samples; a text template refuses them in one line."""

import json

import pytest
import torch

from twinkle.dataset import Dataset, DatasetMeta, LazyDataset
from twinkle.dataset.digits import digit_trajectory, digits_file
from twinkle.utils.errors import UserError


def _lazy(path, model_dir, skip_bad_rows=None):
    dataset = LazyDataset(DatasetMeta(str(path)), skip_bad_rows=skip_bad_rows)
    dataset.set_template("Qwen2_5VLTemplate", model_id=str(model_dir), max_length=128)
    return dataset


def test_the_bundled_image_set_encodes_row_by_row(tiny_vl_dir):
    dataset = _lazy(digits_file("eval"), tiny_vl_dir).map(digit_trajectory).encode()
    row = dataset[0]
    answer = json.loads(digits_file("eval").read_text().splitlines()[0])["answer"]
    assert row["image_grid_thw"].tolist() == [[1, 8, 8]] and row["pixel_values"].shape == (64, 96)
    assert dataset.template.decode([t for t in row["labels"] if t != -100]) == answer + "<|im_end|>\n"


def _write_rows(tmp_path, images):
    path = tmp_path / "rows.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<image>what?", "images": [image]},
                {"role": "assistant", "content": "x"},
            ]
        }
        for image in images
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_missing_image_names_the_file_and_line_or_is_skipped(tmp_path, tiny_vl_dir, png):
    good = tmp_path / "good.png"
    good.write_bytes(png())
    path = _write_rows(tmp_path, [str(good), str(tmp_path / "gone.png"), str(good)])
    strict = _lazy(path, tiny_vl_dir).encode()
    assert strict[0]["pixel_values"].shape == (64, 96)
    with pytest.raises(
        UserError, match=r"rows.jsonl:2: row 1: messages\[0\].images\[0\]: no such image file"
    ) as info:
        strict[1]
    assert "\n" not in str(info.value)
    lenient = _lazy(path, tiny_vl_dir, skip_bad_rows=True).encode()
    assert [lenient[i] is None for i in range(3)] == [False, True, False] and lenient.skipped_rows == 1


def test_a_whole_dataset_encode_reads_as_lazy_dataset(tmp_path, tiny_vl_dir, png):
    good = tmp_path / "good.png"
    good.write_bytes(png())
    path = _write_rows(tmp_path, [str(good)])
    dataset = Dataset(DatasetMeta(str(path)))
    dataset.set_template("Qwen2_5VLTemplate", model_id=str(tiny_vl_dir), max_length=128).encode()
    eager, lazy = dataset[0], _lazy(path, tiny_vl_dir).encode()[0]
    assert eager["input_ids"] == list(lazy["input_ids"]) and eager["labels"] == list(lazy["labels"])
    assert eager["pixel_values"].shape == (64, 96)
    assert torch.equal(eager["pixel_values"], lazy["pixel_values"])


def test_prompt_rows_with_a_vision_template_are_refused(tiny_vl_dir):
    dataset = _lazy(digits_file("eval"), tiny_vl_dir).map(digit_trajectory)
    with pytest.raises(UserError, match="prompt rows .* not supported yet for Qwen2_5VLTemplate"):
        dataset.encode(add_generation_prompt=True)


def test_a_text_template_refuses_an_image_row(tmp_path, tiny_model_dir, png):
    good = tmp_path / "good.png"
    good.write_bytes(png())
    path = _write_rows(tmp_path, [str(good)])
    dataset = LazyDataset(DatasetMeta(str(path)))
    dataset.set_template("Template", model_id=str(tiny_model_dir)).encode()
    with pytest.raises(
        UserError, match=r"rows.jsonl:1: row 0: messages\[0\] has images, but Template reads text only"
    ):
        dataset[0]
