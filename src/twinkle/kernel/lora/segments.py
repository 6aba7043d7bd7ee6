"""Call op ``lora_segments``: the LoRA products of a packed row whose consecutive runs of tokens
belong to different adapters, all runs of one layer in one call.

For each run ``(start, end, lora_a, lora_b, scale)``, ``add_segments`` adds
``scale * (x[start:end] @ lora_a.T) @ lora_b.T`` to ``out[start:end]`` in place. Run by run in
torch that is two BLAS calls per adapter on about a hundred tokens and a rank of a few rows, and
the libraries' fixed cost per call outweighs that little arithmetic; ``segments.c`` (backend
``native``, built at first use like the other C kernels) does every run in one call, threads over
blocks of tokens. Each output is one thread's sum in a fixed order, so the result does not depend
on the thread count; it differs from torch's by summation order (about 1e-6 relative).

``add_segments`` walks the op's chain with ``registry.dispatch``. Backend ``torch`` is the
caller's own loop (``twinkle.model.lora_modes``): ``add_segments`` returns False and leaves ``out``
alone where ``native`` does not take the call: no C compiler here, a tensor that is not a plain
fp32 CPU tensor (a DTensor, say), ``out`` or ``x`` not 2-D and contiguous, shapes that do not
match, runs outside the row or overlapping, a rank above ``MAX_RANK``, autograd recording (grad
mode on and an operand that requires grad), or the op's chain without ``native``."""

import ctypes
from array import array
from itertools import pairwise
from pathlib import Path

import torch

from twinkle.kernel import native_build, registry

SOURCE = Path(__file__).with_name("segments.c")
OP = "lora_segments"
MAX_RANK = 128  # the kernel's limit on the rows of an adapter's A

Run = tuple[int, int, torch.Tensor, torch.Tensor, float]


def _load() -> ctypes.CDLL:
    lib = native_build.load_library(SOURCE)
    P, INT, LONG = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.twinkle_lora_segments_f32.argtypes = [P, P, LONG, LONG, LONG, INT, P, P, P, P, P, P, INT]
    lib.twinkle_lora_segments_f32.restype = INT
    lib.twinkle_lora_segments_max_rank.restype = INT
    if (array("l").itemsize, array("L").itemsize, array("i").itemsize) != (
        ctypes.sizeof(LONG),
        ctypes.sizeof(P),
        ctypes.sizeof(INT),
    ):
        raise RuntimeError("C long and pointers of other sizes than this kernel's call assumes")
    if lib.twinkle_lora_segments_max_rank() != MAX_RANK:
        raise RuntimeError("the built LoRA segments kernel takes another rank limit than segments.py")
    return lib


# the compiled kernel, built at the process's first call; None when it cannot be had
library = native_build.lazy(_load, "native LoRA segments (using torch's products run by run)")

registry.register_call(OP, "native", lambda: library() is not None, "a C compiler (cc) and a writable cache")
registry.register_call(OP, "torch", lambda: True, "nothing", plain=True)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass such as DTensor: no local shard to read


def _plain_f32(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN and t.dtype is torch.float32 and t.is_cpu


def _address(values: array) -> int:
    return values.buffer_info()[0]


def _native(out: torch.Tensor, x: torch.Tensor, runs: list[Run]) -> bool | None:
    """Backend ``native``: every run in one call of the kernel; True once done, None with ``out``
    untouched where it does not take the call."""
    if not registry.enabled(OP, "native"):
        return None
    if not (
        _plain_f32(out)
        and _plain_f32(x)
        and out.dim() == 2
        and x.dim() == 2
        and out.is_contiguous()
        and x.is_contiguous()
        and out.shape[0] == x.shape[0]
    ):
        return None
    tokens, k = x.shape
    n = out.shape[1]
    grad = torch.is_grad_enabled()
    if grad and (out.requires_grad or x.requires_grad):
        return None
    o0, x0 = out.data_ptr(), x.data_ptr()
    if out.numel() and x.numel() and o0 < x0 + 4 * x.numel() and x0 < o0 + 4 * out.numel():
        return None  # out would be written while x is read
    starts, ends = array("l"), array("l")
    a_ptrs, b_ptrs = array("L"), array("L")
    ranks, scales = array("i"), array("f")
    kept = []  # the contiguous copies (if any) stay referenced until the call returns
    for start, end, lora_a, lora_b, scale in runs:
        if not (
            _plain_f32(lora_a) and _plain_f32(lora_b) and lora_a.dim() == 2 and 0 <= start <= end <= tokens
        ):
            return None
        rank = lora_a.shape[0]
        if not (1 <= rank <= MAX_RANK and lora_a.shape[1] == k and lora_b.shape == (n, rank)):
            return None
        if grad and (lora_a.requires_grad or lora_b.requires_grad):
            return None
        if end == start:
            continue
        if not lora_a.is_contiguous():
            lora_a = lora_a.contiguous()
            kept.append(lora_a)
        if not lora_b.is_contiguous():
            lora_b = lora_b.contiguous()
            kept.append(lora_b)
        starts.append(start)
        ends.append(end)
        a_ptrs.append(lora_a.data_ptr())
        b_ptrs.append(lora_b.data_ptr())  # (N, r): the kernel transposes it
        ranks.append(rank)
        scales.append(scale)
    spans = sorted(zip(starts, ends, strict=True))
    if any(b[0] < a[1] for a, b in pairwise(spans)):  # overlapping runs
        return None
    if not spans:
        return True
    failed = library().twinkle_lora_segments_f32(
        o0, x0, tokens, k, n, len(starts), _address(starts), _address(ends), _address(a_ptrs),
        _address(b_ptrs), _address(ranks), _address(scales), torch.get_num_threads(),
    )  # fmt: skip
    if failed == -2:
        raise MemoryError("LoRA segments: no memory for the kernel's scratch")
    if failed:
        raise RuntimeError(f"LoRA segments: the kernel refused runs segments.py checked ({failed})")
    return True


def _caller_loops(out: torch.Tensor, x: torch.Tensor, runs: list[Run]) -> None:
    """Backend ``torch``: the caller's own loop of two products per run runs instead."""
    return None


_RUN = {"native": _native, "torch": _caller_loops}


def add_segments(out: torch.Tensor, x: torch.Tensor, runs: list[Run]) -> bool:
    """``out[start:end] += scale * (x[start:end] @ lora_a.T) @ lora_b.T`` for every run
    ``(start, end, lora_a (r, K), lora_b (N, r), scale)`` of ``runs`` (disjoint, in any order),
    ``out`` (T, N) and ``x`` (T, K) contiguous fp32 CPU tensors, by the first backend of
    ``lora_segments``'s chain that takes it; True once done. False, with ``out`` untouched, where
    the chain leaves the call to the caller's loop (backend ``torch``; the module's docstring)."""
    return registry.dispatch(OP, _RUN, out, x, runs) is not None
