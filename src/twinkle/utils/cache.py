"""``cache_root()``: the folder where Twinkle keeps what it builds once per machine (converted
models, compiled kernels, measured kernel choices)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TWINKLE_CACHE`` if set, else ``~/.cache/twinkle`` (read at call time)."""
    configured = os.environ.get("TWINKLE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "twinkle"
