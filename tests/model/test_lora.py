"""Attaching the adapter: no warning the user cannot act on."""

import warnings

from peft import LoraConfig
from transformers import AutoModelForCausalLM

from twinkle.model.lora import add_lora


def test_wrapping_a_transformers_model_raises_no_future_warning(tiny_model_dir):
    """PEFT reads transformers' deprecated ``is_gradient_checkpointing`` while wrapping; the
    warning that triggers is silenced there, and only there."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        add_lora(model, "default", config)
        assert not model.is_gradient_checkpointing  # the alias outside the wrapping still warns
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 1 and "is_gradient_checkpointing" in future[0], future
