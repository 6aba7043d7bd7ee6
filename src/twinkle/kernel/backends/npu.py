"""The ``npu`` backend: ``torch_npu`` fused ops (Ascend). Nothing here can run it: it is kept to
the two fused calls it needs, gated on the device being present."""

import types

import torch

from twinkle.kernel.module_checks import require_silu, rms_norm_eps
from twinkle.kernel.registry import register_op
from twinkle.utils.framework import Torch


def _npu_rms_norm_forward(self, hidden_states):
    import torch_npu

    return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=rms_norm_eps(self))[0]


def _npu_swiglu_forward(self, x):
    import torch_npu

    gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
    return self.down_proj(torch_npu.npu_swiglu(gate_up, dim=-1))


def _npu_rms_norm(module):
    import torch_npu  # noqa: F401

    return types.MethodType(_npu_rms_norm_forward, module)


def _npu_swiglu(module):
    import torch_npu  # noqa: F401

    require_silu(module)
    return types.MethodType(_npu_swiglu_forward, module)


register_op("rms_norm", "npu", Torch.is_npu_available, _npu_rms_norm)
register_op("swiglu_mlp", "npu", Torch.is_npu_available, _npu_swiglu)
