import io

import pytest


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL checkpoint with its image processor (``tiny_vl.build_tiny_vl``)."""
    from tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


def png_bytes(size=(32, 32), colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def png():
    """A factory of PNG bytes: ``png(size=(w, h), colour=(r, g, b))``."""
    return png_bytes
