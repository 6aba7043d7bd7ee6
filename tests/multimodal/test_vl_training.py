"""``TransformersModel`` trains a vision-language model on image rows: a batch of rows with
images of different sizes and a text-only row gives the loss and ``logps`` of Hugging Face's own
padded forward (which runs the vision tower and places each image's features at its tokens), in
one call or in parts of rows (``micro_batch_size``); LoRA lands on the language model by default;
a step lowers the loss; the saved adapter loads in ``peft`` on the VL class and gives the same
logits; a packed row with images is refused in one line."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import chain_tolerances, llama_sums

from twinkle.processor.collate import collate
from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100
# the tiny VL's sizes (tiny_vl.py): text 32 wide, 64 in the MLP, 2 layers; a 1-block vision tower
TEXT, VISION = dict(hidden=32, intermediate=64, layers=2), dict(hidden=32, intermediate=64, layers=1)


def _rows(template, png):
    """Four rows: images of three sizes (one row holds two), and a text-only row between them."""

    def row(text, reply, images):
        content = "<image>" * len(images) + text
        message = {"role": "user", "content": content, **({"images": images} if images else {})}
        return template.encode([message, {"role": "assistant", "content": reply}])

    return [
        row("What colour?", "red", [png((32, 32), (200, 30, 30))]),
        row("Say hello.", "hello there", []),
        row("Which is bigger?", "the second", [png((48, 32), (30, 200, 30)), png((64, 48), (30, 30, 200))]),
        row("Colour?", "blue", [png((32, 48), (30, 30, 200))]),
    ]


def _token_types(hf_model, batch):
    """``mm_token_type_ids`` as Qwen2.5-VL's processor writes them: 1 at the image tokens."""
    return (batch["input_ids"] == hf_model.config.image_token_id).int()


def _hf_reference(hf_model, batch):
    """Hugging Face's padded forward with the images: logits, the summed CE of the supervised
    tokens and each label's log-probability (0 where none)."""
    logits = hf_model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        # as the processor's rows: which tokens are an image's (its M-RoPE positions)
        mm_token_type_ids=_token_types(hf_model, batch),
    ).logits.float()
    targets = batch["labels"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
    logp = logits[:, :-1].log_softmax(-1)
    taken = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0].masked_fill(targets == IGNORE, 0.0)
    logps = torch.cat([torch.zeros_like(taken[:, :1]), taken], dim=1)  # aligned with the labels
    loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
    return logits, loss_sum, logps, int((targets != IGNORE).sum())


def _tolerances(batch, reference):
    """The chain of fp32 sums of the language model over the padded rows, the vision tower over
    the patches, and the head's softmax and a weight's gradient (``tolerances.chain_tolerances``)."""
    tokens, patches = batch["input_ids"].shape[1], batch["pixel_values"].shape[0]
    sums = llama_sums(**TEXT, tokens=tokens, vocab=700) + llama_sums(**VISION, tokens=patches)
    return chain_tolerances(sums + [batch["input_ids"].numel()], reference)


def _model(tiny_vl_dir, lora=None):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(str(tiny_vl_dir), model_cls="Qwen2_5_VLForConditionalGeneration")
    lora = lora or LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    model.set_template("Qwen2_5VLTemplate", model_id=str(tiny_vl_dir))
    return model


@pytest.fixture(scope="module")
def rows(tiny_vl_dir):
    from vl_pictures import png_bytes

    return _rows(
        get_template("Qwen2_5VLTemplate", str(tiny_vl_dir)), lambda size, colour: png_bytes(size, colour)
    )


def test_the_batch_carries_each_rows_images_in_order(rows):
    batch = collate(rows, pad_token_id=0)
    assert batch["image_counts"].tolist() == [1, 0, 2, 1]
    assert batch["image_grid_thw"].shape == (4, 3)
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=1).sum())
    assert len({tuple(g) for g in batch["image_grid_thw"].tolist()}) == 4  # four image sizes


@pytest.mark.parametrize("micro_batch_size", [None, 1, 3])
def test_forward_only_equals_hf_padded_forward_with_images(tiny_vl_dir, rows, micro_batch_size):
    model = _model(tiny_vl_dir)
    out = model.forward_only(inputs=rows, micro_batch_size=micro_batch_size)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        _, loss_sum, logps, count = _hf_reference(model.model.eval(), batch)
    ours = out["logps"]
    torch.testing.assert_close(ours.float(), logps, **_tolerances(batch, logps))
    if micro_batch_size is None:  # parts record no evaluation loss (eval_parts.py)
        expected = loss_sum / count
        torch.testing.assert_close(
            torch.as_tensor(float(out["loss"])), expected, **_tolerances(batch, expected)
        )


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"])
def test_forward_backward_loss_and_a_lora_step(tiny_vl_dir, rows, loss):
    model = _model(tiny_vl_dir)
    model.set_loss(loss)
    batch = collate(rows, pad_token_id=0)
    model.model.eval()
    with torch.no_grad():
        _, loss_sum, _, count = _hf_reference(model.model, batch)
    model.set_optimizer("AdamW", lr=1e-2)
    first = model.forward_backward(inputs=rows)
    expected = loss_sum / count
    torch.testing.assert_close(torch.as_tensor(float(first)), expected, **_tolerances(batch, expected))
    model.clip_grad_and_step()
    losses = [float(first)]
    for _ in range(4):
        losses.append(float(model.forward_backward(inputs=rows)))
        model.clip_grad_and_step()
    assert losses[-1] < losses[0] - 0.1, losses
    # a split step carries each part's images: its loss is the whole batch's
    split = model.forward_backward(inputs=rows, micro_batch_size=1)
    whole = model.forward_only(inputs=rows)["loss"]
    assert float(split) == pytest.approx(float(whole), rel=1e-5)


def test_lora_lands_on_the_language_model_unless_asked(tiny_vl_dir):
    from peft import LoraConfig

    model = _model(tiny_vl_dir)
    lora = [n for n, _ in model.model.named_modules() if n.endswith("lora_A")]
    assert lora and not [n for n in lora if ".visual." in n]
    assert any(".language_model." in n for n in lora)
    asked = _model(tiny_vl_dir, LoraConfig(r=4, target_modules="all-linear", exclude_modules=[]))
    assert any(".visual." in n for n, _ in asked.model.named_modules() if n.endswith("lora_A"))


def test_the_saved_adapter_loads_in_peft_and_gives_our_logits(tiny_vl_dir, rows, tmp_path):
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = _model(tiny_vl_dir)
    model.set_optimizer("AdamW", lr=1e-2)
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step()
    ours = model.forward_only(inputs=rows)["logps"]
    folder = model.save("trained", output_dir=str(tmp_path), save_optimizer=False)
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_vl_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        logits, _, logps, _ = _hf_reference(peft_model, batch)
        again = model.model.eval()(
            **{k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")},
            mm_token_type_ids=_token_types(peft_model, batch),
        ).logits
    torch.testing.assert_close(ours.float(), logps, **_tolerances(batch, logps))
    torch.testing.assert_close(again.float(), logits, **_tolerances(batch, logits))


def test_a_packed_row_with_images_is_one_line(rows):
    a, b = rows[0], rows[3]
    packed = {
        "input_ids": a["input_ids"] + b["input_ids"],
        "labels": a["labels"] + b["labels"],
        "position_ids": list(range(len(a["input_ids"]))) + list(range(len(b["input_ids"]))),
        "pixel_values": torch.cat([torch.as_tensor(a["pixel_values"]), torch.as_tensor(b["pixel_values"])]),
        "image_grid_thw": torch.cat(
            [torch.as_tensor(a["image_grid_thw"]), torch.as_tensor(b["image_grid_thw"])]
        ),
    }
    with pytest.raises(UserError, match=r"^a packed row \(PackingDataset\) holds images") as info:
        collate([packed], pad_token_id=0)
    assert "\n" not in str(info.value)
