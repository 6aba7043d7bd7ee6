"""``twinkle.processor.InputProcessor``: encoded rows -> the padded batch a model step runs."""

import pytest

from twinkle.processor import PROCESSORS, InputProcessor
from twinkle.utils.errors import UserError

A = {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
B = {"input_ids": [8], "labels": [8]}


def test_right_and_left_padding():
    right = InputProcessor(pad_token_id=0)([A, B])
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    left = InputProcessor(padding_side="left", pad_token_id=0)([A, B])
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]  # positions count real tokens


def test_one_row_pairs_and_packed_rows():
    assert InputProcessor()(A)["input_ids"].shape == (1, 3)  # a single row is a batch of one
    pair = {"positive": A, "negative": B, "length": 4}
    assert InputProcessor()([pair])["input_ids"][:, 0].tolist() == [5, 8]  # its two sides, in order
    packed = {"input_ids": [5, 6, 8], "labels": [-100, 6, -100], "position_ids": [0, 1, 0]}
    assert InputProcessor()([packed])["input_ids"].tolist() == [[5, 6], [8, 0]]  # a row per sample
    assert InputProcessor()([])["input_ids"].shape == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"padding_side": "middle"}, r"InputProcessor\(padding_side='middle'\): use one of right, left"),
        ({"framework": "megatron"}, r"not supported yet: megatron"),
    ],
)
def test_what_cannot_be_honoured_is_one_line(kwargs, message):
    with pytest.raises(UserError, match=message) as caught:
        InputProcessor(**kwargs)
    assert "\n" not in str(caught.value)


def test_upstreams_keywords_and_name():
    processor = InputProcessor(device_mesh=None, padding_free=True, framework="transformers")
    assert processor.padding_free and processor.padding_side == "right"
    assert PROCESSORS["InputProcessor"] is InputProcessor
    with pytest.raises(UserError, match="not encoded"):
        processor([{"messages": []}])
