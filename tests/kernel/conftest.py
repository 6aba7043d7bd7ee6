import pytest
import torch
from tiny import TINY_LLAMA_SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from twinkle.kernel import KernelChoice, registry, set_switches
from twinkle.kernel import cpu_gemm as gemm

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


@pytest.fixture
def fresh_gemm(monkeypatch, tmp_path):
    """``cpu_gemm`` as a new process finds it: oneDNN for every shape (unmeasured; a test that
    wants ``auto`` sets it), no measured choice, no packed copy, a cache of its own."""
    registry.forget()
    set_switches({"TWINKLE_ONEDNN": "on"})
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gemm, "_faster", {})
    monkeypatch.setattr(gemm, "_routes", {})
    monkeypatch.setattr(gemm, "_packed", {})
    yield
    registry.forget()  # a test that made oneDNN or packing fail leaves them on for the next


@pytest.fixture
def onednn_calls(monkeypatch):
    """``(x, w)`` of each oneDNN call (the call is still made)."""
    seen = []
    real = gemm._linear_pointwise

    def spy(x, w, bias):
        seen.append((x, w))
        return real(x, w, bias)

    monkeypatch.setattr(gemm, "_linear_pointwise", spy)
    return seen
