import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from twinkle.dataset import Dataset
from twinkle.kernel import switches
from twinkle.model import TransformersModel
from twinkle.runtime import run_config
from twinkle.runtime import runtime as runtime_module

sys.path.insert(0, str(Path(__file__).parent / "assets"))

from shared_data import build_dataset  # noqa: E402  (after the assets folder is on the path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with a 600-token BPE tokenizer and a ChatML template, built offline."""
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep conversion and dataset caches of tests out of the user's home."""
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path_factory.getbasetemp() / "twinkle-cache"))


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny model is overhead-bound. On the 2 shared cores of CI, two OpenMP threads spin
    against other processes and make a step up to 100x slower; one thread is fast and deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_run_context_and_switches():
    """A test may parse a command line (whose configuration waits for ``initialize``), initialize
    a run with its own configuration, or set kernel switches; none of it may reach the next test."""
    before, runtime, hook = switches.values(), runtime_module._RUNTIME, sys.excepthook
    yield
    run_config.take_handed_over()
    ended = runtime_module._RUNTIME
    if ended is not runtime and ended is not None and ended.report is not None:
        ended.report.finish()  # the test's run ends with the test, as a process's run ends at exit
    runtime_module._RUNTIME = runtime
    sys.excepthook = hook
    switches.set_switches(before)


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
