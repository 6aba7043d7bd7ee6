"""``DEFAULT_KERNEL_CONFIG``: module class name -> the kernel to try for its instances."""

from twinkle.kernel.registry import KernelChoice

_FAMILIES = ("Llama", "Qwen2", "Qwen3", "Qwen3Moe", "Qwen3_5", "Qwen3_5Moe", "Qwen2Moe", "Mistral")

DEFAULT_KERNEL_CONFIG: dict[str, KernelChoice] = {}
for _family in _FAMILIES:
    DEFAULT_KERNEL_CONFIG[f"{_family}RMSNorm"] = KernelChoice("rms_norm", ("npu", "liger"))
    DEFAULT_KERNEL_CONFIG[f"{_family}MLP"] = KernelChoice("swiglu_mlp", ("npu", "liger"))
