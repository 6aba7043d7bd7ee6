"""``gguf_header``: the bytes of a GGUF file's header alone, for tests of what is read before
conversion (the architecture); no tensors follow, so it converts to nothing."""

import struct


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_header(architecture: str, name: str = "tiny") -> bytes:
    """GGUF v3 with ``general.architecture`` and ``general.name`` and zero tensors."""
    fields = [("general.architecture", architecture), ("general.name", name)]
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields))
    for key, value in fields:
        out += _string(key) + struct.pack("<I", 8) + _string(value)  # 8: a string value
    return out
