"""Tinker's ``ImageChunk`` through the official SDK on a server of a tiny Qwen3.5 base with its
image processor (``tiny_qwen3_5_vl.py``: a linear-attention layer then a full-attention one,
Qwen3-VL's 16-pixel patches), its matrices scaled so greedy choices win by clear margins: a
forward_backward with image chunks gives the in-process model's loss and adapter update, and a
greedy sample with an image equals the in-process ``TorchSampler``'s token for token with the
same log-probs, another picture changing them (the shared checks:
``tests/assets/image_chunk_server.py``). The same checkpoint without its image processor serves
text, and an image sent to it is one line.

Tolerances as ``test_image_chunks_qwen3_vl``. Adam runs with ``eps=1`` here (``EPS``): the
linear-attention layer's decay-gate LoRA has gradients of one head near 1e-5 of the largest, within
what other fp32 orders of the gated delta rule move, and Adam's first step at a tiny ``eps`` turns
every gradient into plus or minus the learning rate, whatever its size; at ``eps=1`` the update
follows the gradient, so the two runs' adapters agree to fp32's orders."""

import shutil
import sys
from pathlib import Path

import pytest
import tinker
from serving import KEY_A, start
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

from image_chunk_server import (  # noqa: E402
    BLUE,
    QWEN_KEYS,
    RED,
    greedy_as_the_in_process_sampler,
    prompt_of,
    qwen_tower_sums,
    serve,
    train_as_the_in_process_model,
)
from tiny_qwen3_5_vl import MODEL_CLS, build_tiny_qwen3_5_vl  # noqa: E402

CONVERSATIONS = [  # (question, answer, image size, colour): 4 and 6 visual tokens
    ("What colour?", "red", (64, 64), RED),
    ("Which shape?", "a wide one", (96, 64), BLUE),
]
EPS = 1.0


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3-5"), scale=6.0)


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    yield from serve(vl_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def template(vl_dir):
    from twinkle.template import get_template

    return get_template("Qwen3VLTemplate", model_id=str(vl_dir))


def test_image_chunks_train_as_the_in_process_model(vl_server, vl_dir, template):
    _, encoded_rows = train_as_the_in_process_model(
        vl_server, vl_dir, template, CONVERSATIONS, MODEL_CLS, vision=".visual.", eps=EPS
    )
    assert [template.image_tokens(row["image_grid_thw"][0]) for row, _ in encoded_rows] == [4, 6]


def test_greedy_with_an_image_equals_the_in_process_sampler(vl_server, vl_dir, template):
    greedy_as_the_in_process_sampler(
        vl_server,
        vl_dir,
        template,
        MODEL_CLS,
        (64, 64),
        keys=QWEN_KEYS,
        vision_sums=qwen_tower_sums,
    )


def test_without_its_image_processor_a_qwen3_5_base_serves_text(vl_dir, template, tmp_path):
    text_only = tmp_path / "no-processor"
    shutil.copytree(vl_dir, text_only)
    (text_only / "preprocessor_config.json").unlink()
    running = start(text_only, tmp_path / "srv")
    try:
        client = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
        sampler = client.create_sampling_client(base_model=str(text_only)).result()
        _, prompt = prompt_of(template, RED, (64, 64))
        with pytest.raises(Exception, match="prompt: images are placed for .* the served model is qwen3_5"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        text = types.ModelInput.from_ints(template.tokenizer("Say hello.")["input_ids"])
        out = sampler.sample(text, 1, types.SamplingParams(max_tokens=3)).result()
        assert 1 <= len(out.sequences[0].tokens) <= 3
    finally:
        running.stop()
