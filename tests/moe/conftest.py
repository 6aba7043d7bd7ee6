import pytest


@pytest.fixture(scope="session")
def qwen3_moe_dir(tiny_model_dir, tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (``tiny_moe.build_qwen3_moe``)."""
    from tiny_moe import build_qwen3_moe

    return build_qwen3_moe(tiny_model_dir, tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tiny_model_dir, tmp_path_factory):
    """A tiny random Qwen3.5-MoE checkpoint (``tiny_moe.build_qwen3_5_moe``)."""
    from tiny_moe import build_qwen3_5_moe

    return build_qwen3_5_moe(tiny_model_dir, tmp_path_factory.mktemp("tiny-qwen3_5-moe"))


@pytest.fixture(scope="session")
def qwen2_moe_dir(tiny_model_dir, tmp_path_factory):
    """A tiny random Qwen2-MoE checkpoint (``tiny_moe.build_qwen2_moe``)."""
    from tiny_moe import build_qwen2_moe

    return build_qwen2_moe(tiny_model_dir, tmp_path_factory.mktemp("tiny-qwen2-moe"))
