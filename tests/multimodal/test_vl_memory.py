"""Memory of vision-language LoRA training on the CPU. Under the default LoRA (language model
only) the frozen vision tower saves no tensor for backward, so its activations are freed as it
runs, and its plain linear layers get no oneDNN-packed copy, which none of their products would
read. With LoRA on the tower as well, both change: that is the check that the counting sees
the tower at all."""

import pytest
import torch
from peft import LoraConfig

from twinkle.kernel import cpu_gemm as gemm
from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.vision import plain_vision_weights
from twinkle.template import get_template

LANGUAGE_ONLY = dict(target_modules="all-linear")  # the default: the tower and projector left out
WITH_TOWER = dict(target_modules="all-linear", exclude_modules=[])  # every linear layer, the tower's too


def _model(folder, lora):
    torch.manual_seed(0)
    model = TransformersModel(str(folder), model_cls="Qwen2_5_VLForConditionalGeneration")
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora))
    return model


def _rows(folder, png):
    template = get_template("Qwen2_5VLTemplate", str(folder))

    def row(text, reply, pictures):
        user = {"role": "user", "content": "<image>" * len(pictures) + text, "images": pictures}
        return template.encode([user, {"role": "assistant", "content": reply}])

    return [
        row("What colour?", "red", [png((32, 32), (200, 30, 30))]),
        row("Which is bigger?", "the second", [png((48, 32), (30, 200, 30)), png((64, 48), (30, 30, 200))]),
    ]


def _saved_by_the_tower(model, rows):
    """Shapes of the tensors autograd saves for backward while the vision tower runs, over one
    ``forward_backward``."""
    visual = causal_lm_of(model.model).model.visual
    inside, saved = [False], []

    def keep(tensor):
        if inside[0]:
            saved.append(tuple(tensor.shape))
        return tensor

    handles = [
        visual.register_forward_pre_hook(lambda module, args: inside.__setitem__(0, True)),
        visual.register_forward_hook(lambda module, args, out: inside.__setitem__(0, False)),
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model.forward_backward(inputs=rows)
    finally:
        for handle in handles:
            handle.remove()
    return saved


def test_the_frozen_tower_saves_nothing_for_backward(tiny_vl_dir, png):
    rows = _rows(tiny_vl_dir, png)
    assert _saved_by_the_tower(_model(tiny_vl_dir, LANGUAGE_ONLY), rows) == []
    # LoRA on the tower: its adapters need their inputs in backward, so the count is not blind
    assert len(_saved_by_the_tower(_model(tiny_vl_dir, WITH_TOWER), rows)) > 0


def test_the_plain_vision_layers_are_not_packed(tiny_vl_dir):
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        pytest.skip("no oneDNN weight packing in this torch")
    model = _model(tiny_vl_dir, LANGUAGE_ONLY)
    lm = causal_lm_of(model.model)
    plain = plain_vision_weights(model.model)
    # every linear layer of the tower and the projector (the 1-block tower: attention's qkv and
    # proj, the MLP's three, the merger's two); none of them carries a gradient
    assert len(plain) == 7 and not any(w.requires_grad for w in plain)
    assert all(gemm._packed_weight(w) is w for w in plain)  # no packed copy
    frozen = lm.model.language_model.layers[0].mlp.down_proj.base_layer.weight
    assert gemm._packed_weight(frozen) is not frozen  # the language model's frozen weights are packed

    tower = _model(tiny_vl_dir, WITH_TOWER)
    assert plain_vision_weights(tower.model) == []  # every tower layer is a LoRA layer now
    qkv = causal_lm_of(tower.model).model.visual.blocks[0].attn.qkv.base_layer.weight
    assert gemm._packed_weight(qkv) is not qkv
