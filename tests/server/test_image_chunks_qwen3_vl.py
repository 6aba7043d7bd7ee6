"""Tinker's ``ImageChunk`` through the official SDK on a server of a tiny Qwen3-VL (16-pixel
patches, deepstack features; ``tiny_qwen3_vl.py``), its language model sharpened as
``build_sharp_vl`` sharpens Qwen2.5-VL's so greedy choices win by clear margins: a
forward_backward with image chunks gives the in-process model's loss and adapter update, and a
greedy sample with an image equals the in-process ``TorchSampler``'s, token for token, with the
same log-probs; another picture behind the same tokens changes them (the shared checks and their
tolerances: ``tests/assets/image_chunk_server.py``)."""

import sys
from pathlib import Path

import pytest
import torch
from test_image_chunks import chunked

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

from image_chunk_server import (  # noqa: E402
    BLUE,
    QWEN_KEYS,
    RED,
    greedy_as_the_in_process_sampler,
    qwen_tower_sums,
    serve,
    sharpened,
    train_as_the_in_process_model,
)
from tiny_qwen3_vl import build_tiny_qwen3_vl  # noqa: E402

VL_CLS = "Qwen3VLForConditionalGeneration"
CONVERSATIONS = [  # (question, answer, image size, colour): 4 and 6 visual tokens
    ("What colour?", "red", (64, 64), RED),
    ("Which shape?", "a wide one", (96, 64), BLUE),
]


def _language_model_by_8(name: str, p: torch.Tensor) -> float:
    return 8 if p.dim() == 2 and ".visual." not in f".{name}" else 1


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return sharpened(build_tiny_qwen3_vl, VL_CLS, tmp_path_factory.mktemp("qwen3-vl"), _language_model_by_8)


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    yield from serve(vl_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def template(vl_dir):
    from twinkle.template import get_template

    return get_template("Qwen3VLTemplate", model_id=str(vl_dir))


def test_image_chunks_train_as_the_in_process_model(vl_server, vl_dir, template):
    tc, encoded_rows = train_as_the_in_process_model(
        vl_server, vl_dir, template, CONVERSATIONS, VL_CLS, vision=".visual."
    )
    assert [template.image_tokens(row["image_grid_thw"][0]) for row, _ in encoded_rows] == [4, 6]
    # the count is the Qwen3-VL processor's: a 64x64 picture is a 4x4 grid of 16-pixel patches
    row, image = encoded_rows[0]
    with pytest.raises(Exception, match=r"datum 0: image 0 is 4 tokens .*grid 1x4x4.*expected_tokens=16"):
        tc.forward_backward(
            [chunked(row, image, template.image_token_id, expected=16)], "cross_entropy"
        ).result()


def test_greedy_with_an_image_equals_the_in_process_sampler(vl_server, vl_dir, template):
    greedy_as_the_in_process_sampler(
        vl_server,
        vl_dir,
        template,
        VL_CLS,
        (64, 64),
        keys=QWEN_KEYS,
        vision_sums=qwen_tower_sums,
    )
