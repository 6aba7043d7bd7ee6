"""A sampler's frozen linear layers compute through ``twinkle.kernel``, as training does.

Training sends the products of frozen fp32 CPU weights to oneDNN by a fixed rule and keeps
oneDNN-packed copies of them (design notes 23 and 24); its LoRA layers do so inside their fused
nodes. A sampler's plain ``nn.Linear`` layers (the output head, the base layers of a model the
sampler owns) would otherwise run torch's default library. ``route`` gives each of them a
forward that calls ``cpu_gemm.linear`` (which falls back to torch for anything ineligible: not
fp32, not CPU, a sharded weight), except for decoding steps of at most ``GEMV_ROWS`` rows, which
take call op ``decode_gemv``: a C kernel that streams each weight once, else oneDNN's dense
product or torch's, as measured once per machine and weight shape at 1 and at 8 rows
(``faster_here("gemv", ...)``, asked only when the kernel does not take the call); ``pack``
keeps packed copies of a sampler-owned model's frozen weights. Each changes summation order only
(about 1e-6 relative)."""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from twinkle.kernel import cpu_gemm, gemv

# A decoding step of a few rows is a matrix-vector product, which oneDNN's packed GEMM (the
# winner from 16 rows up) runs about half as fast as the dense products at 1-2 rows.
GEMV_ROWS = gemv.MAX_ROWS


def _forward(module: nn.Linear, onednn: dict[str, bool], x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    w, bias = module.weight, module.bias
    if flat.shape[0] > GEMV_ROWS:
        out = cpu_gemm.linear(flat, w, bias)
    else:  # the library's measured answers for this layer's weight kept in ``onednn``
        out = gemv.few_rows(flat, w, bias, onednn)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def plain_linears(lm: Any) -> list[nn.Linear]:
    """The ``nn.Linear`` layers of ``lm`` that run their own forward (LoRA base layers included:
    PEFT calls them when no adapter runs)."""
    return [m for m in lm.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]


def route(linears: list[nn.Linear]) -> None:
    for module in linears:
        module.forward = functools.partial(_forward, module, {})


def unroute(linears: list[nn.Linear]) -> None:
    for module in linears:
        module.__dict__.pop("forward", None)


@contextlib.contextmanager
def routed(lm: Any) -> Iterator[None]:
    """``lm``'s plain linear layers routed while the block runs (a trainer's modules, shared)."""
    linears = plain_linears(lm)
    route(linears)
    try:
        yield
    finally:
        unroute(linears)


def pack(lm: Any) -> int:
    """Packed copies of ``lm``'s frozen linear weights (``cpu_gemm.pack_frozen``); the bytes."""
    weights = [m.weight for m in lm.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
    return cpu_gemm.pack_frozen(weights)
