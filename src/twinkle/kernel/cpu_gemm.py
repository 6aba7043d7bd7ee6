"""Call op ``cpu_gemm``: a frozen weight's two fp32 CPU products, ``linear(x, w, bias)``
(``x @ w.T + bias``, the forward) and ``times_weight(g, w)`` (``g @ w``, the input gradient), and
a decoding step's product of a few rows, ``few_rows(x, w, bias, onednn)``.

oneDNN, which torch ships beside MKL, runs most of these products faster from the same dense
weight, but the two libraries sum in different orders (~1e-6 relative), so the library a product
takes changes a run's losses. The choice is therefore a fixed rule, never a timing:
``TWINKLE_ONEDNN=on`` (the default) sends every eligible product to oneDNN, ``off`` to MKL.
``auto`` (opt-in) times both once per machine and shape (``faster_here``; oneDNN must win by
``ONEDNN_MARGIN``) and keeps the choices in ``<cache>/gemm/routes-*.json``: its runs are
reproducible only while that file is kept. Eligible are plain 2-D fp32 CPU tensors that autograd
is not recording; everything else takes the torch ops, and a failing oneDNN call leaves the chain
(``packed`` -> ``onednn`` -> ``torch``) for the process with one warning.

``bound_onednn_caches()`` caps oneDNN's and ideep's kernel caches at 32 shapes (a step uses about a
dozen) unless the user set them: packed batches bring new row counts every step, and the default
caches (1024 shapes each) grow the process by hundreds of MiB. It works only before the process
builds its first oneDNN kernel, so the model calls it before loading and this module before its
first oneDNN call; the caps also bound torch's own bf16 CPU products.

``pack_frozen(weights)`` keeps each frozen weight's copy in oneDNN's blocked layout for
``linear``, because from a dense weight oneDNN re-lays it out on every call; results equal the
dense ones bit for bit from 7 rows up. ``times_weight`` keeps the dense weight: its transposed view
is about as fast as a packed copy of ``W.T``. The copies cost the weights' size again, so the model
packs only when it trains unsharded on the CPU, in ``auto`` only shapes whose forward oneDNN wins
here, and at most 1/``PACK_SHARE`` of installed memory or of the container's limit (not free
memory, so every run on one machine packs the same weights). A weight changed in place is
packed again on its next use, and a copy is freed with its weight. ``keep_dense(weights)`` frees
the copies of weights whose dense form is the one in use and packs them no more: a sampler that
shares a trainer's model decodes from the dense weights every token, and there the copies would
speed only the prefill's and the training forward's products, by a few percent of those, while
holding the frozen model twice. Design notes 23 and 24."""

import hashlib
import json
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from twinkle.kernel import registry, switches
from twinkle.utils.fileio import atomic_write_text, file_lock
from twinkle.utils.logger import get_logger

CACHE_CAPACITY = "32"
_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CALIBRATION_ROWS = 128  # rows of the products timed to choose a library (W1 runs 145-235)
CALIBRATION_REPEATS = 5  # timed calls per library, after one warm-up each
# oneDNN must be this much faster to be chosen: near-equal shapes stay with torch's own library,
# which builds no kernel per new row count and needs no packed copy (measured choices flipped
# between processes on shapes within a few percent)
ONEDNN_MARGIN = 0.95
FEW_ROWS = {"gemv": 1, "gemv8": 8}  # a decoding step's products, timed at 1 and 8 rows
GEMV_BYTES = 64 << 20  # "gemv" is timed over copies of the weight this large in all: past the caches
GEMV_COPIES = 32
# (product, out, in) -> whether oneDNN was faster here; product is "linear" or "times_weight"
_faster: dict[tuple[str, int, int], bool] = {}
# once read: "file", this machine's file of measured choices, and "machine", what keys it
_routes: dict[str, object] = {}
PACK_SHARE = 4  # packed copies take at most 1/PACK_SHARE of physical memory
PACK_ROWS_HINT = 256  # the row count oneDNN picks the layout for (any count runs; 32-2048 measured equal)
# id(weight) -> (weak reference, weight._version, data_ptr, packed copy)
_packed: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}
# id(weight) -> weak reference: weights kept dense only (``keep_dense``), which ``pack_frozen`` skips
_dense_only: dict[int, weakref.ref] = {}
_ON, _OFF, _AUTO = ("1", "true", "on", "yes"), ("0", "false", "off", "no"), ("auto", "")


def bound_onednn_caches() -> None:
    """Cap oneDNN's and ideep's kernel caches at ``CACHE_CAPACITY`` shapes unless the user set them
    (see the module docstring); call before the process builds its first oneDNN kernel."""
    for name in _CACHE_VARIABLES:
        os.environ.setdefault(name, CACHE_CAPACITY)


def _built() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _can_pack() -> bool:
    return _built() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


OP = "cpu_gemm"
registry.register_call(OP, "packed", _can_pack, "torch built with oneDNN weight packing", needs="onednn")
registry.register_call(OP, "onednn", _built, "torch built with oneDNN (mkldnn)")
registry.register_call(OP, "torch", lambda: True, "nothing", plain=True)


def _mode() -> str:
    """``TWINKLE_ONEDNN`` as "auto", "on" or "off" ("off" where oneDNN is not usable here)."""
    return switches.value("TWINKLE_ONEDNN") if onednn_enabled() else "off"


def onednn_enabled() -> bool:
    """Whether fp32 CPU products may go to oneDNN in this process: ``onednn``, or ``packed``
    (which runs on it), in the chain and usable."""
    return registry.enabled(OP, "onednn") or registry.enabled(OP, "packed")


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


_first_call = [True]


def _onednn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    if _first_call[0]:
        bound_onednn_caches()
        _first_call[0] = False
    try:
        return _linear_pointwise(x, w, bias)
    except RuntimeError as err:  # an unsupported layout or build: plain torch from now on
        registry.disable(OP, "onednn", f"RuntimeError: {err}")
        return None


def _torch_product(a: torch.Tensor, w: torch.Tensor, product: str) -> torch.Tensor:
    return a @ w if product == "times_weight" else a @ w.t()


def _onednn_product(
    a: torch.Tensor, w: torch.Tensor, product: str, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``product`` on oneDNN, from ``w``'s packed copy where it has one (``gemv``: the dense
    weight); None if oneDNN failed."""
    if product in FEW_ROWS:
        return _onednn(a, w, bias)
    if product == "linear":
        packed = _packed and registry.enabled(OP, "packed")
        return _onednn(a, _packed_weight(w) if packed else w, bias)
    return _onednn(a, w.t(), None)


def few_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """``x @ w.T + bias`` for a decoding step's few rows: on oneDNN's dense product where
    ``onednn`` (``faster_here("gemv", w)`` or "gemv8", asked once per layer) and the operands are
    eligible, else torch's."""
    if onednn and _eligible(x, w, bias):
        out = _onednn(x, w, bias)
        if out is not None:
            return out
    return torch.nn.functional.linear(x, w, bias)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(product: str, w: torch.Tensor) -> bool:
    """Whether oneDNN computes ``product`` ("linear": ``x @ w.T``; "times_weight": ``g @ w``;
    "gemv", "gemv8": ``x @ w.T`` for 1 or 8 rows) faster than torch here, at ``CALIBRATION_ROWS``
    rows (or those few, over copies of ``w`` that outgrow the caches, as decoding streams weights):
    both alternating, medians compared, oneDNN's needing to be ``ONEDNN_MARGIN`` of torch's or less."""
    cols = w.shape[0] if product == "times_weight" else w.shape[1]
    rows = FEW_ROWS.get(product, CALIBRATION_ROWS)
    # fixed values: no draw from the random number generators a training run relies on
    a = torch.linspace(-1.0, 1.0, rows * cols, dtype=w.dtype).view(rows, cols)
    copies = [w]
    if product in FEW_ROWS:
        copies += [w.clone() for _ in range(min(GEMV_COPIES, GEMV_BYTES // max(w.nbytes, 1)))]
    if _onednn_product(a, w, product) is None:  # warm-up (oneDNN builds its kernel); failed: off
        return False
    _torch_product(a, w, product)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(CALIBRATION_REPEATS):
        ours.append(_seconds(lambda: [_onednn_product(a, c, product) for c in copies]))
        theirs.append(_seconds(lambda: [_torch_product(a, c, product) for c in copies]))
    faster = statistics.median(ours) < ONEDNN_MARGIN * statistics.median(theirs)
    get_logger().debug(
        "gemm: %s %s %s: oneDNN %.0f us, torch %.0f us",
        product,
        tuple(w.shape),
        "oneDNN" if faster else "torch",
        statistics.median(ours) * 1e6 / len(copies),
        statistics.median(theirs) * 1e6 / len(copies),
    )
    return faster


def _machine() -> dict[str, object]:
    """What a measured choice depends on: the CPU, the threads, torch, and how it was measured."""
    cpu = platform.processor() or platform.machine()
    try:  # Linux: the first processor's name, family, model and stepping
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            first = handle.read().split("\n\n")[0]
        fields = {
            k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in first.splitlines() if ":" in ln)
        }
        cpu = " / ".join(fields.get(k, "") for k in ("model name", "cpu family", "model", "stepping")) or cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "method": [CALIBRATION_ROWS, CALIBRATION_REPEATS, ONEDNN_MARGIN],
    }


def _routes_file(machine: dict[str, object] | None = None) -> Path:
    from twinkle.utils.cache import cache_root

    machine = machine or _machine()
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "gemm" / f"routes-{digest}.json"


def _read_routes(path: Path) -> dict[tuple[str, int, int], bool]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))["choices"]
        choices = {}
        for name, onednn in raw.items():
            product, out, inp = name.split()
            choices[(product, int(out), int(inp))] = bool(onednn)
        return choices
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        get_logger().warning(
            "gemm: ignoring the unreadable routing cache %s (%s); measuring again", path, error
        )
        return {}


def _remember(key: tuple[str, int, int], choice: bool) -> bool:
    """Keep a measured choice in this machine's file, so that later processes (and the other ranks
    of this run) take the same library and compute the same sums. A choice another process wrote
    first wins; returns the choice to use. Without a writable cache the process keeps its own."""
    path = _routes.get("file")
    if not isinstance(path, Path):
        return choice
    try:
        with file_lock(path.with_name(path.name + ".lock")):
            choices = _read_routes(path)
            choice = choices.setdefault(key, choice)
            text = json.dumps(
                {
                    "machine": _routes["machine"],  # the file's key, as read once
                    "choices": {f"{p} {o} {i}": c for (p, o, i), c in sorted(choices.items())},
                },
                indent=1,
            )
            atomic_write_text(path, text + "\n")
    except OSError as error:
        get_logger().debug("gemm: cannot keep the routing cache %s: %s", path, error)
    return choice


def faster_here(product: str, w: torch.Tensor) -> bool:
    """Whether ``product`` with weights of ``w``'s shape goes to oneDNN: always with
    ``TWINKLE_ONEDNN=on`` (the default), never with ``off``; in ``auto``, as measured
    (``_measure``) once per machine and shape and kept in ``<cache>/gemm/``, so every run that
    reads that file computes the same sums. "gemv" and "gemv8", a decoding step's products of a
    few rows, are measured so in ``on`` too: neither library wins it on every CPU (on some,
    oneDNN's dense product of one row takes about half of MKL's time; on others MKL wins), and it
    only changes a sampler's sums (about 1e-6)."""
    mode = _mode()
    if mode == "off" or (mode == "on" and product not in FEW_ROWS):
        return mode == "on"
    key = (product, *w.shape)
    choice = _faster.get(key)
    if choice is None and "file" not in _routes:  # this process's first question: read the file
        _routes["machine"] = machine = _machine()
        _routes["file"] = path = _routes_file(machine)
        _faster.update({k: v for k, v in _read_routes(path).items() if k not in _faster})
        choice = _faster.get(key)
    if choice is None:
        choice = _faster[key] = _remember(key, _measure(product, w))
    return choice


# a container's memory limit, cgroup v2 then v1 ("max" or a huge number: none)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _physical_bytes() -> int:
    """The machine's memory, or the container's limit where that is lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no packing
        return 0
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)


def _drop(key: int) -> None:
    _packed.pop(key, None)


def _packable(w: torch.Tensor) -> bool:
    return (
        _plain(w)
        and not w.requires_grad
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.dim() == 2
        and w.is_contiguous()
        and w.numel() > 0
    )


def pack_frozen(weights: list[torch.Tensor]) -> int:
    """Keep a oneDNN-packed copy of each frozen (no ``requires_grad``), contiguous 2-D fp32 CPU
    weight for ``linear``'s products, in order, while their total stays within
    1/``PACK_SHARE`` of physical memory; returns the bytes packed. Nothing when oneDNN is off,
    and no copy of a shape whose forward product torch computes faster here (``faster_here``,
    measured with the first such weight's copy)."""
    if not registry.enabled(OP, "packed"):
        return 0
    budget = _physical_bytes() // PACK_SHARE - packed_bytes()
    packed = 0
    for w in weights:
        if not _packable(w) or id(w) in _packed or _kept_dense(w):
            continue
        if _mode() == "auto" and _faster.get(("linear", *w.shape)) is False:
            continue  # torch's product is faster for this shape here: no copy
        if w.nbytes > budget - packed:
            break
        try:
            copy = _pack(w)
        except RuntimeError as err:  # a build that cannot: the dense weights
            registry.disable(OP, "packed", f"RuntimeError: {err}")
            break
        _packed[id(w)] = (weakref.ref(w), w._version, w.data_ptr(), copy)
        if not faster_here("linear", w):  # measured with this packed copy: torch wins this shape
            _drop(id(w))
            continue
        weakref.finalize(w, _drop, id(w))
        packed += w.nbytes
    return packed


def _kept_dense(w: torch.Tensor) -> bool:
    ref = _dense_only.get(id(w))
    return ref is not None and ref() is w


def keep_dense(weights: list[torch.Tensor]) -> int:
    """Free the packed copies of ``weights`` and make none of them from now on (``pack_frozen``
    skips them); returns the bytes freed. Their products then run from the dense weights, with the
    same sums from 7 rows up (see the module docstring), so a step's losses do not change."""
    freed = 0
    for w in weights:
        entry = _packed.get(id(w))
        if entry is not None and entry[0]() is w:
            freed += entry[3].nbytes
            _drop(id(w))
        if not _kept_dense(w):
            _dense_only[id(w)] = weakref.ref(w)
            weakref.finalize(w, _dense_only.pop, id(w), None)
    return freed


def packed_bytes() -> int:
    """The bytes held by packed copies in this process."""
    return sum(entry[3].nbytes for entry in _packed.values())


def _packed_weight(w: torch.Tensor) -> torch.Tensor:
    """``w``'s packed copy, packed again if ``w`` changed in place since; else ``w``."""
    entry = _packed.get(id(w))
    if entry is None or entry[0]() is not w:
        return w
    if entry[1] != w._version or entry[2] != w.data_ptr():
        try:
            entry = (entry[0], w._version, w.data_ptr(), _pack(w) if _packable(w) else None)
        except RuntimeError:
            entry = (entry[0], w._version, w.data_ptr(), None)
        if entry[3] is None:  # no longer packable (or packing failed): the dense weight from now on
            _drop(id(w))
            return w
        _packed[id(w)] = entry
    return entry[3]


def _packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Backend ``packed``: oneDNN from ``w``'s packed copy, where it has one."""
    if not (
        _packed and _eligible(x, w, bias) and registry.enabled(OP, "packed") and faster_here("linear", w)
    ):
        return None
    copy = _packed_weight(w)
    return None if copy is w else _onednn(x, copy, bias)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Backend ``onednn``: oneDNN from the dense weight."""
    if not (_eligible(x, w, bias) and registry.enabled(OP, "onednn") and faster_here("linear", w)):
        return None
    return _onednn(x, w, bias)


def _torch_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ w.t() if bias is None else torch.addmm(bias, x, w.t())


def _onednn_times(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    if not (_eligible(g, w) and registry.enabled(OP, "onednn") and faster_here("times_weight", w)):
        return None
    return _onednn(g, w.t(), None)


def _no_copy(g: torch.Tensor, w: torch.Tensor) -> None:
    """``packed`` has no form of ``g @ w``: the dense weight's transposed view is as fast as a
    packed copy of ``w.T``."""
    return None


_LINEAR = {"packed": _packed_linear, "onednn": _onednn_linear, "torch": _torch_linear}
_TIMES_WEIGHT = {"packed": _no_copy, "onednn": _onednn_times, "torch": lambda g, w: g @ w}


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for 2-D ``x`` of shape (rows, in) and ``w`` of shape (out, in), by
    the first backend of ``cpu_gemm``'s chain that takes it."""
    return registry.dispatch(OP, _LINEAR, x, w, bias)


def times_weight(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g @ w`` for 2-D ``g`` of shape (rows, out) and ``w`` of shape (out, in), by the first
    backend of ``cpu_gemm``'s chain that takes it."""
    return registry.dispatch(OP, _TIMES_WEIGHT, g, w)
