import pytest
from vl_pictures import png_bytes


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL checkpoint with its image processor (``tiny_vl.build_tiny_vl``)."""
    from tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture
def png():
    """A factory of PNG bytes: ``png(size=(w, h), colour=(r, g, b))``."""
    return png_bytes
