"""``kernelize`` on the Qwen vision-language families: the language model's norms, MLPs and (for
Qwen2-VL and Qwen2.5-VL) attention get the kernels their text families get, Qwen2.5-VL's vision
tower its norms and SwiGLU MLPs; the kernelized model's logits and every gradient (LoRA on all
linear layers, the vision tower's included) equal the plain model's on a padded batch with two
images, and a packed ``TransformersModel`` step equals the plain padded one."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tolerances import chain_tolerances, llama_sums
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from twinkle.kernel import DEFAULT_KERNEL_CONFIG, kernelize
from twinkle.kernel.kernelize import MARK
from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.model.vision_positions import token_types

VOCAB, IMAGE, START, END, VIDEO = 100, 96, 97, 98, 99
PATCH = 4
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=1,
)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)
VISION = dict(patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2, num_heads=2)
FAMILIES = {
    "qwen2_5_vl": (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        dict(TEXT, rope_parameters=MROPE),
        # block 0 attends in windows of 2x2 merged tokens, block 1 over each whole image
        dict(
            VISION,
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=32,
            window_size=16,
            fullatt_block_indexes=[1],
        ),
    ),
    "qwen2_vl": (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        dict(TEXT, rope_parameters=MROPE),
        dict(VISION, depth=2, embed_dim=32, hidden_size=32, mlp_ratio=2),
    ),
    "qwen3_vl": (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        dict(TEXT, head_dim=8, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        dict(
            VISION,
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
    ),
}
# the module classes DEFAULT_KERNEL_CONFIG patches in each family (text model; vision tower)
PATCHED = {
    "qwen2_5_vl": {"Qwen2_5_VLRMSNorm", "Qwen2MLP", "Qwen2_5_VLAttention", "Qwen2_5_VLMLP"},
    "qwen2_vl": {"Qwen2VLRMSNorm", "Qwen2MLP", "Qwen2VLAttention"},
    "qwen3_vl": {"Qwen3VLTextRMSNorm", "Qwen3VLTextMLP"},
}
GRIDS = [[1, 8, 8], [1, 4, 8]]  # two images: 64 and 32 patches, 16 and 8 tokens


def _model(family):
    config_cls, model_cls, text, vision = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision, **TOKENS))
    for name, param in model.named_parameters():  # norm weights off 1, so a kernel ignoring them shows
        if "norm" in name and param.dim() == 1:
            torch.nn.init.normal_(param, mean=1.0, std=0.2)
    return model


def _batch():
    """Two rows: one with both images between text, a shorter text-only one padded after it."""
    g = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(2, IMAGE, (n,), generator=g).tolist()  # noqa: E731
    first = text(5) + [START] + [IMAGE] * 16 + [END] + text(4) + [START] + [IMAGE] * 8 + [END] + text(6)
    second = text(12)
    width = len(first)
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for row, tokens in enumerate((first, second)):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    grids = torch.tensor(GRIDS)
    pixels = torch.randn(int(grids.prod(dim=1).sum()), 3 * 2 * PATCH * PATCH, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grids}


def _lora(model):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    layers = get_peft_model(model, lora)
    fuse_lora_linears(layers)  # one-node LoRA layers, as TransformersModel runs them
    return layers.train()


def _run(model, batch):
    logits = model(**batch, mm_token_type_ids=token_types(model, batch["input_ids"]), use_cache=False).logits
    (logits.square() * batch["attention_mask"][..., None]).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _tolerances(batch, reference):
    """The chain of fp32 sums through the language model over a row, the vision tower over the
    patches, the head, and a weight's gradient over every token and patch."""
    tokens, patches = batch["input_ids"].shape[1], batch["pixel_values"].shape[0]
    sums = llama_sums(32, 64, 2, tokens, VOCAB) + llama_sums(32, 64, 2, patches)
    return chain_tolerances(sums + [batch["input_ids"].numel() + patches], reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_default_config_patches_the_vl_families_layers(family):
    model = kernelize(_model(family))
    patched = {type(m).__name__ for m in model.modules() if getattr(m, MARK, None)}
    assert patched == PATCHED[family]
    assert all(name in DEFAULT_KERNEL_CONFIG for name in patched)
    language = model.model.language_model
    text_norms = [m for n, m in language.named_modules() if n.endswith("norm") or n.endswith("layernorm")]
    assert text_norms and all(getattr(m, MARK, None) for m in text_norms)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernelized_lora_model_has_the_plain_ones_logits_and_gradients(family):
    plain = _lora(_model(family))
    fast = kernelize(copy.deepcopy(plain))
    batch = _batch()
    logits, grads = _run(plain, batch)
    fast_logits, fast_grads = _run(fast, batch)
    assert any(getattr(m, MARK, None) for m in fast.modules()) and not any(
        getattr(m, MARK, None) for m in plain.modules()
    )
    torch.testing.assert_close(fast_logits, logits, **_tolerances(batch, logits))
    assert fast_grads.keys() == grads.keys()
    assert any(".visual." in n for n in grads) and any(".language_model." in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(fast_grads[name], grad, **_tolerances(batch, grad), msg=name)


def test_a_kernelized_packed_step_equals_the_plain_padded_one(tmp_path, monkeypatch):
    """``TransformersModel`` on a Qwen2.5-VL checkpoint: kernelized and packed, its loss and LoRA
    gradients equal the plain model's run padded."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))
    from tiny_vl import build_tiny_vl
    from vl_pictures import png_bytes

    from twinkle.model import TransformersModel
    from twinkle.model import forward as forward_module
    from twinkle.processor.collate import collate
    from twinkle.template import get_template

    folder = build_tiny_vl(tmp_path / "tiny-vl")
    template = get_template("Qwen2_5VLTemplate", str(folder))
    rows = [
        template.encode(
            [
                {"role": "user", "content": "<image>Colour?", "images": [png_bytes((32, 48), (200, 30, 30))]},
                {"role": "assistant", "content": "red"},
            ]
        ),
        template.encode(
            [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "hello there"}]
        ),
    ]
    packed = []
    real = forward_module.pack_images
    monkeypatch.setattr(
        forward_module, "pack_images", lambda lm, batch: packed.append(real(lm, batch)) or packed[-1]
    )
    results = []
    for fast in (True, False):
        torch.manual_seed(0)
        model = TransformersModel(
            str(folder), model_cls="Qwen2_5_VLForConditionalGeneration", padding_free=fast
        )
        model.add_adapter_to_model(
            "default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
        model.set_template("Qwen2_5VLTemplate", model_id=str(folder))
        if fast:
            kernelize(model)
        loss = float(model.forward_backward(inputs=rows))
        marks = sum(1 for m in model.model.modules() if getattr(m, MARK, None))
        results.append(
            (loss, {n: p.grad for n, p in model.model.named_parameters() if p.grad is not None}, marks)
        )
    (fast_loss, fast_grads, fast_marks), (loss, grads, marks) = results
    assert fast_marks > 0 and marks == 0
    assert (
        len(packed) == 1 and "pixel_values" in packed[0]
    )  # the kernelized step ran packed, the plain one padded
    assert fast_loss == pytest.approx(loss, rel=1e-5)
    assert fast_grads.keys() == grads.keys() and grads
    # the tiny checkpoint's chain: the language model over a padded row (a 700-token vocabulary),
    # its 1-block vision tower over the patches, a weight's gradient over every token
    batch = collate(rows, pad_token_id=0)
    tokens, patches = batch["input_ids"].shape[1], batch["pixel_values"].shape[0]
    sums = llama_sums(32, 64, 2, tokens, 700) + llama_sums(32, 64, 1, patches) + [batch["input_ids"].numel()]
    for name, grad in grads.items():
        torch.testing.assert_close(fast_grads[name], grad, **chain_tolerances(sums, grad), msg=name)
