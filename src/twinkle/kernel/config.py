"""``DEFAULT_KERNEL_CONFIG``: module class name -> the kernel to try for its instances; and
``DEFAULT_CALL_CHAINS``: call op -> its backends, in the order they are tried.

The ``torch`` backend closes a chain where it measurably beat the original module on CPU
(``rms_norm``: about twice as fast), or kept less at the same step time (``swiglu_mlp``: without LoRA one
activation less per layer; with LoRA on its projections one node; see ``README.md``).
``lora_attention`` has only the torch backend: with LoRA on q/k/v, one node for the projections
and the rotary embedding (design note 22); without, the class's forward."""

from twinkle.kernel.registry import KernelChoice, define_call_op

_FAMILIES = ("Llama", "Qwen2", "Qwen3", "Qwen3Moe", "Qwen2Moe", "Mistral")
# Qwen3.5's norm is zero-centred, ``x_hat * (1 + w)`` with ``w`` initialised to zeros: a plain
# ``rms_norm`` kernel (``x_hat * w``) would silently zero its output.
_ZERO_CENTERED_FAMILIES = ("Qwen3_5", "Qwen3_5Moe")

DEFAULT_KERNEL_CONFIG: dict[str, KernelChoice] = {}
for _family in _FAMILIES:
    DEFAULT_KERNEL_CONFIG[f"{_family}RMSNorm"] = KernelChoice("rms_norm", ("npu", "liger", "torch"))
for _family in _ZERO_CENTERED_FAMILIES:
    DEFAULT_KERNEL_CONFIG[f"{_family}RMSNorm"] = KernelChoice("rms_norm_zero_centered", ("liger", "torch"))
for _family in _FAMILIES + _ZERO_CENTERED_FAMILIES:
    DEFAULT_KERNEL_CONFIG[f"{_family}MLP"] = KernelChoice("swiglu_mlp", ("npu", "liger", "torch"))
# The language models of the Qwen vision-language families are their text families' layers under
# other class names: the same RMSNorm and SwiGLU MLP (Qwen2-VL's and Qwen2.5-VL's MLP is
# ``Qwen2MLP`` itself, covered above), and for Qwen2-VL and Qwen2.5-VL Qwen2's attention, its
# M-RoPE already folded into the cos/sin tables it is given. Qwen2.5-VL's vision tower uses the
# same norm class and a SwiGLU MLP (with biases, which the kernels carry), so it takes them too.
for _family in ("Qwen2VL", "Qwen2_5_VL", "Qwen3VLText"):
    DEFAULT_KERNEL_CONFIG[f"{_family}RMSNorm"] = KernelChoice("rms_norm", ("npu", "liger", "torch"))
for _name in ("Qwen3VLTextMLP", "Qwen2_5_VLMLP"):
    DEFAULT_KERNEL_CONFIG[_name] = KernelChoice("swiglu_mlp", ("npu", "liger", "torch"))
# Llama-style attention whose projections and rotary embedding can run as one LoRA node
for _family in ("Llama", "Mistral", "Qwen2", "Qwen2VL", "Qwen2_5_VL"):
    DEFAULT_KERNEL_CONFIG[f"{_family}Attention"] = KernelChoice("lora_attention", ("torch",))

# Call ops: each call walks its op's chain (``registry.dispatch``), and the first backend that is
# usable here and accepts the call runs it. The last of each chain is the op's plain torch/PEFT
# way, which takes every call and is all that runs with ``TWINKLE_KERNELS=none``. Editing a chain
# here (or ``set_call_chains`` in a process) changes what runs: reorder the backends before the
# last, or leave some out.
DEFAULT_CALL_CHAINS: dict[str, tuple[str, ...]] = {
    # a packed row's attention: the C kernel, then the flash calls with a pooled backward (rows
    # with long samples), then batched products (rows of short samples), then SDPA per sample
    "packed_attention": ("native", "pooled", "batched", "sdpa"),
    # a PEFT LoRA linear layer: one autograd node, else PEFT's own modules
    "lora_linear": ("fused", "peft"),
    # an MLP of three LoRA layers (inside ``swiglu_mlp``): one node, else layer by layer
    "lora_mlp": ("fused", "modules"),
    # q/k/v LoRA projections and the rotary embedding (inside ``lora_attention``)
    "lora_qkv": ("fused", "modules"),
    # the frozen weights' fp32 CPU products: oneDNN (packed copies first) where it is faster
    "cpu_gemm": ("packed", "onednn", "torch"),
    # a decoding step's products of a few rows: the C kernel that streams the weights once, else
    # the library ``cpu_gemm`` measured faster for the shape
    "decode_gemv": ("native", "torch"),
    # a decoding step's norms, rotation, cache write, attention and gate: the C kernel, else the
    # model's own modules one by one
    "decode_step": ("native", "torch"),
    # torch.optim.Muon's step: one batched Newton-Schulz iteration per matrix shape, else torch's
    "muon_step": ("batched", "torch"),
    # LoRA dropout's masks inside the LoRA nodes: the C kernel (fp32 CPU), else the same hash as
    # torch ops
    "lora_dropout": ("native", "torch"),
    # a packed row's LoRA products where runs of tokens belong to different adapters (a
    # mixed-adapter forward_only): every run of a layer in one C call, else two products per run
    "lora_segments": ("native", "torch"),
}
for _op, _chain in DEFAULT_CALL_CHAINS.items():
    define_call_op(_op, _chain)
