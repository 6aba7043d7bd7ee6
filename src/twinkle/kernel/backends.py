"""Built-in implementations for accelerators. Each is gated on its device and package; none runs
on a plain CPU (the ``torch`` backend in ``torch_ops.py`` does).

liger: Triton kernels from ``liger-kernel`` (CUDA only). npu: ``torch_npu`` fused ops (Ascend);
this cannot be tested here and is kept to the two fused calls it needs.

``patch`` imports the package (an import failure falls through to the next backend) and returns
a module-level forward bound to the instance (``types.MethodType``), so that a deep copy of the
model carries a forward that reads the copy's weights."""

import importlib.util
import types

import torch

from twinkle.kernel.module_checks import require_silu, rms_norm_eps
from twinkle.kernel.registry import register_op
from twinkle.model.lora_mlp import lora_mlp
from twinkle.utils.framework import Torch


def _liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def _liger_rms_norm_forward(self, hidden_states):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(hidden_states, self.weight, rms_norm_eps(self))


def _liger_rms_norm_zero_centered_forward(self, hidden_states):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # offset 1.0: x_hat * (1 + w); "gemma" casting: everything in fp32, cast once at the end.
    return LigerRMSNormFunction.apply(hidden_states, self.weight, rms_norm_eps(self), 1.0, "gemma")


def _liger_swiglu_forward(self, x):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    # Three plain LoRA projections: the one-node MLP, which keeps gate and up only here. Liger's
    # SwiGLU between three LoRA layers also keeps the product for down's adapter: 716 MiB more
    # in W2 on the H200 (session 15), and four autograd nodes instead of one.
    fused = lora_mlp(self, x)
    if fused is not None:
        return fused
    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _liger_rms_norm(module):
    import liger_kernel.ops.rms_norm  # noqa: F401

    return types.MethodType(_liger_rms_norm_forward, module)


def _liger_rms_norm_zero_centered(module):
    import liger_kernel.ops.rms_norm  # noqa: F401

    return types.MethodType(_liger_rms_norm_zero_centered_forward, module)


def _liger_swiglu(module):
    import liger_kernel.ops.swiglu  # noqa: F401

    require_silu(module)
    return types.MethodType(_liger_swiglu_forward, module)


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


register_op("rms_norm", "liger", _liger_available, _liger_rms_norm)
register_op("rms_norm_zero_centered", "liger", _liger_available, _liger_rms_norm_zero_centered)
register_op("swiglu_mlp", "liger", _liger_available, _liger_swiglu)
register_op("rms_norm", "npu", Torch.is_npu_available, _npu_rms_norm)
register_op("swiglu_mlp", "npu", Torch.is_npu_available, _npu_swiglu)
