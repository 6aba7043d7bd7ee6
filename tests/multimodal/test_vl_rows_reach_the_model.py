"""An encoded image row is what a Qwen2.5-VL model consumes: ``input_ids``, ``pixel_values``
and ``image_grid_thw`` of ``Qwen2_5VLTemplate`` run through the model's forward (which checks
that the image tokens match the vision tower's output), the image changes the prediction, and
the loss on the row's labels is the cross-entropy of the reply alone. ``TransformersModel``'s
steps on such rows: test_vl_training.py."""

import torch
import torch.nn.functional as F

from twinkle.template import get_template


def _batch(row):
    return {
        "input_ids": torch.tensor([row["input_ids"]]),
        "attention_mask": torch.tensor([row["attention_mask"]]),
        "pixel_values": row["pixel_values"],
        "image_grid_thw": row["image_grid_thw"],
    }


def test_the_row_runs_and_the_image_matters(tiny_vl_dir, png):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_vl_dir), dtype=torch.float32).eval()
    template = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))

    def row(colour):
        messages = [
            {"role": "user", "content": "<image>What colour?", "images": [png(colour=colour)]},
            {"role": "assistant", "content": "red"},
        ]
        return template.encode(messages)

    red, blue = row((200, 30, 30)), row((30, 30, 200))
    assert red["input_ids"] == blue["input_ids"]  # same text, same image size: only the pixels differ
    labels = torch.tensor([red["labels"]])
    with torch.no_grad():
        out_red = model(**_batch(red), labels=labels)
        out_blue = model(**_batch(blue))
    assert torch.isfinite(out_red.loss)
    # the loss the model reports is the mean cross-entropy over the supervised (reply) tokens
    logits, targets = out_red.logits[0, :-1], labels[0, 1:]
    assert torch.allclose(out_red.loss, F.cross_entropy(logits, targets, ignore_index=-100), atol=1e-5)
    reply = (targets != -100).nonzero().flatten()
    assert not torch.allclose(out_red.logits[0, reply], out_blue.logits[0, reply])
