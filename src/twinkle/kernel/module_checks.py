"""What every backend reads from or checks on the module it patches (shared, so they agree)."""

import torch
import torch.nn.functional as F


def rms_norm_eps(module: torch.nn.Module) -> float:
    """The epsilon of an RMSNorm: Llama-style modules call it ``variance_epsilon``, Qwen3.5 ``eps``."""
    return getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))


def require_silu(module: torch.nn.Module) -> None:
    """A SwiGLU kernel computes ``silu(gate) * up``; a config with another ``hidden_act`` would be
    silently changed by it. Probe the activation instead of trusting its class name."""
    probe = torch.linspace(-6.0, 6.0, 25)
    act = getattr(module, "act_fn", None)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(f"{type(module).__name__}.act_fn is {type(act).__name__}, not SiLU")
