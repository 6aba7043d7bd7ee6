"""A multimodal trainer (``Qwen3_5ForConditionalGeneration``: text layers under
``model.language_model.``) syncs its adapter into a text-only sampler of the same checkpoint
(``AutoModelForCausalLM``: the same layers under ``model.``): the names meet."""

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from twinkle.sampler import adapters


def test_language_model_names_reach_a_text_sampler(tiny_model_dir):
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapters.install(lm, "a", LoraConfig(r=2, target_modules=["q_proj"]))
    layers = [k for k, _ in adapters._named_lora_layers(lm)]
    tensors = {}
    for key in layers:
        vl_key = key.replace("model.", "model.language_model.", 1)
        module = lm.get_submodule(key)
        for kind in adapters.KINDS:
            shape = getattr(module, kind)["a"].weight.shape
            tensors[f"base_model.model.{vl_key}.{kind}.weight"] = torch.full(shape, 0.5)
    assert adapters.write(lm, "a", tensors) > 0
    assert all(bool((lm.get_submodule(k).lora_B["a"].weight == 0.5).all()) for k in layers)
    assert adapters.text_key("model.visual.blocks.0.attn.qkv") == "model.visual.blocks.0.attn.qkv"
