"""The ``liger`` backend: Triton kernels from ``liger-kernel`` (CUDA only).

``patch`` imports the package (an import failure falls through to the next backend) and returns
a module-level forward bound to the instance (``types.MethodType``), so that a deep copy of the
model carries a forward that reads the copy's weights. Triton compiles a kernel's launcher with
the system's C compiler at its first call, so an importable package is not yet a usable one:
each op's probe runs the kernel once, forward and backward, on a tiny CUDA tensor, and a failure
there (no compiler, a driver Triton does not support) falls through to the next backend."""

import importlib.util
import types

import torch

from twinkle.kernel.lora.mlp import lora_mlp
from twinkle.kernel.module_checks import require_silu, rms_norm_eps
from twinkle.kernel.registry import register_op


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
    # SwiGLU between three LoRA layers also keeps the product for down's adapter (one more
    # intermediate-wide tensor a layer), and four autograd nodes instead of one.
    fused = lora_mlp(self, x)
    if fused is not None:
        return fused
    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _probe_rms_norm(offset: float = 0.0, casting: str = "llama") -> None:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    x = torch.randn(2, 64, device="cuda", requires_grad=True)
    weight = torch.ones(64, device="cuda", requires_grad=True)
    LigerRMSNormFunction.apply(x, weight, 1e-6, offset, casting).sum().backward()
    torch.cuda.synchronize()


def _probe_swiglu() -> None:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    a, b = (torch.randn(2, 64, device="cuda", requires_grad=True) for _ in range(2))
    LigerSiLUMulFunction.apply(a, b).sum().backward()
    torch.cuda.synchronize()


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


register_op("rms_norm", "liger", _liger_available, _liger_rms_norm, _probe_rms_norm)
register_op(
    "rms_norm_zero_centered",
    "liger",
    _liger_available,
    _liger_rms_norm_zero_centered,
    lambda: _probe_rms_norm(1.0, "gemma"),
)
register_op("swiglu_mlp", "liger", _liger_available, _liger_swiglu, _probe_swiglu)
