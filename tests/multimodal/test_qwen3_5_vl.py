"""Qwen3.5's vision path on a tiny random checkpoint (``tiny_qwen3_5_vl.py``: a vision tower in
front of a language model of one linear-attention and one full-attention layer).

- upstream's ``Qwen3_5Template`` on the checkpoint encodes images (Qwen3-VL's rows);
- ``TransformersModel`` trains it on image rows packed into one row
  (``twinkle.model.vision_packing``, its linear-attention layers run per sample:
  ``twinkle.model.linear_attention_packing``): the logits at every kept token, the loss, the
  labels' log-probabilities and the LoRA gradients equal Hugging Face's padded forward with the
  images, and a padded step's; run across the samples, the linear-attention layers would not;
- the saved adapter loads in ``peft`` on ``Qwen3_5ForConditionalGeneration`` and gives our logits;
- ``TorchSampler``'s greedy tokens with an image equal ``generate``'s, and follow the pixels."""

import pytest
import torch
import torch.nn.functional as F
from tiny_qwen3_5_vl import MODEL_CLS, build_tiny_qwen3_5_vl
from tiny_qwen3_vl import picture
from tolerances import chain_tolerances, llama_sums

from twinkle.data_format import SamplingParams
from twinkle.model import forward as forward_module
from twinkle.model.vision_positions import token_types
from twinkle.processor.collate import collate
from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100
TEXT, VISION = dict(hidden=32, intermediate=64, layers=2), dict(hidden=32, intermediate=64, layers=2)
RED, GREEN, BLUE = (200, 30, 30), (30, 200, 30), (30, 30, 200)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-qwen3-5-vl"))


def _row(template, text, reply, images):
    content = "<image>" * len(images) + text
    messages = [{"role": "user", "content": content, **({"images": images} if images else {})}]
    return template.encode([*messages, {"role": "assistant", "content": reply}])


@pytest.fixture(scope="module")
def rows(tiny_dir):
    template = get_template("Qwen3_5Template", str(tiny_dir))
    return [
        _row(template, "What colour?", "red", [picture((64, 64), RED)]),
        _row(template, "Say hello.", "hello there", []),
        _row(
            template, "Which is bigger?", "the second", [picture((96, 64), GREEN), picture((128, 96), BLUE)]
        ),
    ]


def _model(tiny_dir, padding_free=True):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(str(tiny_dir), model_cls=MODEL_CLS, padding_free=padding_free)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    model.set_template("Qwen3_5Template", model_id=str(tiny_dir))
    return model


def _hf_logits(hf_model, batch):
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
    logps = torch.cat([torch.zeros_like(taken[:, :1]), taken], dim=1)
    loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
    return logits, loss_sum, logps, int((targets != IGNORE).sum())


def _tolerances(batch, reference):
    """Two fp32 orders of the language model's sums over the padded rows (the linear-attention
    layer's chunked scan is counted as an attention layer's sums over the row) and the vision
    tower's over the patches."""
    tokens, patches = batch["input_ids"].shape[1], batch["pixel_values"].shape[0]
    sums = llama_sums(**TEXT, tokens=tokens, vocab=700) + llama_sums(**VISION, tokens=patches)
    return chain_tolerances(sums + [batch["input_ids"].numel()], reference)


def test_upstreams_qwen3_5_template_encodes_images_on_the_checkpoint(tiny_dir, rows):
    from twinkle.template.qwen3_vl import Qwen3VLTemplate

    template = get_template("Qwen3_5Template", str(tiny_dir))
    assert type(template) is Qwen3VLTemplate
    image_id = template.image_token_id
    # 16-pixel patches merged 2x2: 64x64 -> 4 tokens; 96x64 -> 6; 128x96 -> 12
    assert [sum(t == image_id for t in r["input_ids"]) for r in rows] == [4, 0, 18]
    assert rows[0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert all(
        label == IGNORE
        for t, label in zip(rows[0]["input_ids"], rows[0]["labels"], strict=True)
        if t == image_id
    )
    with pytest.raises(UserError, match=r"is a Qwen3.5 model .* use --template-cls Qwen3VLTemplate"):
        get_template("Qwen2_5VLTemplate", str(tiny_dir))


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
    model = _model(tiny_dir)
    lm = forward_module.causal_lm_of(model.model).eval()
    batch = collate(rows, pad_token_id=0)
    inputs, _, _ = forward_module._model_inputs(lm, dict(batch), True, True)
    assert inputs["position_ids"].shape == (4, 1, inputs["input_ids"].shape[1])
    where = forward_module.pack_images(lm, dict(batch))["where"]
    kept = where >= 0
    with torch.no_grad():
        ours = lm(**inputs, use_cache=False).logits.float()[0][where[kept]]
        expected = _hf_logits(lm, batch)[kept]
    torch.testing.assert_close(ours, expected, **_tolerances(batch, expected))


def test_the_linear_attention_layers_must_run_per_sample(tiny_dir, rows, monkeypatch):
    """Run across the packed row's samples, the linear-attention layers give other logits than
    the padded forward's: the check above sees the samples' boundaries."""
    import twinkle.model.vision_packing as vision_packing

    monkeypatch.setattr(vision_packing, "run_per_sample", lambda lm: None)
    model = _model(tiny_dir)
    lm = forward_module.causal_lm_of(model.model).eval()
    batch = collate(rows, pad_token_id=0)
    inputs, _, _ = forward_module._model_inputs(lm, dict(batch), True, True)
    where = forward_module.pack_images(lm, dict(batch))["where"]
    kept = where >= 0
    with torch.no_grad():
        ours = lm(**inputs, use_cache=False).logits.float()[0][where[kept]]
        expected = _hf_logits(lm, batch)[kept]
    assert (ours - expected).abs().max() > 1e3 * _tolerances(batch, expected)["atol"]


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


def test_the_pixels_and_positions_reach_the_loss(tiny_dir, rows):
    """Other pixels, or plain positions instead of M-RoPE, change the loss: the check above sees
    both."""
    model = _model(tiny_dir)
    base = float(model.forward_only(inputs=rows[:1])["loss"])
    other = dict(rows[0], pixel_values=rows[0]["pixel_values"].flip(0))
    assert abs(float(model.forward_only(inputs=[other])["loss"]) - base) > 1e-4
    batch = collate(rows[:1], pad_token_id=0)
    with torch.no_grad():
        plain = model.model.eval()(
            input_ids=batch["input_ids"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            position_ids=torch.arange(batch["input_ids"].shape[1])[None],
        ).logits
        rope = _hf_logits(model.model, batch)
    assert (plain - rope).abs().max() > 1e-3


def test_a_packed_step_has_the_padded_steps_loss_and_gradients(tiny_dir, rows):
    results = []
    for padding_free in (True, False):
        model = _model(tiny_dir, padding_free=padding_free)
        value = float(model.forward_backward(inputs=rows))
        grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
        results.append((value, grads))
    (packed, packed_grads), (padded, padded_grads) = results
    batch = collate(rows, pad_token_id=0)
    assert packed == pytest.approx(padded, rel=1e-5)
    assert any("linear_attn" in n for n in packed_grads) and not any(".visual." in n for n in packed_grads)
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], **_tolerances(batch, padded_grads[name]))


def test_the_saved_adapter_loads_in_peft_and_gives_our_logits(tiny_dir, rows, tmp_path):
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    model = _model(tiny_dir)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(3):
        losses.append(float(model.forward_backward(inputs=rows)))
        model.clip_grad_and_step()
    assert losses[-1] < losses[0], losses
    ours = model.forward_only(inputs=rows)["logps"]
    folder = model.save("trained", output_dir=str(tmp_path), save_optimizer=False)
    base = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        logits, _, logps, _ = _hf_reference(peft_model, batch)
        again = _hf_logits(model.model.eval(), batch)
    torch.testing.assert_close(ours.float(), logps, **_tolerances(batch, logps))
    torch.testing.assert_close(again, logits, **_tolerances(batch, logits))


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    from twinkle.sampler import TorchSampler

    sharp = build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("sharp-qwen3-5-vl"), scale=6.0)
    sampler = TorchSampler(str(sharp), model_cls=MODEL_CLS, dtype=torch.float32)
    sampler.set_template("Qwen3_5Template", model_id=str(sharp))
    return sampler


def _prompt(text, *images):
    content = "<image>" * len(images) + text
    return {
        "messages": [{"role": "user", "content": content, **({"images": list(images)} if images else {})}]
    }


def test_greedy_sampling_with_an_image_equals_hf_generate(sampler):
    prompts = [
        _prompt("What colour?", picture((64, 64), RED)),
        _prompt("Say hello."),
        _prompt("What colour?", picture((64, 96), BLUE)),
    ]
    responses = sampler.sample(prompts, SamplingParams(max_tokens=8, temperature=0))
    for response in responses:
        seq = response.sequences[0]
        feature = seq.new_input_feature
        ids = torch.tensor([response.prompt_token_ids])
        images = {}
        if "pixel_values" in feature:
            images = dict(
                pixel_values=torch.as_tensor(feature["pixel_values"]),
                image_grid_thw=torch.as_tensor(feature["image_grid_thw"]),
                mm_token_type_ids=token_types(sampler.lm, ids),
            )
        with torch.no_grad():
            out = sampler.lm.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **images)
        assert seq.tokens == out[0, ids.shape[1] :].tolist()
        assert len(set(seq.tokens)) > 2
    assert "pixel_values" in responses[0].sequences[0].new_input_feature
    assert responses[0].sequences[0].tokens != responses[2].sequences[0].tokens  # the pixels count
