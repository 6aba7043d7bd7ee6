"""Command-line arguments for training scripts.

Public names:
    CLI        -- ``CLI.from_args(argv=None, env=None) -> Args``
    Args       -- typed groups ``infra dataset template model training lora optimizer
                  scheduler``, plus ``extra``, ``get_lora_args()`` and ``to_dict()``
    last_args  -- the most recently parsed ``Args`` (the runtime reads the seed from it)
    TEMPLATE_NAMES -- the template classes ``--template-cls`` accepts
"""

from .args import TEMPLATE_NAMES, Args
from .cli import CLI, last_args

__all__ = ["CLI", "Args", "last_args", "TEMPLATE_NAMES"]
