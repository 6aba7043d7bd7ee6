"""Image columns through an eager ``Dataset``: a Hugging Face ``datasets.Dataset`` whose ``Image()``
column holds PIL images (what ``datasets`` decodes an image column to, as in upstream's LaTeX OCR
rows), its ``Image(decode=False)`` records and plain bytes go through ``map`` (a preprocessor
building ``Message(images=[row['image']])``) and ``encode``, and each sample read equals
``LazyDataset``'s for the same rows; a picture is never lost on the way, and a bad one is one line
naming its row, or counted with ``skip_bad_rows``. On a tiny random Qwen3-VL (``tiny_qwen3_vl``)."""

import base64
import io
import logging

import datasets
import pytest
import torch
from tiny_qwen3_vl import build_tiny_qwen3_vl, picture

from twinkle.data_format import Message, Trajectory
from twinkle.dataset import Dataset, DatasetMeta, LazyDataset
from twinkle.preprocessor import Preprocessor
from twinkle.utils.errors import UserError

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (120, 120, 40)]
SAMPLE_KEYS = [
    "input_ids",
    "labels",
    "attention_mask",
    "position_ids",
    "length",
    "pixel_values",
    "image_grid_thw",
]
SIZES = [(64, 64), (96, 64), (64, 128), (32, 32)]  # 16, 24, 32 and 4 patches of 16 pixels


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"))


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _hf_rows(decode: bool = True) -> datasets.Dataset:
    """Four rows with an ``Image()`` column and a text column, as ``datasets`` gives them."""
    pictures = [picture(size, colour) for size, colour in zip(SIZES, COLOURS, strict=True)]
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    rows = datasets.Dataset.from_dict(
        {"image": [_pil(p) for p in pictures], "text": ["a+b", "x^2", "\\frac{1}{2}", "y"]}, features=features
    )
    return rows if decode else rows.cast_column("image", datasets.Image(decode=False))


def ocr(row):
    return Trajectory(
        messages=[
            Message(
                role="user", content="<image>Using LaTeX to perform OCR on the image.", images=[row["image"]]
            ),
            Message(role="assistant", content=row["text"]),
        ]
    )


class LatexOCRProcessor(Preprocessor):
    """Upstream's shape: ``__call__`` on a batch of columns."""

    def __call__(self, rows):
        return self.map_row_to_col([ocr(row) for row in self.map_col_to_row(rows)])


def _encoded(cls, rows, model_dir, preprocess=ocr, skip_bad_rows=None):
    dataset = cls(DatasetMeta(data=rows), skip_bad_rows=skip_bad_rows)
    dataset.set_template("Qwen3VLTemplate", model_id=str(model_dir), max_length=256)
    return dataset.map(preprocess).encode()


def _assert_same_row(a, b):
    assert sorted(a) == sorted(b) == sorted(SAMPLE_KEYS)
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        assert list(a[key]) == list(b[key]), key
    assert a["length"] == b["length"]
    for key in ("pixel_values", "image_grid_thw"):  # the same pictures through the same processor
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _assert_same(eager, lazy):
    assert len(eager) == len(lazy)
    for i in range(len(eager)):
        _assert_same_row(eager[i], lazy[i])


@pytest.mark.parametrize("decode", [True, False], ids=["pil", "bytes-and-path-records"])
def test_an_image_column_encodes_as_lazy_dataset_does(model_dir, decode):
    rows = _hf_rows(decode)
    eager = _encoded(Dataset, rows, model_dir)
    _assert_same(eager, _encoded(LazyDataset, rows, model_dir))
    grids = [eager[i]["image_grid_thw"].tolist() for i in range(4)]
    assert grids == [[[1, 4, 4]], [[1, 4, 6]], [[1, 8, 4]], [[1, 2, 2]]]  # each row its own picture


def test_upstreams_batched_preprocessor_and_plain_bytes(model_dir):
    rows = _hf_rows(decode=False)
    as_bytes = datasets.Dataset.from_dict(
        {"image": [r["bytes"] for r in rows["image"]], "text": rows["text"]}
    )
    eager = _encoded(Dataset, as_bytes, model_dir, LatexOCRProcessor)
    _assert_same(eager, _encoded(LazyDataset, _hf_rows(), model_dir))


def test_a_mapped_picture_is_kept_whole(model_dir):
    """``map`` stores a PIL image as the PNG of its RGB pixels: decoded again it is the same picture."""
    import numpy as np

    rows = _hf_rows()
    mapped = Dataset(DatasetMeta(data=rows)).map(ocr)
    stored = mapped[1]["messages"][0]["images"]
    assert len(stored) == 1 and stored[0].startswith("data:image/png;base64,")
    again = _pil(base64.b64decode(stored[0].split(",", 1)[1]))
    assert np.array_equal(np.asarray(again.convert("RGB")), np.asarray(rows[1]["image"].convert("RGB")))


def test_the_encoded_rows_hold_the_pictures_not_the_tensors(model_dir):
    eager = _encoded(Dataset, _hf_rows(), model_dir)
    assert "pixel_values" not in eager.data.column_names and eager.data.column_names[-1] == "images"
    assert [len(images) for images in eager.data["images"]] == [1, 1, 1, 1]


def _with_bad_bytes() -> datasets.Dataset:
    rows = _hf_rows(decode=False)
    images = [r["bytes"] for r in rows["image"]]
    images[2] = b"not an image at all"
    return datasets.Dataset.from_dict({"image": images, "text": rows["text"]})


def test_bad_image_bytes_are_one_line_naming_the_row(model_dir):
    with pytest.raises(UserError) as info:
        _encoded(Dataset, _with_bad_bytes(), model_dir)
    message = str(info.value)
    assert "\n" not in message
    assert "row 2: messages[0].images[0] (19 bytes) cannot be decoded as an image" in message
    lazy = _encoded(LazyDataset, _with_bad_bytes(), model_dir)
    with pytest.raises(UserError, match=r"row 2: messages\[0\]\.images\[0\] \(19 bytes\) cannot be decoded"):
        lazy[2]


def test_skip_bad_rows_counts_a_bad_image(model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        eager = _encoded(Dataset, _with_bad_bytes(), model_dir, skip_bad_rows=True)
    assert len(eager) == 3
    assert any("1 of 4" in r.getMessage() and "row 2" in r.getMessage() for r in caplog.records), caplog.text
    lazy = _encoded(LazyDataset, _with_bad_bytes(), model_dir, skip_bad_rows=True)
    read = [lazy[i] for i in range(4)]
    assert [r is None for r in read] == [False, False, True, False] and lazy.skipped_rows == 1
    for i, j in ((0, 0), (1, 1), (2, 3)):  # the good rows are the same either way
        assert torch.equal(eager[i]["pixel_values"], read[j]["pixel_values"])


def test_a_value_that_is_no_image_is_one_line_at_map(model_dir, caplog):
    rows = [{"image": picture(), "text": "a"}, {"image": picture(), "text": "b"}]

    def numbered(row):  # row 0's picture is a number
        return ocr({**row, "image": 7 if row["text"] == "a" else row["image"]})

    with pytest.raises(UserError) as info:
        Dataset(DatasetMeta(data=rows)).map(numbered)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "row 0: messages[0].images[0] is a number (7); give a file path, the file's bytes or a PIL image"
        in message
    )
    with caplog.at_level(logging.WARNING):
        kept = Dataset(DatasetMeta(data=rows), skip_bad_rows=True).map(numbered)
    assert len(kept) == 1 and kept[0]["messages"][1]["content"] == "b"
    assert any("1 of 2" in r.getMessage() and "row 0" in r.getMessage() for r in caplog.records), caplog.text


def test_dataloader_rows_and_the_encode_cache(model_dir):
    from twinkle.dataloader import DataLoader

    rows = _hf_rows()
    lazy = _encoded(LazyDataset, rows, model_dir)
    batches = zip(
        DataLoader(dataset=_encoded(Dataset, rows, model_dir), batch_size=2),
        DataLoader(dataset=lazy, batch_size=2),
        strict=True,
    )
    count = 0
    for eager_batch, lazy_batch in batches:
        assert len(eager_batch) == len(lazy_batch) == 2
        for a, b in zip(eager_batch, lazy_batch, strict=True):
            _assert_same_row(a, b)
            count += 1
    assert count == 4
    for _ in range(2):  # stored, then read from the cache
        cached = Dataset(DatasetMeta(data=rows)).map(ocr)
        cached.set_template("Qwen3VLTemplate", model_id=str(model_dir), max_length=256)
        _assert_same(cached.encode(load_from_cache_file=True), lazy)


def test_upstreams_schema_for_image_columns(model_dir, tmp_path):
    """Upstream's ``fsdp2_gemma4_12b_mm.py`` shape: ``Dataset(features=...)`` naming the image
    column ``Image()`` and a ``messages`` schema, over rows that hold image paths."""
    import json

    lines = []
    for i, (size, colour) in enumerate(zip(SIZES, COLOURS, strict=True)):
        path = tmp_path / f"{i}.png"
        path.write_bytes(picture(size, colour))
        lines.append(json.dumps({"image": str(path), "text": f"x^{i}"}))
    rows = tmp_path / "latex.jsonl"
    rows.write_text("\n".join(lines) + "\n")
    turn = datasets.Features(
        {
            "role": datasets.Value("string"),
            "content": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
        }
    )
    schema = datasets.Features(
        {"image": datasets.Image(), "text": datasets.Value("string"), "messages": datasets.List(turn)}
    )
    eager = Dataset(features=schema, dataset_meta=DatasetMeta(str(rows)))
    assert type(eager[0]["image"]).__name__.endswith("ImageFile")  # the paths read as PIL images
    eager.set_template("Qwen3VLTemplate", model_id=str(model_dir), max_length=256)
    eager.map(preprocess_func=LatexOCRProcessor).encode()
    lazy = LazyDataset(DatasetMeta(str(rows))).map(ocr)
    lazy.set_template("Qwen3VLTemplate", model_id=str(model_dir), max_length=256)
    _assert_same(eager, lazy.encode())
    with pytest.raises(
        UserError, match=r"^Dataset\(features=...\): 'image' is the text 'Image'; give a datasets"
    ):
        Dataset(features={"image": "Image"})
    with pytest.raises(
        UserError, match=r"^Dataset\(features=...\): cannot cast the column\(s\) text of .*latex.jsonl"
    ):
        Dataset(
            features=datasets.Features({"text": datasets.Value("int64")}), dataset_meta=DatasetMeta(str(rows))
        )
