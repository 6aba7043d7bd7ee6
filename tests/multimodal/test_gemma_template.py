"""``Gemma3Template`` and ``Gemma4Template`` encode a conversation with images as the family's own
processor does, on tiny random checkpoints (``tiny_gemma_vl.py``): Gemma 3's rows equal
``Gemma3Processor``'s (which builds on a CPU-only install: it has no video processor); Gemma 4's
processor cannot be built without torchvision (its video processor), so its rows are checked
against its parts: the chat template's text with each ``<|image|>`` replaced as
``Gemma4Processor.replace_image_token`` writes it, from the image processor's own token counts.
Image tokens are never supervised; a template of another family is one line."""

import io

import pytest
import torch
from tiny_gemma_vl import BUILDERS, TEMPLATES, conversation_rows
from tiny_qwen3_vl import picture

from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def family(request, tmp_path_factory):
    """``(model_type, folder)`` of a tiny checkpoint of each family."""
    return request.param, BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def _messages(images):
    return [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in images), {"type": "text", "text": "Which?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "the second"}]},
    ]


def test_gemma3_rows_equal_its_processors(tmp_path):
    from PIL import Image
    from transformers import AutoProcessor

    folder = BUILDERS["gemma3"](tmp_path)
    images = [picture((32, 32), (200, 30, 30)), picture((48, 32), (30, 200, 30))]
    template = get_template("Gemma3Template", str(folder))
    row = template.encode(
        [
            {"role": "user", "content": "<image><image>Which?", "images": images},
            {"role": "assistant", "content": "the second"},
        ]
    )
    processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
    text = processor.apply_chat_template(_messages(images), tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    expected = processor(text=[text], images=[pil], return_tensors="pt")
    assert row["input_ids"] == expected["input_ids"][0].tolist()
    torch.testing.assert_close(torch.as_tensor(row["pixel_values"]), expected["pixel_values"], atol=0, rtol=0)
    soft = template.tokenizer.image_token_id
    assert (torch.tensor(row["input_ids"]) == soft).tolist() == (expected["token_type_ids"][0] == 1).tolist()
    assert row["input_ids"].count(soft) == 2 * 16  # image_seq_length soft tokens each


def test_gemma4_rows_equal_its_processors_parts(tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = BUILDERS["gemma4"](tmp_path)
    images = [picture((32, 32), (200, 30, 30)), picture((48, 32), (30, 200, 30))]
    row = get_template("Gemma4Template", str(folder)).encode(
        [
            {"role": "user", "content": "<image><image>Which?", "images": images},
            {"role": "assistant", "content": "the second"},
        ]
    )
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    tok = AutoTokenizer.from_pretrained(str(folder))
    out = AutoImageProcessor.from_pretrained(str(folder), backend="pil")(images=pil, return_tensors="pt")
    counts = out["num_soft_tokens_per_image"].tolist()
    assert counts[0] != counts[1]  # aspect ratio kept: the two images take different counts
    text = tok.apply_chat_template(_messages(images), tokenize=False)
    pieces = text.split(tok.image_token)
    text = pieces[0] + "".join(
        f"{tok.boi_token}{tok.image_token * n}{tok.eoi_token}" + rest
        for n, rest in zip(counts, pieces[1:], strict=True)
    )
    assert row["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    for key in ("pixel_values", "image_position_ids"):
        torch.testing.assert_close(torch.as_tensor(row[key]), out[key], atol=0, rtol=0)


def test_only_the_replies_are_supervised_never_an_image_token(family):
    model_type, folder = family
    template = get_template(TEMPLATES[model_type], str(folder))
    tok = template.tokenizer
    image_ids = {tok.convert_tokens_to_ids(t) for t in (tok.image_token, tok.boi_token, tok.eoi_token)}
    for row, reply in zip(conversation_rows(template), ["red", "hello there", "the second"], strict=True):
        supervised = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE]
        assert template.decode(supervised).startswith(reply)  # the reply and its end-of-turn
        assert not image_ids & set(supervised)
        assert all(
            label == IGNORE
            for t, label in zip(row["input_ids"], row["labels"], strict=True)
            if t in image_ids
        )


def test_more_tags_than_images_is_one_line(family):
    model_type, folder = family
    template = get_template(TEMPLATES[model_type], str(folder))
    message = {"role": "user", "content": "<image><image>Which?", "images": [picture()]}
    with pytest.raises(UserError, match="row 3: the user turns have 2 <image> tag") as info:
        template.encode([message, {"role": "assistant", "content": "x"}], index=3)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "wrong", ["Gemma3Template", "Gemma4Template", "Qwen2_5VLTemplate", "Qwen3VLTemplate"]
)
def test_a_template_of_another_family_is_one_line(family, wrong):
    model_type, folder = family
    if wrong == TEMPLATES[model_type]:
        return
    with pytest.raises(UserError, match=f"use --template-cls {TEMPLATES[model_type]}$") as info:
        get_template(wrong, str(folder))
    assert "\n" not in str(info.value)


def test_a_gemma_template_on_a_qwen_model_names_the_qwen_template(tiny_vl_dir):
    with pytest.raises(UserError, match="Qwen2.5-VL model .* use --template-cls Qwen2_5VLTemplate$"):
        get_template("Gemma3Template", str(tiny_vl_dir))


def test_pan_and_scan_is_one_line(tmp_path):
    import json

    folder = BUILDERS["gemma3"](tmp_path)
    path = folder / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pan_and_scan": True}))
    template = get_template("Gemma3Template", str(folder))
    message = {"role": "user", "content": "<image>Which?", "images": [picture()]}
    with pytest.raises(UserError, match="do_pan_and_scan, whose crops add images") as info:
        template.encode([message, {"role": "assistant", "content": "x"}])
    assert "\n" not in str(info.value)


def test_a_tokenizer_without_the_image_tokens_named_is_one_line(tmp_path):
    import json

    folder = BUILDERS["gemma4"](tmp_path)
    path = folder / "tokenizer_config.json"
    saved = json.loads(path.read_text())
    saved.pop("extra_special_tokens")
    path.write_text(json.dumps(saved))
    with pytest.raises(
        UserError, match="does not name its boi_token, eoi_token, image_token; is it a Gemma4"
    ) as info:
        get_template("Gemma4Template", str(folder))
    assert "\n" not in str(info.value)
