"""Fixtures for the model tests: encoded self-cognition rows and fresh LoRA models on the tiny Llama."""

import pytest
import torch
from peft import LoraConfig

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor


def build_dataset(model_dir, rows: int) -> Dataset:
    dataset = Dataset(DatasetMeta(None, data_slice=range(rows)))
    dataset.set_template("Template", model_id=str(model_dir), max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    return dataset


@pytest.fixture(scope="module")
def dataset(tiny_model_dir) -> Dataset:
    """Twenty encoded rows; they differ in length and in number of supervised tokens."""
    return build_dataset(tiny_model_dir, 20)


@pytest.fixture
def make_model(tiny_model_dir):
    """A factory of fresh models with adapter ``default`` and an AdamW optimizer. Models made
    with the same arguments start identical (the LoRA initialisation is seeded)."""

    def make(
        gradient_accumulation_steps: int = 1,
        r: int = 4,
        lora_dropout: float = 0.0,
        init_lora_weights: bool = True,
        lr: float = 1e-2,
    ) -> TransformersModel:
        model = TransformersModel(str(tiny_model_dir))
        torch.manual_seed(0)
        config = LoraConfig(
            r=r,
            lora_alpha=2 * r,
            target_modules="all-linear",
            lora_dropout=lora_dropout,
            init_lora_weights=init_lora_weights,  # False: B is random too, so every LoRA grad is non-zero
        )
        model.add_adapter_to_model("default", config, gradient_accumulation_steps=gradient_accumulation_steps)
        model.set_optimizer("AdamW", lr=lr)
        return model

    return make
