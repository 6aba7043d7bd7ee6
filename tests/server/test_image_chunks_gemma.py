"""Tinker's ``ImageChunk`` through the official SDK on servers of tiny Gemma 3 and Gemma 4 bases
(``tiny_gemma_vl.py``, sharpened so greedy choices win by clear margins): a forward_backward
with image chunks gives the in-process model's loss and adapter update, a greedy sample with an
image equals the in-process ``TorchSampler``'s token for token with the same log-probs, and
another picture behind the same tokens changes them; a declared token count that is not the
processor's, and processed images sent in ``loss_fn_inputs`` (a Gemma row has no grid sizes to
check them by), are one line each.

The shared checks and their tolerances: ``tests/assets/image_chunk_server.py``; sampling's
vision side is the tower's block over the picture's patches and the projection."""

import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A
from test_image_chunks import chunked
from tinker import types
from tolerances import llama_sums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

import image_chunk_server  # noqa: E402
from image_chunk_server import (  # noqa: E402
    BLUE,
    RED,
    encoded,
    greedy_as_the_in_process_sampler,
    serve,
    sharpened,
    train_as_the_in_process_model,
    training_client,
)
from tiny_gemma_vl import BUILDERS, TEMPLATES  # noqa: E402

CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
CONVERSATIONS = [  # (question, answer, image size, colour)
    ("What colour?", "red", (32, 32), RED),
    ("Which shape?", "a wide one", (48, 32), BLUE),
]


def _sharpening(name: str, p: torch.Tensor) -> float:
    """The language model's matrices by 8, Gemma 4's image projection by 30."""
    if "embed_vision.embedding_projection" in name:
        return 30
    return 8 if p.dim() == 2 and "vision" not in name and "embed" not in name else 1


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def family(request, tmp_path_factory):
    """``(model_type, folder)``: the family's tiny checkpoint sharpened by ``_sharpening`` (as
    ``test_gemma_sampling`` sharpens them)."""
    model_type = request.param
    out = tmp_path_factory.mktemp(model_type)
    return model_type, sharpened(BUILDERS[model_type], CLASSES[model_type], out, _sharpening)


@pytest.fixture(scope="module")
def served(family, tmp_path_factory):
    yield from serve(family[1], tmp_path_factory)


@pytest.fixture(scope="module")
def template(family):
    from twinkle.template import get_template

    return get_template(TEMPLATES[family[0]], model_id=str(family[1]))


def local_steps(model_type: str, folder, adapter: str, rows: list[dict], steps: int) -> tuple[dict, list]:
    """``image_chunk_server.local_steps`` on ``model_type``'s class (``test_client_image_gemma``
    compares the client's training with it)."""
    return image_chunk_server.local_steps(folder, CLASSES[model_type], adapter, rows, steps)


def test_image_chunks_train_as_the_in_process_model(served, family, template):
    model_type, folder = family
    train_as_the_in_process_model(
        served, folder, template, CONVERSATIONS, CLASSES[model_type], vision="vision"
    )


def test_a_wrong_count_and_sent_pixels_are_one_line(served, family, template):
    _, folder = family
    row, image = encoded(template, *CONVERSATIONS[0])
    count = list(row["input_ids"]).count(template.image_token_id)
    tc = training_client(served, folder)
    with pytest.raises(
        Exception, match=rf"datum 0: image 0 is {count} tokens .*expected_tokens={count + 1}"
    ) as info:
        tc.forward_backward(
            [chunked(row, image, template.image_token_id, expected=count + 1)], "cross_entropy"
        ).result()
    assert "\n" not in str(info.value).strip()
    ids = list(row["input_ids"])
    sent = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(ids[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(ids) - 1, dtype=np.float32)),
            "pixel_values": types.TensorData.from_numpy(np.asarray(row["pixel_values"], dtype=np.float32)),
        },
    )
    with pytest.raises(Exception, match="datum 0: .*send each image as an ImageChunk"):
        tc.forward_backward([sent], "cross_entropy").result()


def _vision_sums(row: dict) -> list:
    """The vision tower's one block over the picture's patches, and the projection."""
    pixels = torch.as_tensor(row["pixel_values"])
    patches = pixels.shape[1] if pixels.dim() == 3 else (pixels.shape[-1] // 4) ** 2
    return llama_sums(32, 64, 1, tokens=patches) + [48, 32]


def test_greedy_with_an_image_equals_the_in_process_sampler(served, family, template):
    model_type, folder = family
    keys = ("input_ids", "pixel_values") + (("image_position_ids",) if model_type == "gemma4" else ())
    greedy_as_the_in_process_sampler(
        served, folder, template, CLASSES[model_type], (32, 32), keys=keys, vision_sums=_vision_sums
    )


def test_a_text_prompt_samples_as_the_in_process_sampler(served, family, template):
    """A text prompt on a Gemma base runs the sampler's own decoding (the shared decoding batch
    does not lay out sliding-window layers): the in-process sampler's tokens."""
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    model_type, folder = family
    ids = template.encode([{"role": "user", "content": "Say hello."}], add_generation_prompt=True)[
        "input_ids"
    ]
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=str(folder)).result()
    out = sampler.sample(
        types.ModelInput.from_ints(list(ids)), 1, types.SamplingParams(max_tokens=6, temperature=0.0)
    ).result()
    local = TorchSampler(str(folder), model_cls=CLASSES[model_type], dtype=torch.float32)
    (mine,) = local.sample({"input_ids": list(ids)}, SamplingParams(max_tokens=6, temperature=0))
    assert list(out.sequences[0].tokens) == mine.sequences[0].tokens


def test_twinkle_client_places_a_gemma_bases_images_with_its_template(family):
    """``twinkle_client`` builds a Gemma prompt's image chunks with the family's template
    (``test_client_image_gemma`` samples and trains through it)."""
    from twinkle_client.image_prompts import served_template

    model_type, folder = family
    assert type(served_template(str(folder))).__name__ == TEMPLATES[model_type]
