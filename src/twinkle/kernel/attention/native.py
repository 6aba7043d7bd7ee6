"""A packed row's attention on the CPU from a small C kernel, forward and backward.

torch's CPU flash kernel has a fixed cost per call and splits its backward by key/value head,
and a model's few key/value heads share out unevenly over the threads; the batched products of
``batched`` pay for padding and a dozen ops a layer. ``segment_attention.c`` runs the whole row in one call each way:
every (segment, key/value head) is a task of tiled products and a softmax over exactly the keys
each query sees, on torch's own OpenMP threads (the library links the ``libgomp`` torch has
loaded, so no second thread pool competes for the cores). Each task keeps its keys' gradients
apart and they are added in task order afterwards, so the results are the same for any thread
count. They equal the flash kernel's up to summation order (~1e-6 relative).

It is first in the ``packed_attention`` chain because it beats the path each row takes without
it, short rows and long (``bench/micro/attention_bench.py``, forward + backward; design note 15).
Built for 16-float vectors (tiles of 8 x 16) where the CPU has them, it runs up to about twice
as fast as on 8-float vectors, where a row of one long sample, which splits only by query head,
keeps the flash calls (``usable``).

The library is built at first use by ``kernel/native_build.py`` (the system's C compiler,
``-O3 -march=native``, cached). Without a compiler, OpenMP or a writable cache it is not used,
with one warning, and attention takes the other paths; ``TWINKLE_NATIVE_ATTENTION=0``
turns it off."""

import ctypes
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from twinkle.kernel import native_build, registry
from twinkle.kernel.attention import pooled
from twinkle.utils.logger import get_logger

SOURCE = Path(__file__).with_name("segment_attention.c")
FLAGS = native_build.OPENMP_FLAGS
COMPILER = native_build.COMPILER
TILE = 16  # the kernel's column tile: the head dimension must be a multiple of it
MIN_TASKS = 8  # fewer (segment, key/value head) tasks than this split by query head
LONG_SAMPLE = 512  # on 8-float vectors, a row of one sample this long keeps the flash calls
WIDE = 16  # vector floats from which the kernel takes rows of one long sample too

_state: dict[str, Any] = {}
_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _load() -> ctypes.CDLL:
    lib = native_build.load_library(SOURCE, FLAGS, COMPILER)
    lib.twinkle_attention_forward.argtypes = [_PTR] * 5 + [_INT] * 4 + [_FLOAT, _PTR, _INT, _INT]
    lib.twinkle_attention_backward.argtypes = [_PTR] * 10 + [_INT] * 4 + [_FLOAT, _PTR, _INT, _INT]
    lib.twinkle_attention_lanes.restype = _INT
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built at the first call of the process; None when it cannot be had
    (one warning says why)."""
    if "lib" not in _state:
        try:
            _state["lib"] = _load()
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            get_logger().warning("native attention not available, using torch's kernels: %s", error)
            _state["lib"] = None
    return _state["lib"]


def usable(query: torch.Tensor, key: torch.Tensor, spans: tuple, dropout: float, window: int | None) -> bool:
    """Whether this row's attention runs here: fp32 on the CPU, torch on OpenMP, no dropout or
    window, a head dimension the kernel tiles, and not one long sample where the kernel runs
    8-float vectors."""
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == torch.float32
        and not dropout
        and window is None
        and query.shape[-1] % TILE == 0
        and query.shape[1] % key.shape[1] == 0
        and registry.enabled("packed_attention", "native")
        and not (len(spans) == 1 and spans[0][1] - spans[0][0] >= LONG_SAMPLE and lanes() < WIDE)
    )


registry.register_call(
    "packed_attention",
    "native",
    lambda: pooled.OPENMP and library() is not None,
    "torch on OpenMP, a C compiler with OpenMP (cc) and a writable cache",
)


def lanes() -> int:
    """Floats in the vectors the built kernel runs (16 where the CPU has them, else 8)."""
    return library().twinkle_attention_lanes()


@lru_cache(maxsize=256)  # every layer of a step asks for the same row's plan
def tasks(segments: Any, heads: int, kv_heads: int) -> tuple[torch.Tensor, int]:
    """The kernel's tasks, ``(first head, heads, start, queries, prefix keys seen, first prefix
    key, slot row)`` each, longest first, and the rows of key gradients they keep. A task is a
    segment (a prefix's own queries, or a sample) with the query heads of one key/value head, or
    with one query head where that gives too few tasks to share out. The split depends on the row
    alone, not on the thread count, so neither do the results."""
    group = heads // kv_heads
    pieces = [(s, n, 0, 0) for s, n in segments.prefixes()] + [
        (s, e - s, seen, first)
        for (s, e), (first, seen) in zip(segments.spans, segments.contexts(), strict=True)
    ]
    split = len(pieces) * kv_heads < MIN_TASKS
    per = [(h, 1) for h in range(heads)] if split else [(g * group, group) for g in range(kv_heads)]
    items = [[h, n_heads, s, n, seen, first, 0] for h, n_heads in per for s, n, seen, first in pieces]
    items.sort(key=lambda t: -t[1] * t[3] * (t[4] + t[3] / 2))
    row = 0
    for item in items:
        item[6] = row
        row += item[3] + item[4]
    # a normal tensor even when first asked for under inference_mode (teacher scoring): the cache
    # hands it to training passes too, which save it for the backward
    with torch.inference_mode(False):
        return torch.tensor(items, dtype=torch.int32), row


class NativeSegmentAttention(torch.autograd.Function):
    """``apply(query (1, H, T, D), key, value (1, KV, T, D), segments, scale)`` ->
    ``(1, T, H, D)``."""

    @staticmethod
    def forward(ctx: Any, query, key, value, segments, scale):
        lib = library()
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, heads, D)
        length, heads, dim = q.shape
        kv_heads = k.shape[1]
        threads = torch.get_num_threads()
        plan, rows = tasks(segments, heads, kv_heads)
        out = torch.empty_like(q)
        lse = torch.empty(heads, length)
        failed = lib.twinkle_attention_forward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            length, heads, kv_heads, dim, scale, plan.data_ptr(), len(plan), threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("native attention: no memory for the kernel's scratch")
        ctx.save_for_backward(q, k, v, out, lse, plan)
        ctx.lib, ctx.rows, ctx.scale = lib, rows, scale  # the same library back
        return out[None]

    @staticmethod
    def backward(ctx: Any, grad_out):
        q, k, v, out, lse, plan = ctx.saved_tensors
        grad = grad_out[0].contiguous()
        length, heads, dim = q.shape
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        slots = torch.empty(2 * ctx.rows * dim)
        threads = torch.get_num_threads()
        failed = ctx.lib.twinkle_attention_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), grad.data_ptr(),
            grad_q.data_ptr(), grad_k.data_ptr(), grad_v.data_ptr(), slots.data_ptr(),
            length, heads, k.shape[1], dim, ctx.scale, plan.data_ptr(), len(plan), threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("native attention: no memory for the kernel's scratch")
        return (*(t.transpose(0, 1)[None] for t in (grad_q, grad_k, grad_v)), None, None)


def native_attention(query, key, value, segments: Any, scale: float | None) -> torch.Tensor:
    """``segments``: the row's ``packed.Segments``."""
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return NativeSegmentAttention.apply(query, key, value, segments, scale)
