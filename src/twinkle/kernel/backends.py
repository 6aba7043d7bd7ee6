"""Built-in implementations. Each is gated on its device and package; none runs on a plain CPU.

liger: Triton kernels from ``liger-kernel`` (CUDA only). npu: ``torch_npu`` fused ops (Ascend);
this cannot be tested here and is kept to the two fused calls it needs."""

import importlib.util

import torch

from twinkle.kernel.registry import register_op
from twinkle.utils.framework import Torch


def _liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def _liger_rms_norm(module):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(hidden_states):
        return LigerRMSNormFunction.apply(hidden_states, module.weight, eps)

    return forward


def _liger_swiglu(module):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def forward(x):
        return module.down_proj(LigerSiLUMulFunction.apply(module.gate_proj(x), module.up_proj(x)))

    return forward


def _npu_rms_norm(module):
    import torch_npu

    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(hidden_states):
        return torch_npu.npu_rms_norm(hidden_states, module.weight, epsilon=eps)[0]

    return forward


def _npu_swiglu(module):
    import torch_npu

    def forward(x):
        gate_up = torch.cat([module.gate_proj(x), module.up_proj(x)], dim=-1)
        return module.down_proj(torch_npu.npu_swiglu(gate_up, dim=-1))

    return forward


register_op("rms_norm", "liger", _liger_available, _liger_rms_norm)
register_op("swiglu_mlp", "liger", _liger_available, _liger_swiglu)
register_op("rms_norm", "npu", Torch.is_npu_available, _npu_rms_norm)
register_op("swiglu_mlp", "npu", Torch.is_npu_available, _npu_swiglu)
