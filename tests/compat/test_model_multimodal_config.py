"""A model class whose config nests its language model's (``Qwen3_5ForConditionalGeneration``,
as upstream's GRPO script loads) sizes its activations by that language model."""

import torch
from transformers import Qwen3_5Config, Qwen3_5TextConfig

from twinkle.model.activation_checkpointing import activation_bytes


def test_activation_estimate_reads_the_text_config():
    text = Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    nested = Qwen3_5Config(text_config=text.to_dict())
    assert activation_bytes(nested, 100, torch.float32) == activation_bytes(text, 100, torch.float32) > 0
