import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "assets"))


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
def _forget_parsed_args():
    """``initialize`` and ``TransformersModel`` read the last parsed command line; one test's
    flags must not reach the next test's model."""
    import twinkle.cli.cli as cli

    yield
    cli._last = None
