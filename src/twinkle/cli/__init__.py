"""Command-line arguments for training scripts.

Public names:
    CLI        -- ``CLI.from_args(argv=None, env=None, config_file=None, env_file=None) -> Args``;
                  it hands the run's configuration to ``twinkle.initialize()``, which applies it
    Args       -- typed groups ``infra dataset template model training lora optimizer
                  scheduler loss sampling rl checkpoint sampler``, plus ``extra``, ``get_lora_args()``, upstream's
                  ``get_<group>_args()`` dicts, ``get()`` and ``to_dict()``
    TEMPLATE_NAMES -- the template classes ``--template-cls`` accepts
    CLISource  -- upstream's raw ``{key: value}`` view of a command line, before any typing
"""

from .args import TEMPLATE_NAMES, Args
from .cli import CLI
from .sources import CLISource

__all__ = ["CLI", "Args", "TEMPLATE_NAMES", "CLISource"]
