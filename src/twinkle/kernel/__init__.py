"""Every faster implementation Twinkle has, and the one mechanism that picks it.

Public names: ``kernelize``, ``KernelChoice``, ``DEFAULT_KERNEL_CONFIG``, ``DEFAULT_CALL_CHAINS``,
``register_op``, ``registered_ops``, ``BACKENDS``, ``SWITCHES``, ``switched``, ``set_switches``,
``call_chains``, ``set_call_chains``, ``reset_call_chains``, ``describe``, ``hub``, ``HubRef``,
and upstream's named bundles ``liger_builtin``, ``npu_builtin`` (``builtin.py``).
See ``README.md`` beside this file."""

from twinkle.kernel import backends as _backends  # noqa: F401  (registers the module ops)
from twinkle.kernel import decode_step as _decode_step  # noqa: F401  (registers decode_step)
from twinkle.kernel import gemv as _gemv  # noqa: F401  (registers decode_gemv)
from twinkle.kernel import muon as _muon  # noqa: F401  (registers muon_step)
from twinkle.kernel.attention import packed as _packed  # noqa: F401  (registers packed_attention)
from twinkle.kernel.builtin import liger_builtin, npu_builtin
from twinkle.kernel.config import DEFAULT_CALL_CHAINS, DEFAULT_KERNEL_CONFIG
from twinkle.kernel.hub_layers import HubRef, hub
from twinkle.kernel.kernelize import kernelize
from twinkle.kernel.lora import segments as _segments  # noqa: F401  (registers lora_segments)
from twinkle.kernel.registry import (
    BACKENDS,
    KernelChoice,
    call_chains,
    check_call_chains,
    register_op,
    registered_ops,
    reset_call_chains,
    set_call_chains,
)
from twinkle.kernel.report import describe
from twinkle.kernel.switches import SWITCHES, set_switches, switched

check_call_chains()  # each chain names registered backends and ends with its op's plain one

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
    "call_chains",
    "set_call_chains",
    "reset_call_chains",
    "describe",
    "liger_builtin",
    "npu_builtin",
]
