"""Every faster implementation Twinkle has, and the one mechanism that picks it.

Public names: ``kernelize``, ``KernelChoice``, ``DEFAULT_KERNEL_CONFIG``, ``DEFAULT_CALL_CHAINS``,
``register_op``, ``registered_ops``, ``BACKENDS``, ``SWITCHES``, ``switched``, ``set_switches``,
``describe``, ``hub``, ``HubRef``. See ``README.md`` beside this file."""

from twinkle.kernel import backends as _backends  # noqa: F401  (registers the module ops)
from twinkle.kernel import muon as _muon  # noqa: F401  (registers muon_step)
from twinkle.kernel.attention import packed as _packed  # noqa: F401  (registers packed_attention)
from twinkle.kernel.config import DEFAULT_CALL_CHAINS, DEFAULT_KERNEL_CONFIG
from twinkle.kernel.hub_layers import HubRef, hub
from twinkle.kernel.kernelize import kernelize
from twinkle.kernel.registry import BACKENDS, KernelChoice, register_op, registered_ops
from twinkle.kernel.report import describe
from twinkle.kernel.switches import SWITCHES, set_switches, switched

__all__ = [
    "kernelize",
    "hub",
    "HubRef",
    "KernelChoice",
    "DEFAULT_KERNEL_CONFIG",
    "DEFAULT_CALL_CHAINS",
    "register_op",
    "registered_ops",
    "BACKENDS",
    "SWITCHES",
    "switched",
    "set_switches",
    "describe",
]
