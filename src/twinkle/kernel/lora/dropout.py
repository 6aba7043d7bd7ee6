"""LoRA dropout inside the fused nodes, its mask kept as bits for backward.

PEFT's adapter dropout is ``nn.Dropout`` on the LoRA branch's input: a Bernoulli(1-p) mask, scaled
by 1/(1-p), in training mode only; the base path sees none. torch draws that mask one generator
call per element (about a fifth of a short-row step at dropout 0.05) and autograd keeps it and the
masked copy for backward.

Here each adapter call draws one 64-bit seed from torch's default generator, so runs are
deterministic under the seed and a resumed run (which restores the generator) draws the same
masks. Element i of the branch input is kept when a counter-based hash of (seed, i) clears
``round(p * 2^32)``. ``dropout.c`` computes it with vector integer ops; on other devices,
dtypes or without a C compiler the same hash runs as torch ops and gives the same mask (call
op ``lora_dropout``: ``native`` -> ``torch``). The masks are not the ones PEFT's ``nn.Dropout``
would draw: the same distribution, another stream.

On the CPU in fp32 the nodes never write the masked input out: ``masked_low`` masks each row
into a scratch row and multiplies it by the adapter's A at once, and ``masked_input_grads``
computes A's gradient and adds the branch's share of x's gradient in one pass over x. The
forward keeps the mask as bits (1/32 of the fp32 input) for that pass, which reads them faster
than it could hash the mask again. Elsewhere backward recomputes the mask from the seed and nothing is
kept."""

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from twinkle.kernel import registry
from twinkle.kernel.native_build import load_library
from twinkle.utils.logger import get_logger

SOURCE = Path(__file__).with_name("dropout.c")
_M32 = 0xFFFFFFFF
_state: dict[str, ctypes.CDLL | None] = {}


class Drop(NamedTuple):
    """One adapter call's dropout: the seed of its mask and the drop probability."""

    seed: int
    p: float

    @property
    def drop_below(self) -> int:
        return min(round(self.p * 2**32), _M32)

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """``1 / (1 - p)`` computed in ``dtype``, the factor ``nn.Dropout`` multiplies by."""
        return _scale(self.p, dtype)


@lru_cache(maxsize=64)
def _scale(p: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.ones((), dtype=dtype) / torch.tensor(1 - p, dtype=dtype)


def draw(p: float) -> Drop:
    """A new mask for dropout probability ``p``: one draw from torch's default CPU generator."""
    return Drop(int(torch.empty((), dtype=torch.int64).random_()), float(p))


def _library() -> ctypes.CDLL | None:
    if "lib" not in _state:
        try:
            lib = load_library(SOURCE)
            P, I64, U64, U32, F, INT = (
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float, ctypes.c_int,
            )  # fmt: skip
            lib.twinkle_dropout_f32.argtypes = [P, P, I64, U64, U32, F, INT]
            lib.twinkle_lora_masked_down_f32.argtypes = [
                P,
                P,
                P,
                I64,
                I64,
                I64,
                I64,
                I64,
                INT,
                P,
                P,
                P,
                P,
                INT,
            ]
            lib.twinkle_lora_masked_down_f32.restype = INT
            up = [P, P, P, I64, I64, P, P, I64, I64, I64, INT, P, P, P, P, INT]
            lib.twinkle_lora_masked_up_grad_f32.argtypes = up
            lib.twinkle_lora_masked_up_grad_f32.restype = INT
            _state["lib"] = lib
            _check(lib)
        except (OSError, RuntimeError, AttributeError) as error:  # no compiler; a build lacking a symbol
            _state["lib"] = None
            get_logger().warning("dropout kernel not available, masks are computed with torch ops: %s", error)
    return _state["lib"]


OP = "lora_dropout"
registry.register_call(OP, "native", lambda: _library() is not None, "a C compiler (cc) and a writable cache")
registry.register_call(OP, "torch", lambda: True, "nothing", plain=True)


def _check(lib: ctypes.CDLL) -> None:
    """The built kernel gives the torch ops' mask on a probe tensor, or it is not used."""
    x = torch.arange(1, 4097, dtype=torch.float32)
    drop = Drop(0x123456789ABCDEF, 0.25)
    out = torch.empty_like(x)
    lib.twinkle_dropout_f32(
        x.data_ptr(), out.data_ptr(), x.numel(), drop.seed, drop.drop_below, float(drop.scale(x.dtype)), 1
    )
    if not torch.equal(out != 0, keep_mask(x.shape, drop)):
        raise RuntimeError("the built dropout kernel's mask differs from the torch ops' mask")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``dropout.c``'s ``mix`` on int64 holding uint32 values (products wrap; the low 32 bits are
    exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


@lru_cache(maxsize=64)
def _indices(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


def keep_mask(
    shape: torch.Size | tuple[int, ...], drop: Drop, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The mask as a bool tensor (True: kept), computed with torch ops."""
    n = 1
    for size in shape:
        n *= size
    k0, k1 = drop.seed & _M32, (drop.seed >> 32) & _M32
    h = _mix((_mix(_indices(n, torch.device(device)) ^ k0) + k1) & _M32)
    return (h >= drop.drop_below).view(shape)


def apply(t: torch.Tensor, drop: Drop | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` with the mask applied and the kept values scaled by ``1 / (1 - p)``; ``t`` itself
    when ``drop`` is None. ``out`` may be ``t`` (in place)."""
    if drop is None:
        return t if out is None else out.copy_(t)
    if t.numel() >= 2**32:
        raise ValueError("LoRA dropout: a tensor of 2^32 elements or more")
    return registry.dispatch(OP, _APPLY, t, drop, out)


def _apply_native(t: torch.Tensor, drop: Drop, out: torch.Tensor | None) -> torch.Tensor | None:
    lib = _fused(t)
    if lib is None:
        return None
    if out is None:
        out = torch.empty_like(t)
    lib.twinkle_dropout_f32(
        t.data_ptr(),
        out.data_ptr(),
        t.numel(),
        drop.seed,
        drop.drop_below,
        float(drop.scale(t.dtype)),
        torch.get_num_threads(),
    )
    return out


def _apply_torch(t: torch.Tensor, drop: Drop, out: torch.Tensor | None) -> torch.Tensor:
    masked = t * torch.where(keep_mask(t.shape, drop, t.device), drop.scale(t.dtype).to(t.device), 0)
    return masked if out is None else out.copy_(masked)


_APPLY = {"native": _apply_native, "torch": _apply_torch}


def _fused(*tensors: torch.Tensor | None) -> ctypes.CDLL | None:
    """The C kernel where every tensor given is a contiguous fp32 CPU tensor and backend
    ``native`` is in the chain and usable (asked only then: it is built at first use), else None."""
    for t in tensors:
        if t is not None and not (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()):
            return None
    return _library() if registry.enabled(OP, "native") else None


def bits_shape(adapters: int, tokens: int, hidden: int) -> tuple[int, int, int]:
    """The shape of masks kept as bits: a 16-bit word per 16 elements of each row, per adapter."""
    return adapters, tokens, -(-hidden // 16)


def _keys(drops: tuple[Drop, ...]) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
    """The masks' seeds, thresholds and fp32 scales as the C arrays the kernels take."""
    n = len(drops)
    return (
        (ctypes.c_uint64 * n)(*[d.seed for d in drops]),
        (ctypes.c_uint32 * n)(*[d.drop_below for d in drops]),
        (ctypes.c_float * n)(*[_scale_f32(d.p) for d in drops]),
    )


@lru_cache(maxsize=64)
def _scale_f32(p: float) -> float:
    return float(_scale(p, torch.float32))


def _rank(lora_a: torch.Tensor, drops: tuple[Drop, ...]) -> int:
    rank, rest = divmod(lora_a.shape[0], len(drops))
    if rest:
        raise ValueError(f"LoRA dropout: {lora_a.shape[0]} stacked rows of A for {len(drops)} adapters")
    return rank


def masked_low(
    flat: torch.Tensor, lora_a: torch.Tensor, drops: tuple[Drop, ...], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(low, bits)`` for n adapters that share ``flat`` (tokens, hidden), already in their
    dtype, with their A matrices stacked in ``lora_a`` (n * r, hidden) and ``drops`` their n
    masks: ``low[:, i r:(i + 1) r] = apply(flat, drops[i]) @ A_i^T`` (tokens, n * r), and where the
    kernel ran, the masks as bits for ``masked_input_grads`` (int16, ``bits_shape``: 1/32 of fp32
    ``flat`` per adapter), else None. ``out`` (tokens, n * r), any strides, receives ``low``."""
    _rank(lora_a, drops)
    if out is None:
        out = torch.empty(lora_a.shape[0], flat.shape[0], dtype=flat.dtype, device=flat.device).t()
    return registry.dispatch(OP, _MASKED_LOW, flat, lora_a, drops, out)


def _masked_low_torch(
    flat: torch.Tensor, lora_a: torch.Tensor, drops: tuple[Drop, ...], out: torch.Tensor
) -> tuple[torch.Tensor, None]:
    rank = _rank(lora_a, drops)
    for i, drop in enumerate(drops):  # r rows tall, as the nodes compute it
        out[:, i * rank : (i + 1) * rank] = torch.mm(
            lora_a[i * rank : (i + 1) * rank], apply(flat, drop).t()
        ).t()
    return out, None


def _masked_low_native(
    flat: torch.Tensor, lora_a: torch.Tensor, drops: tuple[Drop, ...], out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    lib = _fused(flat, lora_a) if flat.numel() < 2**32 else None
    if lib is None:
        return None
    rank = _rank(lora_a, drops)
    tokens, hidden = flat.shape
    bits = torch.empty(bits_shape(len(drops), tokens, hidden), dtype=torch.int16)
    failed = lib.twinkle_lora_masked_down_f32(
        flat.data_ptr(), lora_a.data_ptr(), out.data_ptr(), tokens, hidden, rank, out.stride(0), out.stride(1),
        len(drops), *_keys(drops), bits.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("LoRA dropout: no memory for the kernel's scratch")
    return out, bits


_MASKED_LOW = {"native": _masked_low_native, "torch": _masked_low_torch}


def masked_input_grads(
    flat: torch.Tensor,
    lora_a: torch.Tensor,
    g_low: torch.Tensor,
    drops: tuple[Drop, ...],
    grad_x: torch.Tensor | None,
    need_a: bool,
    bits: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The adapters' side of backward through their masks, for ``masked_low``'s ``flat``,
    stacked ``lora_a`` and ``drops``, and ``g_low`` (tokens, n * r) the gradient of its ``low``:
    adds the branches' shares of x's gradient to ``grad_x`` (when given; x's dtype, rounded once)
    and returns the stacked A's gradient (n * r, hidden; when ``need_a``). ``bits``: the masks
    ``masked_low`` kept, else they are recomputed from the seeds (the same masks)."""
    _rank(lora_a, drops)
    grad_a = torch.empty_like(lora_a) if need_a else None
    registry.dispatch(OP, _INPUT_GRADS, flat, lora_a, g_low, drops, grad_x, grad_a, bits)
    return grad_a


def _input_grads_torch(
    flat: torch.Tensor,
    lora_a: torch.Tensor,
    g_low: torch.Tensor,
    drops: tuple[Drop, ...],
    grad_x: torch.Tensor | None,
    grad_a: torch.Tensor | None,
    bits: torch.Tensor | None,
) -> bool:
    """``masked_input_grads`` with torch ops; the masks recomputed from their seeds."""
    rank = _rank(lora_a, drops)
    for i, drop in enumerate(drops):
        rows = slice(i * rank, (i + 1) * rank)
        if grad_a is not None:
            torch.mm(g_low[:, rows].t(), apply(flat, drop), out=grad_a[rows])
        if grad_x is not None:
            product = g_low[:, rows] @ lora_a[rows]
            grad_x.add_(apply(product, drop, out=product).to(grad_x.dtype))
    return True


def _input_grads_native(
    flat: torch.Tensor,
    lora_a: torch.Tensor,
    g_low: torch.Tensor,
    drops: tuple[Drop, ...],
    grad_x: torch.Tensor | None,
    grad_a: torch.Tensor | None,
    bits: torch.Tensor | None,
) -> bool | None:
    """``masked_input_grads`` in the C kernel, from the kept bits where given; None where it
    does not take the call."""
    lib = _fused(flat, lora_a, grad_x) if flat.numel() < 2**32 and g_low.dtype == torch.float32 else None
    if lib is None:
        return None
    rank = _rank(lora_a, drops)
    tokens, hidden = flat.shape
    if bits is not None and (
        bits.shape != bits_shape(len(drops), tokens, hidden) or not bits.is_contiguous()
    ):
        raise ValueError(
            f"LoRA dropout: mask bits of shape {tuple(bits.shape)} for input {tuple(flat.shape)}"
        )
    failed = lib.twinkle_lora_masked_up_grad_f32(
        flat.data_ptr(), lora_a.data_ptr(), g_low.data_ptr(), g_low.stride(0), g_low.stride(1),
        grad_a.data_ptr() if grad_a is not None else None, grad_x.data_ptr() if grad_x is not None else None,
        tokens, hidden, rank, len(drops), *_keys(drops), bits.data_ptr() if bits is not None else None,
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("LoRA dropout: no memory for the kernel's scratch")
    return True


_INPUT_GRADS = {"native": _input_grads_native, "torch": _input_grads_torch}
