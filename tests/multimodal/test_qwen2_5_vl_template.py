"""``Qwen2_5VLTemplate`` on a tiny Qwen2.5-VL checkpoint: its rows are what the model's own
processor would make of the same conversation, image tokens are never supervised, and it resolves
by name where upstream's scripts name it."""

import io

import pytest
import torch
from PIL import Image

from twinkle.template import Qwen2_5VLTemplate, get_template
from twinkle.template.images import BadImage

IGNORE = -100


def _row(image, answer="7"):
    return [
        {"role": "user", "content": "<image>What digit is in the image?", "images": [image]},
        {"role": "assistant", "content": answer},
    ]


def test_the_name_resolves_for_get_template_and_the_command_line(tiny_vl_dir):
    from twinkle.cli import CLI

    template = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir), max_length=256)
    assert isinstance(template, Qwen2_5VLTemplate) and template.max_length == 256
    args = CLI.from_args(["--template-cls", "Qwen2_5VLTemplate"], env={})
    assert args.template.template_cls == "Qwen2_5VLTemplate"


def test_a_row_is_the_chat_format_with_one_token_per_visual_patch_group(tiny_vl_dir, png):
    from transformers import AutoImageProcessor, AutoTokenizer

    template = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))
    image = png(size=(32, 48))  # 32 wide, 48 high
    row = template.encode(_row(image))
    # 48x32 pixels, 4-pixel patches: a 1 x 12 x 8 grid, 2x2 merged into 24 visual tokens
    assert row["image_grid_thw"].tolist() == [[1, 12, 8]]
    assert row["pixel_values"].shape == (96, 3 * 2 * 4 * 4)
    text = (
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 24 + "<|vision_end|>"
        "What digit is in the image?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_vl_dir))
    assert row["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert row["length"] == len(row["input_ids"]) == len(row["labels"])
    # the pixels are the model's own image processor's
    theirs = AutoImageProcessor.from_pretrained(str(tiny_vl_dir), backend="pil")(
        images=[Image.open(io.BytesIO(image))], return_tensors="pt"
    )
    assert torch.equal(row["pixel_values"], theirs["pixel_values"])
    assert torch.equal(row["image_grid_thw"], theirs["image_grid_thw"])


def test_only_the_reply_is_supervised_never_an_image_token(tiny_vl_dir, png):
    template = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))
    row = template.encode(_row(png(), answer="seven"))
    supervised = [t for t in row["labels"] if t != IGNORE]
    assert template.decode(supervised) == "seven<|im_end|>\n"
    image_positions = [i for i, t in enumerate(row["input_ids"]) if t == template.image_token_id]
    assert len(image_positions) == 16 and all(row["labels"][i] == IGNORE for i in image_positions)


def test_images_in_two_turns_keep_their_order(tiny_vl_dir, png):
    template = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))
    messages = [
        {"role": "user", "content": "<image>first", "images": [png(size=(32, 32))]},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "<image>second", "images": [png(size=(64, 32))]},
        {"role": "assistant", "content": "b"},
    ]
    row = template.encode(messages)
    assert row["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 16]]
    runs, count = [], 0
    for t in [*row["input_ids"], None]:
        if t == template.image_token_id:
            count += 1
        elif count:
            runs, count = [*runs, count], 0
    assert runs == [16, 32]  # each image's tokens where its tag was, in order
    assert template.decode([t for t in row["labels"] if t != IGNORE]) == "a<|im_end|>\nb<|im_end|>\n"


def test_a_tag_without_an_image_names_the_row(tiny_vl_dir):
    template = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))
    with pytest.raises(BadImage, match=r"^row 3: the user turns have 1 <image> tag\(s\) but the row gives 0"):
        template.encode(
            [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}], index=3
        )


def test_truncation_never_cuts_an_images_tokens(tiny_vl_dir, png):
    long_answer = "seven " * 40
    short = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir), max_length=10)
    with pytest.raises(
        BadImage, match=r"^row 0: \d+ tokens, more than --max-length 10, and truncation would cut"
    ):
        short.encode(_row(png(), answer=long_answer), index=0)
    roomy = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir), max_length=60)
    row = roomy.encode(_row(png(), answer=long_answer), index=0)  # the reply's tail is cut, not the image
    assert row["length"] == 60 and row["input_ids"].count(roomy.image_token_id) == 16


def test_a_text_only_model_is_refused(tiny_model_dir):
    from twinkle.utils.errors import UserError

    with pytest.raises(
        UserError, match=r"has no image processor \(preprocessor_config.json\): a vision-language"
    ):
        get_template("Qwen2_5VLTemplate", str(tiny_model_dir))
