import pytest
import torch
from tiny import TINY_LLAMA_SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from twinkle.kernel import KernelChoice

# Every op of the torch backend that a Llama has, forced (the default config keeps only rms_norm).
TORCH_MAPPING = {
    "LlamaRMSNorm": KernelChoice("rms_norm", ("torch",)),
    "LlamaMLP": KernelChoice("swiglu_mlp", ("torch",)),
}


def _tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama from a config (no files), with non-trivial norm weights so that a kernel
    ignoring them would be caught. In eval mode; ``.train()`` it to train."""
    config = dict(TINY_LLAMA_SHAPE, vocab_size=100)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(config | overrides)))
    for name, param in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(param, mean=1.0, std=0.2)
    return model.eval()


@pytest.fixture
def tiny_llama():
    """A factory: ``tiny_llama(seed=0, **config_overrides)``."""
    return _tiny_llama


@pytest.fixture
def torch_mapping():
    return dict(TORCH_MAPPING)
