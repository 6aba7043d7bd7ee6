"""A turn given as upstream's content parts (``{'type': 'text', 'text': ...}`` and ``{'type':
'image', 'image' | 'url' | 'path': ...}``) encodes exactly as the same conversation written with
``<image>`` tags and ``Message.images``: through ``LazyDataset`` (each row read) and through
``Dataset`` (its ``map`` stores the parts as tagged text). A part of another type is one line
naming the row and the part, counted with ``skip_bad_rows``; under a text template an image part
is refused as ``Message.images`` are, and text parts read as their text."""

import pytest
import torch

from twinkle.dataset import Dataset, DatasetMeta, LazyDataset
from twinkle.utils.errors import UserError

QUESTION = "Which colour?"


def _rows(tmp_path, png):
    """``(parts rows, tagged rows)``: the same four conversations written both ways."""
    red, green = png((32, 32), (200, 30, 30)), png((48, 32), (30, 200, 30))
    path = tmp_path / "blue.png"
    path.write_bytes(png((32, 48), (30, 30, 200)))
    parts = [
        [{"type": "image", "image": red}, {"type": "text", "text": QUESTION}],
        [
            {"type": "text", "text": "Compare "},
            {"type": "image", "url": str(path)},
            {"type": "text", "text": " and "},
            {"type": "image", "image": green},
            {"type": "text", "text": "."},
        ],
        [{"type": "text", "text": QUESTION}, {"type": "image", "path": str(path)}],
        [{"type": "text", "text": "No picture here."}],
    ]
    tagged = [
        ("<image>" + QUESTION, [red]),
        ("Compare <image> and <image>.", [str(path), green]),
        (QUESTION + "<image>", [str(path)]),
        ("No picture here.", []),
    ]

    def row(content, images=None, reply="x"):
        user = {"role": "user", "content": content, **({"images": images} if images else {})}
        return {"messages": [user, {"role": "assistant", "content": reply}]}

    return [row(c) for c in parts], [row(text, images) for text, images in tagged]


def _numbers(rows):
    """Rows ``{'i': 0}``, ... that a preprocessor turns into ``rows``: a table of loaded rows
    cannot hold turns whose content is text in one and a list in another, a preprocessor's
    output read by ``LazyDataset`` never goes into one."""
    return DatasetMeta(data=[{"i": i} for i in range(len(rows))])


def _lazy(rows, model_dir, skip_bad_rows=None):
    dataset = LazyDataset(_numbers(rows), skip_bad_rows=skip_bad_rows).map(lambda row: rows[row["i"]])
    return dataset.set_template("Qwen2_5VLTemplate", model_id=str(model_dir), max_length=256).encode()


def _same(a, b):
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert list(value) == list(b[key]) if isinstance(value, list) else value == b[key], key


def test_content_parts_encode_as_message_images(tmp_path, png, tiny_vl_dir):
    parts, tagged = _rows(tmp_path, png)
    by_parts, by_tags = _lazy(parts, tiny_vl_dir), _lazy(tagged, tiny_vl_dir)
    for i in range(4):
        _same(by_parts[i], by_tags[i])
    assert [len(by_parts[i].get("image_grid_thw", [])) for i in range(4)] == [1, 2, 1, 0]
    assert by_parts[1]["image_grid_thw"].tolist() == [[1, 12, 8], [1, 8, 12]]  # the url part, then the image


def test_an_eager_dataset_stores_content_parts_as_tagged_text(tmp_path, png, tiny_vl_dir):
    parts, tagged = _rows(tmp_path, png)
    mapped = Dataset(_numbers(parts)).map(lambda row: parts[row["i"]])
    assert mapped[1]["messages"][0]["content"] == "Compare <image> and <image>."
    mapped.set_template("Qwen2_5VLTemplate", model_id=str(tiny_vl_dir), max_length=256).encode()
    lazy = _lazy(tagged, tiny_vl_dir)
    for i in range(4):
        _same(mapped[i], lazy[i])


def test_a_part_of_another_type_names_the_row_and_part(tmp_path, png, tiny_vl_dir):
    parts, _ = _rows(tmp_path, png)
    parts[2]["messages"][0]["content"].append({"type": "audio", "audio": "a.wav"})
    strict = _lazy(parts, tiny_vl_dir)
    with pytest.raises(
        UserError, match=r"row 2: messages\[0\]\.content\[2\] has type 'audio'; content parts are"
    ) as info:
        strict[2]
    assert "\n" not in str(info.value)
    lenient = _lazy(parts, tiny_vl_dir, skip_bad_rows=True)
    assert [lenient[i] is None for i in range(4)] == [False, False, True, False] and lenient.skipped_rows == 1


def test_a_text_template_refuses_image_parts_and_reads_text_parts(tmp_path, png, tiny_model_dir):
    parts, _ = _rows(tmp_path, png)
    dataset = LazyDataset(_numbers(parts)).map(lambda row: parts[row["i"]])
    dataset.set_template("Template", model_id=str(tiny_model_dir)).encode()
    with pytest.raises(
        UserError, match=r"row 1: messages\[0\] has images, but Template reads text only"
    ) as info:
        dataset[1]
    assert "\n" not in str(info.value)
    plain = LazyDataset(DatasetMeta(data=[{"messages": [
        {"role": "user", "content": "No picture here."}, {"role": "assistant", "content": "x"}]}]))  # fmt: skip
    plain.set_template("Template", model_id=str(tiny_model_dir)).encode()
    _same(dataset[3], plain[0])
