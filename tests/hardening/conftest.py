"""Fixtures of the hardening tests: encoded rows and fresh LoRA models on the tiny Llama."""

import pytest
import torch
from peft import LoraConfig

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor


@pytest.fixture(scope="module")
def dataset(tiny_model_dir) -> Dataset:
    """Twelve encoded self-cognition rows."""
    data = Dataset(DatasetMeta(None, data_slice=range(12)))
    data.set_template("Template", model_id=str(tiny_model_dir), max_length=128)
    data.map(SelfCognitionProcessor("Twinkle", "Acme"))
    return data.encode()


@pytest.fixture
def make_model(tiny_model_dir):
    """Fresh models with adapter ``default`` (rank ``r``) and AdamW; the same arguments give the
    same initial weights."""

    def make(r: int = 4, gradient_accumulation_steps: int = 1) -> TransformersModel:
        model = TransformersModel(str(tiny_model_dir))
        torch.manual_seed(0)
        config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0)
        model.add_adapter_to_model("default", config, gradient_accumulation_steps=gradient_accumulation_steps)
        model.set_optimizer("AdamW", lr=1e-2)
        return model

    return make
