"""``Qwen3VLTemplate`` encodes image rows as Qwen3-VL's processor does: 16-pixel patches (3 x 2 x
16 x 16 values each), one ``<|image_pad|>`` per 2x2 merged patch between ``<|vision_start|>`` and
``<|vision_end|>``, the rest rendered by the model's chat template; image tokens are never
supervised. Upstream's name for it, ``Qwen3_5Template``, gives it for a Qwen3-VL checkpoint and
the text template for a text model; a template of one VL family on a model of another is one line."""

import json
import shutil

import pytest
import torch
from tiny_qwen3_vl import build_tiny_qwen3_vl, picture

from twinkle.template import Qwen3_5Template, Qwen3VLTemplate, get_template
from twinkle.utils.errors import UserError

IGNORE = -100


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="module")
def template(tiny_dir):
    return get_template("Qwen3VLTemplate", str(tiny_dir))


def _conversation(images, text="Which is bigger?", reply="the second"):
    user = {"role": "user", "content": "<image>" * len(images) + text, "images": images}
    return [user, {"role": "assistant", "content": reply}]


@pytest.mark.parametrize(
    ("size", "grid"), [((64, 64), (1, 4, 4)), ((96, 64), (1, 4, 6)), ((128, 96), (1, 6, 8))]
)
def test_an_image_is_16_pixel_patches_and_one_token_per_merged_patch(template, size, grid):
    row = template.encode(_conversation([picture(size)]))
    assert row["image_grid_thw"].tolist() == [list(grid)]
    patches = grid[0] * grid[1] * grid[2]
    assert tuple(row["pixel_values"].shape) == (patches, 3 * 2 * 16 * 16)
    ids = row["input_ids"]
    assert ids.count(template.image_token_id) == patches // 4
    start = ids.index(template.tokenizer.convert_tokens_to_ids("<|vision_start|>"))
    end = ids.index(template.tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    assert end - start - 1 == patches // 4  # the image's tokens sit between its markers


def test_the_text_is_the_chat_templates_with_each_image_expanded(template):
    images = [picture((64, 64)), picture((96, 64), (30, 200, 30))]
    row = template.encode(_conversation(images))
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is bigger?"}]
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "the second"}]},
    ]
    text = template.tokenizer.apply_chat_template(messages, tokenize=False)
    pad = "<|image_pad|>"
    first, second = text.split(pad, 2)[:2], text.split(pad, 2)[2]
    expanded = first[0] + pad * 4 + first[1] + pad * 6 + second
    assert template.tokenizer.decode(row["input_ids"]) == expanded


def test_image_tokens_are_never_supervised(template):
    rows = [
        template.encode(_conversation([picture((64, 64))], reply="red")),
        template.encode(
            [
                *_conversation([picture((96, 64))], text="First?", reply="green"),
                {"role": "user", "content": "<image>And?", "images": [picture((64, 96), (1, 2, 3))]},
                {"role": "assistant", "content": "blue"},
            ]
        ),
    ]
    for row in rows:
        ids, labels = torch.tensor(row["input_ids"]), torch.tensor(row["labels"])
        image = ids == template.image_token_id
        assert bool(image.any()) and bool((labels[image] == IGNORE).all())
        supervised = ids[labels != IGNORE]
        assert supervised.numel() > 0 and template.image_token_id not in supervised.tolist()
    # the second row's two replies are supervised, and its two images are there
    assert len(rows[1]["image_grid_thw"]) == 2


def test_upstreams_name_gives_the_vl_template_for_a_qwen3_vl_checkpoint(tiny_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    assert type(get_template("Qwen3_5Template", str(tiny_dir))) is Qwen3VLTemplate
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))  # as model.set_template passes it
    assert type(get_template("Qwen3_5Template", tokenizer)) is Qwen3VLTemplate
    assert type(get_template("Qwen3_5Template", str(tiny_model_dir))) is Qwen3_5Template
    row = get_template("Qwen3_5Template", str(tiny_dir)).encode(_conversation([picture()]))
    assert row["image_grid_thw"].tolist() == [[1, 4, 4]]


def _as_family(tiny_dir, tmp_path, model_type):
    folder = tmp_path / model_type
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return str(folder)


@pytest.mark.parametrize(
    ("name", "model_type", "family", "wanted"),
    [
        ("Qwen2_5VLTemplate", "qwen3_vl", "Qwen3-VL", "Qwen3VLTemplate"),
        ("Qwen3VLTemplate", "qwen2_5_vl", "Qwen2.5-VL", "Qwen2_5VLTemplate"),
    ],
)
def test_a_template_of_another_vl_family_is_one_line(tiny_dir, tmp_path, name, model_type, family, wanted):
    folder = _as_family(tiny_dir, tmp_path, model_type)
    with pytest.raises(
        UserError, match=f"^{name}: .* is a {family} model .*use --template-cls {wanted}$"
    ) as info:
        get_template(name, folder)
    assert "\n" not in str(info.value)
