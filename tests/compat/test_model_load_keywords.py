"""Upstream's loading keywords of ``TransformersModel`` (its EP and multimodal cookbooks pass
them): ``memory_efficient_init=True`` loads the same weights, with one warning that every rank
loads them; ``ignore_mismatched_sizes=True`` is ``from_pretrained``'s (a weight of another shape
than the config's starts anew instead of failing the load)."""

import logging

import torch
from transformers import AutoConfig

from twinkle.model import TransformersModel


def test_memory_efficient_init_loads_the_same_weights_and_says_so(tiny_model_dir, caplog):
    plain = TransformersModel(model_id=str(tiny_model_dir), mixed_precision="no")
    efficient = TransformersModel(
        model_id=str(tiny_model_dir), mixed_precision="no", memory_efficient_init=True
    )
    for (name, a), (_, b) in zip(
        plain.model.named_parameters(), efficient.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    said = [r for r in caplog.records if "memory_efficient_init" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def test_ignore_mismatched_sizes_reaches_from_pretrained(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size *= 2  # the saved MLP weights no longer fit
    model = TransformersModel(
        model_id=str(tiny_model_dir), config=config, mixed_precision="no", ignore_mismatched_sizes=True
    )
    assert model.model.model.layers[0].mlp.up_proj.weight.shape[0] == config.intermediate_size
