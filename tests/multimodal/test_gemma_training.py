"""``TransformersModel`` trains Gemma 3 and Gemma 4 on image rows (tiny random checkpoints,
``tiny_gemma_vl.py``): the loss and ``logps`` equal Hugging Face's own padded forward given the
processor's inputs (the token types included, under each family's name), in one call and in parts
of rows; without the token types the logits differ (image tokens attend both ways), so the check
has power. LoRA lands on the language model by default; a step lowers the loss; the saved adapter
loads in ``peft`` on the VL class and gives our logits; a packed row with images and rows of
another family are one line each.

Gemma 4's checkpoint soft-caps its logits (as the released ones do): the loss runs the real head."""

import pytest
import torch
import torch.nn.functional as F
from tiny_gemma_vl import BUILDERS, TEMPLATES, conversation_rows
from tolerances import chain_tolerances, llama_sums

from twinkle.processor.collate import collate
from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100
CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
TOKEN_TYPES = {"gemma3": "token_type_ids", "gemma4": "mm_token_type_ids"}


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def family(request, tmp_path_factory):
    """``(model_type, folder, rows)``: a tiny checkpoint of each family and its three rows."""
    model_type = request.param
    folder = BUILDERS[model_type](tmp_path_factory.mktemp(model_type))
    return model_type, folder, conversation_rows(get_template(TEMPLATES[model_type], str(folder)))


def _processor_inputs(model_type, hf_model, batch, token_types=True):
    """What the family's processor hands the model for ``batch``: the pixels (and Gemma 4's patch
    positions) and the token types, 1 at the image tokens."""
    inputs = {
        k: batch[k]
        for k in ("input_ids", "attention_mask", "pixel_values", "image_position_ids")
        if k in batch
    }
    if token_types:
        inputs[TOKEN_TYPES[model_type]] = (batch["input_ids"] == hf_model.config.image_token_id).long()
    return inputs


def _hf_reference(model_type, hf_model, batch, token_types=True):
    """Hugging Face's padded forward: logits, the mean CE of the supervised tokens, each label's
    log-probability (0 where none)."""
    logits = hf_model(**_processor_inputs(model_type, hf_model, batch, token_types)).logits.float()
    targets = batch["labels"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
    taken = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    taken = taken.masked_fill(targets == IGNORE, 0.0)
    logps = torch.cat([torch.zeros_like(taken[:, :1]), taken], dim=1)  # aligned with the labels
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
    return logits, loss / (targets != IGNORE).sum(), logps


def _tolerances(batch, reference):
    """The chain of fp32 sums: the language model over the padded rows, the vision tower over an
    image's patches (its patch embedding, 48 terms, and projection), the head's softmax and a
    weight's gradient (``tolerances.chain_tolerances``)."""
    tokens = batch["input_ids"].shape[1]
    pixels = batch["pixel_values"]
    patches = pixels.shape[1] if pixels.dim() == 3 else (pixels.shape[-1] // 4) ** 2
    sums = llama_sums(32, 64, 2, tokens=tokens, vocab=700) + llama_sums(32, 64, 1, tokens=patches) + [48, 32]
    return chain_tolerances(sums + [batch["input_ids"].numel()], reference)


def _model(model_type, folder, lora=None):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(str(folder), model_cls=CLASSES[model_type])
    lora = lora or LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    model.set_template(TEMPLATES[model_type], model_id=str(folder))
    return model


def test_the_batch_carries_each_rows_images(family):
    model_type, _, rows = family
    batch = collate(rows, pad_token_id=0)
    assert batch["image_counts"].tolist() == [1, 0, 2]
    assert batch["pixel_values"].shape[0] == 3  # one entry per image
    assert ("image_position_ids" in batch) == (model_type == "gemma4")
    assert "image_grid_thw" not in batch


@pytest.mark.parametrize("micro_batch_size", [None, 1])
def test_forward_only_equals_hf_padded_forward_with_images(family, micro_batch_size):
    model_type, folder, rows = family
    model = _model(model_type, folder)
    out = model.forward_only(inputs=rows, micro_batch_size=micro_batch_size)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        _, loss, logps = _hf_reference(model_type, model.model.eval(), batch)
        _, _, causal = _hf_reference(model_type, model.model, batch, token_types=False)
    tolerances = _tolerances(batch, logps)
    torch.testing.assert_close(out["logps"].float(), logps, **tolerances)
    # the check has power: run causally (no token types) the image rows' log-probs move far more
    assert float((causal - logps).abs().max()) > 10 * tolerances["atol"]
    if micro_batch_size is None:  # parts record no evaluation loss (eval_parts.py)
        torch.testing.assert_close(torch.as_tensor(float(out["loss"])), loss, **_tolerances(batch, loss))


@pytest.mark.parametrize("loss_name", ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"])
def test_forward_backward_loss_and_a_lora_step(family, loss_name):
    model_type, folder, rows = family
    model = _model(model_type, folder)
    model.set_loss(loss_name)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        _, expected, _ = _hf_reference(model_type, model.model.eval(), batch)
    model.set_optimizer("AdamW", lr=1e-2)
    first = model.forward_backward(inputs=rows)
    torch.testing.assert_close(torch.as_tensor(float(first)), expected, **_tolerances(batch, expected))
    model.clip_grad_and_step()
    losses = [float(first)]
    for _ in range(3):
        losses.append(float(model.forward_backward(inputs=rows)))
        model.clip_grad_and_step()
    assert losses[-1] < losses[0] - 0.1, losses
    split = model.forward_backward(inputs=rows, micro_batch_size=1)  # each part carries its images
    whole = model.forward_only(inputs=rows)["loss"]
    assert float(split) == pytest.approx(float(whole), rel=1e-5)


def test_lora_lands_on_the_language_model_unless_asked(family):
    from peft import LoraConfig

    model_type, folder, _ = family
    lora = [n for n, _ in _model(model_type, folder).model.named_modules() if n.endswith("lora_A")]
    assert lora and all(".language_model." in n for n in lora), lora
    asked = _model(model_type, folder, LoraConfig(r=4, target_modules="all-linear", exclude_modules=[]))
    assert any(".vision_tower." in n for n, _ in asked.model.named_modules() if n.endswith("lora_A"))


def test_the_saved_adapter_loads_in_peft_and_gives_our_logits(family, tmp_path):
    import transformers
    from peft import PeftModel

    model_type, folder, rows = family
    model = _model(model_type, folder)
    model.set_optimizer("AdamW", lr=1e-2)
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step()
    ours = model.forward_only(inputs=rows)["logps"]
    saved = model.save("trained", output_dir=str(tmp_path), save_optimizer=False)
    base = getattr(transformers, CLASSES[model_type]).from_pretrained(str(folder), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(saved)).eval()
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        logits, _, logps = _hf_reference(model_type, peft_model, batch)
        again = model.model.eval()(**_processor_inputs(model_type, peft_model, batch)).logits
    torch.testing.assert_close(ours.float(), logps, **_tolerances(batch, logps))
    torch.testing.assert_close(again.float(), logits, **_tolerances(batch, logits))


def test_a_packed_row_with_images_is_one_line(family):
    _, _, rows = family
    a, b = rows[0], rows[2]
    packed = {
        "input_ids": a["input_ids"] + b["input_ids"],
        "labels": a["labels"] + b["labels"],
        "position_ids": list(range(len(a["input_ids"]))) + list(range(len(b["input_ids"]))),
        "pixel_values": torch.cat([torch.as_tensor(a["pixel_values"]), torch.as_tensor(b["pixel_values"])]),
    }
    with pytest.raises(UserError, match=r"^a packed row \(PackingDataset\) holds images") as info:
        collate([packed], pad_token_id=0)
    assert "\n" not in str(info.value)


def test_rows_of_another_family_are_one_line(family, tiny_vl_dir):
    model_type, folder, _ = family
    model = _model(model_type, folder)
    from vl_pictures import png_bytes

    qwen = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))
    message = {"role": "user", "content": "<image>Colour?", "images": [png_bytes()]}
    row = qwen.encode([message, {"role": "assistant", "content": "red"}])
    with pytest.raises(UserError, match="the rows were encoded for another model family") as info:
        model.forward_only(inputs=[row])
    assert "\n" not in str(info.value)


def test_text_prompts_sample(family):
    """Text prompts sample on the VL checkpoint (its images: ``test_gemma_sampling.py``)."""
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    model_type, folder, _ = family
    sampler = TorchSampler(str(folder))
    sampler.set_template(TEMPLATES[model_type], model_id=str(folder))
    out = sampler.sample(
        [{"messages": [{"role": "user", "content": "Say hello."}]}], SamplingParams(max_tokens=3)
    )
    assert 1 <= len(out[0].sequences[0].tokens) <= 3


def test_kernelize_keeps_the_logits(family):
    """No kernel is registered for the Gemma families (their norms scale by 1 + w): ``kernelize``
    must leave the forward as it is."""
    import copy

    import transformers

    from twinkle.kernel import DEFAULT_KERNEL_CONFIG, kernelize

    model_type, folder, rows = family
    plain = (
        getattr(transformers, CLASSES[model_type]).from_pretrained(str(folder), dtype=torch.float32).eval()
    )
    kernelized = copy.deepcopy(plain)
    kernelize(kernelized, DEFAULT_KERNEL_CONFIG)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        expected = plain(**_processor_inputs(model_type, plain, batch)).logits
        got = kernelized(**_processor_inputs(model_type, kernelized, batch)).logits
    torch.testing.assert_close(got, expected, **_tolerances(batch, expected))


def test_gemma_rows_on_a_qwen_model_are_one_line(family, tiny_vl_dir):
    from twinkle.model import TransformersModel

    _, _, rows = family
    model = TransformersModel(str(tiny_vl_dir), model_cls="Qwen2_5_VLForConditionalGeneration")
    for padding_free in (True, False):  # the packed path and the padded one
        model.padding_free = padding_free
        with pytest.raises(UserError, match="carry no image_grid_thw.*encoded for a Gemma model") as info:
            model.forward_only(inputs=rows)
        assert "\n" not in str(info.value)
