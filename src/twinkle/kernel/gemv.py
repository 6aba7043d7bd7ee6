"""Call op ``decode_gemv``: ``x @ w.T + bias`` for a decoding step's few rows (at most
``MAX_ROWS``) by a frozen fp32 CPU weight.

A product of one row reads each weight once and does two flops per weight, so its time is the
time the weights take to stream from memory. Neither library torch ships runs it at that rate on
every CPU (on some, at about half of it); ``gemv.c`` does, as it gives each thread a run of
weight rows and multiplies each row, once read, by every row of ``x`` (backend ``native``, built
at first use like the attention kernel). Each output is one thread's sum in a fixed order,
so the results do not depend on the thread count; they differ from the libraries' by summation
order (about 1e-6 relative), which moves a sampler's log-probs, not a training loss: training
never calls this op.

The chain is ``native`` -> ``torch``, where ``torch`` is ``cpu_gemm.few_rows``: oneDNN's dense
product or MKL's, as measured for the weight's shape on this machine (``cpu_gemm.faster_here``,
asked only for calls the kernel does not take). ``TWINKLE_NATIVE_GEMV=off`` or a machine without
a C compiler takes ``torch``. A sampler's linear layers call ``few_rows`` (``sampler/linears.py``)."""

import ctypes
from pathlib import Path

import torch

from twinkle.kernel import cpu_gemm, native_build, registry

SOURCE = Path(__file__).with_name("gemv.c")
OP = "decode_gemv"
MAX_ROWS = 8  # the kernel's limit; from 16 rows on, oneDNN's blocked products are as fast


def _load() -> ctypes.CDLL:
    lib = native_build.load_library(SOURCE)
    P, INT, LONG = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.twinkle_gemv_f32.argtypes = [P, P, P, P, INT, LONG, LONG, INT]
    lib.twinkle_gemv_f32.restype = INT
    lib.twinkle_gemv_max_rows.restype = INT
    if lib.twinkle_gemv_max_rows() != MAX_ROWS:
        raise RuntimeError("the built gemv kernel takes another number of rows than gemv.py")
    return lib


# the compiled kernel, built at the process's first call; None when it cannot be had
library = native_build.lazy(_load, "native decoding products (using torch's)")


registry.register_call(OP, "native", lambda: library() is not None, "a C compiler (cc) and a writable cache")
registry.register_call(OP, "torch", lambda: True, "nothing", plain=True)


def _dense(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.is_contiguous()
    )


def takes(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``native`` computes this product: 2-D fp32 CPU operands, dense, at most
    ``MAX_ROWS`` rows, nothing for autograd to record, and the kernel built here."""
    return (
        x.dim() == 2
        and w.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[1]
        and _dense(x)
        and _dense(w)
        and (bias is None or (_dense(bias) and bias.shape == (w.shape[0],)))
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and registry.enabled(OP, "native")
    )


def native(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """Backend ``native``: the kernel's product, or None where it does not take the call."""
    if not takes(x, w, bias):
        return None
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    library().twinkle_gemv_f32(
        x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], w.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    return out


def _plain(w: torch.Tensor) -> bool:
    return (
        type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == torch.float32 and w.device.type == "cpu"
    )


def _library_product(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, choices: dict[str, bool]
) -> torch.Tensor:
    """Backend ``torch``: ``cpu_gemm.few_rows`` on the library measured faster here for ``w``'s
    shape at one row ("gemv", for 1-2 rows) or at ``MAX_ROWS`` ("gemv8"), each answer kept in
    ``choices``."""
    product = "gemv8" if x.shape[0] > 2 else "gemv"
    onednn = choices.get(product)
    if onednn is None:
        onednn = choices[product] = _plain(w) and cpu_gemm.faster_here(product, w)
    return cpu_gemm.few_rows(x, w, bias, onednn)


_RUNNERS = {"native": lambda x, w, bias, choices: native(x, w, bias), "torch": _library_product}


def few_rows(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, choices: dict[str, bool] | None = None
) -> torch.Tensor:
    """``x @ w.T + bias`` for 2-D ``x`` of at most ``MAX_ROWS`` rows, by the first backend of
    ``decode_gemv``'s chain that takes it: the kernel, else the library measured faster for ``w``
    (``_library_product``). ``choices``: the caller's record of those measured answers for ``w``
    (one dict per weight, kept between calls, so each is looked up once per weight); None: a
    fresh one."""
    return registry.dispatch(OP, _RUNNERS, x, w, bias, {} if choices is None else choices)
