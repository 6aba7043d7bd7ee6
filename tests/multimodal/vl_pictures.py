"""Small pictures for the multimodal tests (a module of its own: ``from conftest import`` would
pick whichever ``conftest`` loaded first when several test folders run)."""

import io


def png_bytes(size=(32, 32), colour=(200, 30, 30)) -> bytes:
    """A plain PNG of ``size`` (width, height) in one ``colour``."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()
