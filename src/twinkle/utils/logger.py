"""One logger for the whole package; INFO on rank 0, WARNING elsewhere."""

import logging
import os
import sys

_NAME = "twinkle"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str = _NAME) -> logging.Logger:
    """Return the package logger. Only rank 0 prints INFO; other ranks print warnings and errors."""
    root = logging.getLogger(_NAME)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        prefix = f"[rank{_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO if _rank() == 0 else logging.WARNING)
        root.propagate = False
    return root if name == _NAME else root.getChild(name.removeprefix(_NAME + "."))


def reset() -> logging.Logger:
    """Configure the logger again from ``RANK`` / ``WORLD_SIZE`` (a process that became a rank
    after importing Twinkle: a Ray worker)."""
    root = logging.getLogger(_NAME)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    return get_logger()
