"""The two products of a linear layer's frozen weight, routed to oneDNN on CPUs in fp32.

``linear(x, w, bias)`` is ``x @ w.T + bias`` (the forward) and ``times_weight(g, w)`` is
``g @ w`` (the input gradient). On the CPU, torch sends fp32 matrix products to MKL; oneDNN,
which torch also ships (its CPU compiler emits the op used here), runs them faster from the
same dense weight, with no copy or re-layout kept. ``bench/gemm_bench.py`` on the 2-core AMD
EPYC of our CI, SmolLM2-135M's shapes at 176 rows (a W1 batch): 1.07-1.40x for all but the
k/v forward (0.90x); 1.01-1.12x at 1000 rows; a 2048-square product 191 vs 220 GFLOP/s. A
whole W1 step: 0.820 vs 0.953 s median, W2: 13.8 vs 15.1 s (the same batches alternating
between the two, one process). oneDNN builds a kernel per new row count, once per step's shape,
not per layer: 0.7-1.4 ms per SmolLM2 projection shape (``gemm_bench.py --builds``), where MKL
builds nothing. Both are fp32 products with fp32 accumulation; they differ in summation order
(relative ~1e-6), so results are not bit-identical to ``torch.mm``.

oneDNN is used when both operands are plain 2-D fp32 CPU tensors that autograd is not
recording (the callers are autograd functions with their own backward), torch was built with
it, and ``TWINKLE_ONEDNN`` is not ``0``/``off``; everything else (GPUs, bf16, DTensors, a
build without oneDNN) takes the plain torch ops. A oneDNN call that fails turns it off for the
process, with a warning.

oneDNN, and ideep (torch's layer over it), each keep the kernels they built in a cache of 1024
shapes. A packed batch brings new row counts every step, so a long run filled both: 400 row
counts of one SmolLM2 weight grew the process by 505 MiB, all ten of its products over 600
row counts by 2.1 GiB. Importing Twinkle caps both caches at 32 shapes (a step uses about a
dozen) unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``LRU_CACHE_CAPACITY`` are already set: the
same 400 row counts then grew it by 66 MiB. The caps take effect only if no oneDNN kernel was
built in the process before; they also bound torch's own bf16 CPU products, which use oneDNN."""

import os

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

CACHE_CAPACITY = "32"
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, CACHE_CAPACITY)

_state = {"on": None}
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def onednn_enabled() -> bool:
    """Whether fp32 CPU products go to oneDNN in this process (``TWINKLE_ONEDNN``, read once)."""
    if _state["on"] is None:
        raw = os.environ.get("TWINKLE_ONEDNN", "1")
        value = raw.strip().lower()
        if value not in _ON + _OFF:
            raise UserError(
                f"TWINKLE_ONEDNN={raw!r} is not a switch: set it to 1 (oneDNN for fp32 CPU products, "
                "the default) or 0 (torch's own, MKL), or unset it"
            )
        built = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        _state["on"] = value in _ON and built
    return _state["on"]


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter  # not a DTensor or a subclass


def _eligible(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """oneDNN's op has no autograd formula: it serves the autograd functions' own products."""
    operands = (x, w) if bias is None else (x, w, bias)
    return (
        all(_plain(t) and t.dtype == torch.float32 and t.device.type == "cpu" for t in operands)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in operands))
        and x.dim() == 2
        and w.dim() == 2
        and x.shape[0] > 0
        and onednn_enabled()
    )


def _linear_pointwise(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a dense weight, the op torch's own CPU compiler emits."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def _onednn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    try:
        return _linear_pointwise(x, w, bias)
    except RuntimeError as err:  # an unsupported layout or build: plain torch from now on
        _state["on"] = False
        get_logger().warning("oneDNN products turned off, using torch.mm: %s", err)
        return None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for 2-D ``x`` of shape (rows, in) and ``w`` of shape (out, in)."""
    if _eligible(x, w, bias):
        out = _onednn(x, w, bias)
        if out is not None:
            return out
    return x @ w.t() if bias is None else torch.addmm(bias, x, w.t())


def times_weight(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g @ w`` for 2-D ``g`` of shape (rows, out) and ``w`` of shape (out, in)."""
    if _eligible(g, w):
        out = _onednn(g, w.t(), None)
        if out is not None:
            return out
    return g @ w
