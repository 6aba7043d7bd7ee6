"""``TransformersModel`` trains Qwen3-VL on image rows packed into one row
(``twinkle.model.vision_packing``): the packed forward's logits at every kept token, the loss and
the labels' log-probabilities equal Hugging Face's own padded forward with the images (which runs
the vision tower, places each image's features and deepstack features at its tokens, and derives
the M-RoPE positions); so do the loss under the fused cross-entropy and the LoRA gradients of a
padded run; an image after a row's last reply, and a row without a reply, leave their images out
of the row; the saved adapter loads in ``peft`` on the VL class and gives our logits; rows encoded
for Qwen2.5-VL are one line."""

import pytest
import torch
import torch.nn.functional as F
from tiny_qwen3_vl import build_tiny_qwen3_vl, picture
from tolerances import chain_tolerances, llama_sums

from twinkle.model import forward as forward_module
from twinkle.model.vision_positions import token_types
from twinkle.processor.collate import collate
from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100
# the tiny Qwen3-VL's sizes (tiny_qwen3_vl.py): text 32 wide, 64 in the MLP, 2 layers; a 2-block tower
TEXT, VISION = dict(hidden=32, intermediate=64, layers=2), dict(hidden=32, intermediate=64, layers=2)
MODEL_CLS = "Qwen3VLForConditionalGeneration"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"))


def _row(template, text, reply, images, later=None):
    content = "<image>" * len(images) + text
    messages = [{"role": "user", "content": content, **({"images": images} if images else {})}]
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    if later is not None:  # a user turn after the reply, with an image: the row's tail
        messages.append({"role": "user", "content": "<image>" + later[0], "images": [later[1]]})
    return template.encode(messages)


@pytest.fixture(scope="module")
def rows(tiny_dir):
    """Four rows: images of four sizes (one row holds two), and a text-only row between them."""
    template = get_template("Qwen3VLTemplate", str(tiny_dir))
    return [
        _row(template, "What colour?", "red", [picture((64, 64), (200, 30, 30))]),
        _row(template, "Say hello.", "hello there", []),
        _row(
            template,
            "Which is bigger?",
            "the second",
            [picture((96, 64), (30, 200, 30)), picture((128, 96), (30, 30, 200))],
        ),
        _row(template, "Colour?", "blue", [picture((64, 96), (30, 90, 200))]),
    ]


def _model(tiny_dir, padding_free=True):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(str(tiny_dir), model_cls=MODEL_CLS, padding_free=padding_free)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    model.set_template("Qwen3VLTemplate", model_id=str(tiny_dir))
    return model


def _hf_logits(hf_model, batch):
    """Hugging Face's padded forward with the images, as its processor's rows run it."""
    return hf_model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        mm_token_type_ids=token_types(hf_model, batch["input_ids"]),
    ).logits.float()


def _hf_reference(hf_model, batch):
    """The padded forward's logits, summed CE of the supervised tokens, each label's
    log-probability (0 where none) and the number of supervised tokens."""
    logits = _hf_logits(hf_model, batch)
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


@pytest.fixture
def packed_calls(monkeypatch):
    """The packed rows the model's forward builds, recorded."""
    calls = []
    real = forward_module.pack_images

    def recording(lm, batch):
        out = real(lm, batch)
        calls.append(out)
        return out

    monkeypatch.setattr(forward_module, "pack_images", recording)
    return calls


def test_the_packed_row_has_every_kept_tokens_logits(tiny_dir, rows):
    """Every token the packed row keeps has the logits of its place in the padded batch."""
    model = _model(tiny_dir)
    lm = forward_module.causal_lm_of(model.model).eval()
    batch = collate(rows, pad_token_id=0)
    inputs, _, gather = forward_module._model_inputs(lm, dict(batch), True, True)
    assert gather is None and inputs["position_ids"].shape == (4, 1, inputs["input_ids"].shape[1])
    assert inputs["pixel_values"].shape == batch["pixel_values"].shape  # every image is kept
    where = forward_module.pack_images(lm, dict(batch))["where"]
    with torch.no_grad():
        ours = lm(**inputs, use_cache=False).logits.float()[0]
        reference = _hf_logits(lm, batch)
    kept = where >= 0
    assert int(kept.sum()) == inputs["input_ids"].shape[1]
    expected = reference[kept]
    torch.testing.assert_close(ours[where[kept]], expected, **_tolerances(batch, expected))


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"])
def test_packed_loss_and_logps_equal_hf_padded_forward(tiny_dir, rows, loss, packed_calls):
    model = _model(tiny_dir)
    model.set_loss(loss)
    out = model.forward_only(inputs=rows)
    assert packed_calls and packed_calls[-1] is not None and "pixel_values" in packed_calls[-1]
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        _, loss_sum, logps, count = _hf_reference(model.model.eval(), batch)
    expected = loss_sum / count
    torch.testing.assert_close(torch.as_tensor(float(out["loss"])), expected, **_tolerances(batch, expected))
    if loss == "CrossEntropyLoss":
        torch.testing.assert_close(out["logps"].float(), logps, **_tolerances(batch, logps))


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_parts_of_the_batch_carry_their_images(tiny_dir, rows, micro_batch_size, packed_calls):
    """Each part runs packed with its own rows' images (a part of text rows only has none)."""
    model = _model(tiny_dir)
    out = model.forward_only(inputs=rows, micro_batch_size=micro_batch_size)
    images = [0 if p is None or "pixel_values" not in p else len(p["image_grid_thw"]) for p in packed_calls]
    assert images == ([1, 0, 2, 1] if micro_batch_size == 1 else [3, 1])
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        _, _, logps, _ = _hf_reference(model.model.eval(), batch)
    torch.testing.assert_close(out["logps"].float(), logps, **_tolerances(batch, logps))


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"])
def test_a_packed_step_has_the_padded_steps_loss_and_gradients(tiny_dir, rows, loss):
    results = []
    for padding_free in (True, False):
        model = _model(tiny_dir, padding_free=padding_free)
        model.set_loss(loss)
        value = float(model.forward_backward(inputs=rows))
        results.append((value, _lora_grads(model)))
    (packed, packed_grads), (padded, padded_grads) = results
    batch = collate(rows, pad_token_id=0)
    assert packed == pytest.approx(padded, rel=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and any(".visual." not in n for n in packed_grads)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], **_tolerances(batch, padded_grads[name]))


def test_images_in_a_rows_tail_and_in_a_row_without_a_reply_are_left_out(tiny_dir, packed_calls):
    template = get_template("Qwen3VLTemplate", str(tiny_dir))
    tail = ("And this one?", picture((64, 64), (90, 90, 30)))
    rows = [
        _row(template, "What colour?", "red", [picture((64, 64), (200, 30, 30))], later=tail),
        _row(template, "No reply here.", None, [picture((96, 64), (30, 200, 30))]),
        _row(template, "Colour?", "blue", [picture((64, 96), (30, 90, 200))]),
    ]
    batch = collate(rows, pad_token_id=0)
    assert batch["image_counts"].tolist() == [2, 1, 1]
    model = _model(tiny_dir)
    out = model.forward_only(inputs=rows)
    grids = packed_calls[-1]["image_grid_thw"]
    assert grids.tolist() == [batch["image_grid_thw"][0].tolist(), batch["image_grid_thw"][3].tolist()]
    with torch.no_grad():
        _, loss_sum, logps, count = _hf_reference(model.model.eval(), batch)
    expected = loss_sum / count
    torch.testing.assert_close(torch.as_tensor(float(out["loss"])), expected, **_tolerances(batch, expected))
    torch.testing.assert_close(out["logps"].float(), logps, **_tolerances(batch, logps))


def test_the_saved_adapter_loads_in_peft_and_gives_our_logits(tiny_dir, rows, tmp_path):
    from peft import PeftModel
    from transformers import Qwen3VLForConditionalGeneration

    model = _model(tiny_dir)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(3):
        losses.append(float(model.forward_backward(inputs=rows)))
        model.clip_grad_and_step()
    assert losses[-1] < losses[0], losses
    ours = model.forward_only(inputs=rows)["logps"]
    folder = model.save("trained", output_dir=str(tmp_path), save_optimizer=False)
    base = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        logits, _, logps, _ = _hf_reference(peft_model, batch)
        again = _hf_logits(model.model.eval(), batch)
    torch.testing.assert_close(ours.float(), logps, **_tolerances(batch, logps))
    torch.testing.assert_close(again, logits, **_tolerances(batch, logits))


def test_rows_encoded_for_qwen2_5_vl_are_one_line(tiny_dir, rows):
    model = _model(tiny_dir)
    row = dict(rows[0])
    patches = row["pixel_values"].shape[0]
    row["pixel_values"] = torch.zeros(patches, 3 * 2 * 14 * 14)  # Qwen2.5-VL's 14-pixel patches
    for padding_free in (True, False):
        model.padding_free = padding_free
        with pytest.raises(UserError, match=r"patches of 1176 values, but .* takes 1536") as info:
            model.forward_only(inputs=[row])
        assert "\n" not in str(info.value)
