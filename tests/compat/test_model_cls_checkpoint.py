"""``TransformersModel(model_cls=...)`` with a class written for another architecture than the
checkpoint's is one line before any weights are built (transformers would warn, then build the
class's default-sized model with random weights); a class of the checkpoint's own family loads."""

import pytest
from transformers import LlamaForCausalLM, Qwen3_5ForConditionalGeneration

from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError


def test_a_class_of_another_architecture_is_one_line(tiny_model_dir):
    with pytest.raises(
        UserError, match="model_cls=Qwen3_5ForConditionalGeneration builds 'qwen3_5' models"
    ) as info:
        TransformersModel(model_id=str(tiny_model_dir), model_cls=Qwen3_5ForConditionalGeneration)
    assert "'llama' checkpoint" in str(info.value) and "\n" not in str(info.value)


def test_the_checkpoint_s_own_class_and_auto_classes_load(tiny_model_dir):
    assert (
        type(TransformersModel(model_id=str(tiny_model_dir), model_cls=LlamaForCausalLM).model)
        is LlamaForCausalLM
    )
    assert TransformersModel(model_id=str(tiny_model_dir), model_cls="AutoModelForCausalLM").model is not None
