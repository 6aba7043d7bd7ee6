"""A text-only model given rows that hold images (encoded with a vision-language template) refuses
them in one line naming the rows, before its forward runs: whether the image tokens' ids lie past
its vocabulary (which would fail deep inside on an index) or inside it (which would train on the
placeholder tokens with the pictures silently dropped), in one call or in parts of rows, packed or
padded."""

import sys
from pathlib import Path

import pytest

from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError

MESSAGE = r"^batch row\(s\) \[1\] hold images but llama has no vision tower; use a vision-language checkpoint"


@pytest.fixture(scope="module")
def vl_rows(tmp_path_factory):
    """Rows from the tiny Qwen2.5-VL's template: a text row, then a row with an image."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))
    from tiny_vl import build_tiny_vl
    from vl_pictures import png_bytes

    from twinkle.template import get_template

    template = get_template("Qwen2_5VLTemplate", str(build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))))
    text = template.encode([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "hello"}])
    image = template.encode(
        [
            {"role": "user", "content": "<image>Colour?", "images": [png_bytes((32, 32), (200, 30, 30))]},
            {"role": "assistant", "content": "red"},
        ]
    )
    return [text, image]


def _in_vocabulary(rows, vocab):
    """The same rows with every id folded into ``vocab``: a text model would run them."""
    return [{**row, "input_ids": [i % vocab for i in row["input_ids"]]} for row in rows]


@pytest.fixture
def model(tiny_model_dir):
    from peft import LoraConfig

    model = TransformersModel(str(tiny_model_dir))
    model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"))
    calls = []
    model.model.get_input_embeddings().register_forward_pre_hook(lambda *args: calls.append(1))
    model.forward_calls = calls
    return model


@pytest.mark.parametrize("fold", [False, True], ids=["ids-past-the-vocabulary", "ids-inside-it"])
@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("micro_batch_size", [None, 1])
@pytest.mark.parametrize("call", ["forward_backward", "forward_only"])
def test_image_rows_on_a_text_model_are_one_line_before_any_forward(
    model, vl_rows, fold, padding_free, micro_batch_size, call
):
    assert "pixel_values" in vl_rows[1] and "pixel_values" not in vl_rows[0]
    rows = _in_vocabulary(vl_rows, model.model.config.vocab_size) if fold else vl_rows
    assert fold == (max(rows[1]["input_ids"]) < model.model.config.vocab_size)
    model.padding_free = padding_free
    with pytest.raises(UserError, match=MESSAGE) as info:
        getattr(model, call)(inputs=rows, micro_batch_size=micro_batch_size)
    assert "\n" not in str(info.value)
    assert model.forward_calls == []  # refused before the first part's forward
    assert all(p.grad is None for p in model.model.parameters())


def test_the_same_rows_without_images_run(model, vl_rows):
    """What is refused is the images: the rows' text alone trains on the text model."""
    rows = [{k: v for k, v in row.items() if k not in ("pixel_values", "image_grid_thw")} for row in vl_rows]
    rows = _in_vocabulary(rows, model.model.config.vocab_size)
    loss = float(model.forward_backward(inputs=rows))
    assert loss > 0 and model.forward_calls
