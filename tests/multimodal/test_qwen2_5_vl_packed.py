"""Qwen2.5-VL and Qwen2-VL image rows run packed into one row (``twinkle.model.vision_packing``):
the packed forward's logits at every kept token, the loss and the labels' log-probabilities equal
Hugging Face's own padded forward with the images (CE and fused CE), and a packed step's LoRA
gradients equal a padded step's. The Qwen2.5-VL checkpoint here has a windowed vision block
before its full-attention one, so the tower's windows run; the tower's blocks never receive the
language row's segments. An image after a row's last reply is left out; a video placeholder in a
row is one line."""

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tolerances import chain_tolerances, llama_sums

from twinkle.model import forward as forward_module
from twinkle.model.vision_positions import token_types
from twinkle.processor.collate import collate
from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100
TEMPLATE = "Qwen2_5VLTemplate"
# text 32 wide, 64 in the MLP, 2 layers; a 2-block tower 32 wide (tiny_vl.py's sizes, one more block)
TEXT, VISION = dict(hidden=32, intermediate=64, layers=2), dict(hidden=32, intermediate=64, layers=2)
CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}


def _reseed(folder, config, model_class):
    torch.manual_seed(1)
    model_class(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random Qwen2.5-VL (block 0 windowed, block 1 full attention) and Qwen2-VL
    checkpoints with ``tiny_vl.py``'s tokenizer and image processor."""
    from tiny_vl import build_tiny_vl
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    windowed = build_tiny_vl(tmp_path_factory.mktemp("qwen2_5_vl"))
    config = Qwen2_5_VLConfig.from_pretrained(windowed)
    config.vision_config.depth = 2
    config.vision_config.fullatt_block_indexes = [1]  # block 0 attends within 2x2-token windows
    _reseed(windowed, config, Qwen2_5_VLForConditionalGeneration)

    older = build_tiny_vl(tmp_path_factory.mktemp("qwen2_vl"))
    text = json.loads((windowed / "config.json").read_text())["text_config"]
    tokens = {k: getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id")}
    qwen2 = Qwen2VLConfig(
        text_config={
            k: text[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "rope_parameters",
                "eos_token_id",
                "pad_token_id",
            )
        },
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            mlp_ratio=2,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        vision_end_token_id=config.vision_end_token_id,
        **tokens,
    )
    for stale in older.glob("*.safetensors"):
        stale.unlink()
    (older / "config.json").unlink()
    _reseed(older, qwen2, Qwen2VLForConditionalGeneration)
    return {"qwen2_5_vl": windowed, "qwen2_vl": older}


def picture(size, seed):
    """PNG bytes of random pixels: every patch differs, so an image's features placed at another
    image's tokens (or in another order) change the logits."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(template, text, reply, images, later=None):
    messages = [
        {"role": "user", "content": "<image>" * len(images) + text, **({"images": images} if images else {})}
    ]
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    if later is not None:  # a user turn after the reply, with an image: the row's tail
        messages.append({"role": "user", "content": "<image>" + later[0], "images": [later[1]]})
    return template.encode(messages)


def _rows(folder):
    """Four rows: images of four sizes (one row holds two), and a text-only row between them."""
    template = get_template(TEMPLATE, str(folder))
    return [
        _row(template, "What is it?", "a cat", [picture((32, 32), 1)]),
        _row(template, "Say hello.", "hello there", []),
        _row(template, "Which is bigger?", "the second", [picture((48, 32), 2), picture((64, 48), 3)]),
        _row(template, "Colour?", "blue", [picture((32, 48), 4)]),
    ]


def _model(folder, family, padding_free=True):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(str(folder), model_cls=CLASSES[family], padding_free=padding_free)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    model.set_template(TEMPLATE, model_id=str(folder))
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
    """The padded forward's summed CE of the supervised tokens, each label's log-probability
    (0 where none, aligned with the labels) and the number of supervised tokens."""
    logits = _hf_logits(hf_model, batch)
    targets = batch["labels"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
    logp = logits[:, :-1].log_softmax(-1)
    taken = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0].masked_fill(targets == IGNORE, 0.0)
    logps = torch.cat([torch.zeros_like(taken[:, :1]), taken], dim=1)
    loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
    return loss_sum, logps, int((targets != IGNORE).sum())


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
        calls.append(real(lm, batch))
        return calls[-1]

    monkeypatch.setattr(forward_module, "pack_images", recording)
    return calls


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_the_packed_row_has_every_kept_tokens_logits(checkpoints, family):
    rows = _rows(checkpoints[family])
    lm = forward_module.causal_lm_of(_model(checkpoints[family], family).model).eval()
    batch = collate(rows, pad_token_id=0)
    inputs, _, gather = forward_module._model_inputs(lm, dict(batch), True, True)
    length = inputs["input_ids"].shape[1]
    assert gather is None and inputs["position_ids"].shape == (4, 1, length)
    assert length < batch["attention_mask"].sum()  # each row's tail after its reply is left out
    assert torch.equal(inputs["pixel_values"], batch["pixel_values"])  # every image kept, in order
    where = forward_module.pack_images(lm, dict(batch))["where"]
    with torch.no_grad():
        ours = lm(**inputs, use_cache=False).logits.float()[0]
        reference = _hf_logits(lm, batch)
    kept = where >= 0
    assert int(kept.sum()) == length
    expected = reference[kept]
    torch.testing.assert_close(ours[where[kept]], expected, **_tolerances(batch, expected))


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_packed_loss_and_logps_equal_hf_padded_forward(checkpoints, family, loss, packed_calls):
    rows = _rows(checkpoints[family])
    model = _model(checkpoints[family], family)
    model.set_loss(loss)
    out = model.forward_only(inputs=rows)
    assert packed_calls and packed_calls[-1] is not None and "pixel_values" in packed_calls[-1]
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        loss_sum, logps, count = _hf_reference(model.model.eval(), batch)
    expected = loss_sum / count
    torch.testing.assert_close(torch.as_tensor(float(out["loss"])), expected, **_tolerances(batch, expected))
    if loss == "CrossEntropyLoss":
        torch.testing.assert_close(out["logps"].float(), logps, **_tolerances(batch, logps))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"])
def test_a_packed_step_has_the_padded_steps_loss_and_lora_gradients(checkpoints, loss, packed_calls):
    folder = checkpoints["qwen2_5_vl"]
    rows = _rows(folder)
    results = []
    for padding_free in (True, False):
        model = _model(folder, "qwen2_5_vl", padding_free=padding_free)
        model.set_loss(loss)
        results.append((float(model.forward_backward(inputs=rows)), _grads(model)))
    assert len(packed_calls) == 1  # the packed model's step only
    (packed, packed_grads), (padded, padded_grads) = results
    batch = collate(rows, pad_token_id=0)
    assert packed == pytest.approx(padded, rel=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and packed_grads
    assert all("lora_" in n and ".visual." not in n for n in packed_grads)
    for name, grad in packed_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, padded_grads[name], **_tolerances(batch, padded_grads[name]))


def test_the_vision_blocks_get_their_own_segments_not_the_rows(checkpoints):
    """Each vision block attends within its own segments (block 0: windows inside each image;
    block 1: each whole image), worked out from the grids; the language row's never reach it."""
    folder = checkpoints["qwen2_5_vl"]
    rows = _rows(folder)
    model = _model(folder, "qwen2_5_vl")
    visual = forward_module.causal_lm_of(model.model).model.visual
    seen = []

    def record(module, args, kwargs):
        seen.append((sorted(kwargs), kwargs["cu_seqlens"].tolist()))

    handles = [block.register_forward_pre_hook(record, with_kwargs=True) for block in visual.blocks]
    try:
        model.forward_only(inputs=rows)
    finally:
        for handle in handles:
            handle.remove()
    batch = collate(rows, pad_token_id=0)
    patches = batch["image_grid_thw"].prod(dim=1).cumsum(0).tolist()
    assert len(seen) == 2 and all("twinkle_segments" not in keys for keys, _ in seen)
    windows, whole = seen[0][1], seen[1][1]
    assert whole == [0, *patches]
    assert set(patches) <= set(windows) and len(windows) > len(whole)  # windows split each image


def test_an_image_in_a_rows_tail_is_left_out(checkpoints, packed_calls):
    folder = checkpoints["qwen2_5_vl"]
    template = get_template(TEMPLATE, str(folder))
    rows = [
        _row(
            template,
            "What is it?",
            "a cat",
            [picture((32, 32), 5)],
            later=("And this?", picture((48, 48), 6)),
        ),
        _row(template, "No reply here.", None, [picture((48, 32), 7)]),
        _row(template, "Colour?", "blue", [picture((32, 48), 8)]),
    ]
    batch = collate(rows, pad_token_id=0)
    assert batch["image_counts"].tolist() == [2, 1, 1]
    model = _model(folder, "qwen2_5_vl")
    out = model.forward_only(inputs=rows)
    grids = packed_calls[-1]["image_grid_thw"]
    assert grids.tolist() == [batch["image_grid_thw"][0].tolist(), batch["image_grid_thw"][3].tolist()]
    with torch.no_grad():
        loss_sum, logps, count = _hf_reference(model.model.eval(), batch)
    expected = loss_sum / count
    torch.testing.assert_close(torch.as_tensor(float(out["loss"])), expected, **_tolerances(batch, expected))
    torch.testing.assert_close(out["logps"].float(), logps, **_tolerances(batch, logps))


def test_a_video_placeholder_in_a_row_is_one_line(checkpoints):
    folder = checkpoints["qwen2_5_vl"]
    model = _model(folder, "qwen2_5_vl")
    row = dict(_rows(folder)[0])
    video = forward_module.causal_lm_of(model.model).config.video_token_id
    row["input_ids"] = [*row["input_ids"][:2], video, *row["input_ids"][3:]]
    with pytest.raises(UserError, match=r"^batch row\(s\) \[0\] hold the video placeholder token") as info:
        model.forward_only(inputs=[row])
    assert "\n" not in str(info.value)
