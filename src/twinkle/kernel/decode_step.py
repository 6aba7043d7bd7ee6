"""Call op ``decode_step``: the work of a Llama-family decoding step between its products (norms,
rotary embedding, cache write, attention, SwiGLU's gate), for ``twinkle.sampler.lean_step``.

With one new position per row these are about forty torch calls a layer that each cost more to
dispatch than to compute, together about as long as the layer's products at batch 1.
``decode_step.c`` does them in three calls a layer (backend ``native``, built at first use like
the attention kernel). Its sums run in a fixed order on one thread each, and differ from torch's
by summation order only (about 1e-6 relative). Chain ``native`` -> ``torch`` (the model's own
modules, called one by one), walked once per step by ``LeanStep`` (``registry.dispatch``), whose
runners call the functions here; ``TWINKLE_NATIVE_DECODE=off`` or a machine without a C compiler
takes ``torch``."""

import ctypes
from pathlib import Path

import torch

from twinkle.kernel import native_build, registry

SOURCE = Path(__file__).with_name("decode_step.c")
OP = "decode_step"


def _load() -> ctypes.CDLL:
    lib = native_build.load_library(SOURCE)
    P, INT, LONG, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.twinkle_add_rms_norm.argtypes = [P, P, P, F, P, INT, LONG]
    lib.twinkle_silu_mul.argtypes = [P, P, LONG, INT]
    lib.twinkle_decode_attention.argtypes = [P] * 9 + [INT] * 4 + [LONG, LONG, F, INT]
    lib.twinkle_decode_attention.restype = INT
    return lib


# the compiled kernel, built at the process's first call; None when it cannot be had
library = native_build.lazy(_load, "native decoding step (using torch ops)")


registry.register_call(OP, "native", lambda: library() is not None, "a C compiler (cc) and a writable cache")
registry.register_call(OP, "torch", lambda: True, "nothing", plain=True)


def enabled() -> bool:
    return registry.enabled(OP, "native")


def add_rms_norm(
    hidden: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    """``hidden += add`` (where given), then ``out = hidden * rsqrt(mean(hidden^2) + eps) * weight``;
    all ``(rows, dim)`` fp32 contiguous."""
    library().twinkle_add_rms_norm(
        hidden.data_ptr(), None if add is None else add.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
        hidden.shape[0], hidden.shape[1],
    )  # fmt: skip


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate = silu(gate) * up`` in place; ``gate``."""
    library().twinkle_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads())
    return gate


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """This position's attention output ``(rows, heads * head_dim)``: ``q`` ``(rows, heads * D)``,
    ``k``, ``v`` ``(rows, kv_heads * D)`` rotated by ``cos``, ``sin`` ``(rows, D)``; ``k`` and
    ``v`` written into ``keys``, ``values`` ``(rows, kv_heads, capacity, D)`` at ``length``, and
    attended over positions ``0..length`` where ``mask`` ``(rows, length + 1)`` int64 is nonzero
    (None: all)."""
    rows, kv_heads, capacity, dim = keys.shape
    heads = q.shape[1] // dim
    out = torch.empty(rows, heads * dim, dtype=q.dtype)
    failed = library().twinkle_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
        values.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
        rows, heads, kv_heads, dim, length, capacity, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native decoding attention: no memory for the kernel's scratch")
    return out
