"""``LoraConfig(target_modules=['all-linear'])``, as upstream's MoE GRPO script writes it, is PEFT's
``'all-linear'`` shortcut (PEFT alone would look for a module named ``all-linear``); the shortcut
beside other names is one line."""

import pytest
from peft import LoraConfig

from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.model.lora import all_linear_alone
from twinkle.utils.errors import UserError


def test_the_shortcut_in_a_list_adapts_every_linear_layer(tiny_model_dir):
    listed = TransformersModel(model_id=str(tiny_model_dir), mixed_precision="no")
    listed.add_adapter_to_model("a", LoraConfig(r=2, target_modules=["all-linear"]))
    plain = TransformersModel(model_id=str(tiny_model_dir), mixed_precision="no")
    plain.add_adapter_to_model("a", LoraConfig(r=2, target_modules="all-linear"))
    names = [sorted(k for k, p in m.model.named_parameters() if p.requires_grad) for m in (listed, plain)]
    assert names[0] == names[1] and names[0]


def test_a_multi_lora_model_takes_it_too(tiny_model_dir):
    model = MultiLoraTransformersModel(
        model_id=str(tiny_model_dir), max_loras=1, max_r=4, mixed_precision="no"
    )
    model.add_adapter_to_model("a", LoraConfig(r=2, target_modules=["all-linear"]))


def test_the_shortcut_beside_other_names_is_one_line():
    config = LoraConfig(r=2, target_modules=["all-linear", "q_proj"])
    with pytest.raises(UserError, match="'all-linear' already names every linear layer"):
        all_linear_alone(config)
    untouched = LoraConfig(r=2, target_modules=["q_proj"])
    assert all_linear_alone(untouched) is untouched
