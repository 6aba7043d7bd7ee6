"""Transparent huge pages for torch's large CPU tensors, switched on at run time.

torch allocates CPU tensors with glibc, which maps a large block fresh from the kernel and
returns it when freed. Each first touch of a 4 KiB page of it then faults, and the kernel zeroes
the page: about 2 us a page here (a fresh 1 GiB filled in 0.64 s, refilled in 0.11 s). A long-row
step makes and frees gigabytes of temporaries (W2: ~200,000 faults and ~1.9 s of kernel time a
step). torch can instead align blocks of 2 MiB or more to 2 MiB and mark them ``MADV_HUGEPAGE``,
so the kernel maps them 2 MiB at a time, but only when ``THP_MEM_ALLOC_ENABLE=1`` is in the
environment before torch starts, which a script that imports torch before Twinkle cannot arrange.
``native/huge_pages.cpp`` does the same from an allocator installed at run time; smaller blocks
still go to torch's own. Results do not change: only how the kernel maps the memory does.

Measured (``bench/step_ab.py --switch huge-pages``, the same batches both ways in one process,
session 19): W2 page faults 139,000 -> 7,800 a step, kernel time 0.96 -> 0.53 s, median step
15.65 -> 15.42 s (0.985x, 8 each way); W1 0.983x (24 each way), with 7-8 ms of kernel time a step
either way (its blocks are small enough for glibc to keep). Too little for a compiled allocator:
not adopted (``bench/RESULTS.md``, session 19).

The model installs it for unsharded CPU training (``TransformersModel``) where the kernel offers
huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). The
library is compiled from its C++ source on first use (about 2 s, with ``$CXX`` or ``c++`` and the
headers torch ships) into ``<cache>/native/``, once per source, torch and compiler. Where that is
impossible (no compiler, no headers, not Linux) training runs without it and says so once.
``TWINKLE_HUGE_PAGES=0`` keeps torch's allocator; ``auto`` (the default) installs this one where
it can be built and the kernel offers huge pages; ``1`` requires it (an error says why not)."""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import file_lock
from twinkle.utils.logger import get_logger

SOURCE = Path(__file__).resolve().parents[1] / "native" / "huge_pages.cpp"
MIN_BLOCK = 2 << 20  # one huge page: smaller blocks stay with torch, as with THP_MEM_ALLOC_ENABLE
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
BUILD_SECONDS = 300

_state: dict[str, object] = {"library": None, "failed": None, "warned": False}


def _mode() -> str:
    mode = os.environ.get("TWINKLE_HUGE_PAGES", "auto").strip().lower()
    if mode not in ("0", "1", "auto"):
        raise UserError(f"TWINKLE_HUGE_PAGES must be 0, 1 or auto, got {mode!r}")
    return mode


def _compiler() -> str | None:
    configured = os.environ.get("CXX")
    if configured:
        return shutil.which(configured) or configured
    return shutil.which("c++") or shutil.which("g++")


def build(folder: Path) -> Path:
    """The compiled library under ``folder``, built first unless this source, torch and compiler
    built it before. Concurrent processes build it once (a lock), and a half-written file is never
    loaded (written aside, then renamed). Raises ``RuntimeError`` saying why it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    torch_dir = Path(torch.__file__).resolve().parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    if not (include / "c10" / "core" / "CPUAllocator.h").is_file():
        raise RuntimeError(f"torch's C++ headers are missing from {include}")
    abi = int(torch.compiled_with_cxx11_abi())
    key = hashlib.sha256(
        b"\0".join(
            [SOURCE.read_bytes(), torch.__version__.encode(), str(torch_dir).encode(), compiler.encode()]
        )
    ).hexdigest()[:16]
    target = folder / f"huge_pages-{key}.so"
    if target.is_file():
        return target
    with file_lock(folder / f"huge_pages-{key}.lock"):
        if target.is_file():
            return target
        tmp = folder / f".{target.name}.tmp-{os.getpid()}"
        command = [
            compiler, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(include), str(SOURCE), "-o", str(tmp),
            "-L", str(lib), "-lc10", f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as error:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{compiler} could not run: {error}") from error
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"{compiler} failed (exit {done.returncode}):\n{tail}")
        os.replace(tmp, target)
    return target


def kernel_offers() -> bool:
    """Whether the kernel maps huge pages for memory marked ``MADV_HUGEPAGE`` (the setting reads
    ``[always]`` or ``[madvise]``)."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _unavailable() -> str | None:
    """Why the allocator cannot be had in this process, or None."""
    if not sys.platform.startswith("linux"):
        return f"huge pages are used on Linux only, not on {sys.platform}"
    if not kernel_offers():
        return f"the kernel offers no transparent huge pages ({THP_SETTING} is missing or 'never')"
    return None


def _load() -> ctypes.CDLL | None:
    """The loaded library; built first if need be. None (and the reason kept) if it cannot be."""
    if _state["library"] is not None or _state["failed"] is not None:
        return _state["library"]
    from twinkle.hub.cache import cache_root

    try:
        library = ctypes.CDLL(str(build(cache_root() / "native")))
    except (RuntimeError, OSError) as error:
        _state["failed"] = str(error)
        return None
    library.twinkle_huge_pages_install.argtypes = [ctypes.c_uint64]
    library.twinkle_huge_pages_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    _state["library"] = library
    return library


def enable() -> bool:
    """Install the allocator (see the module's docstring) unless ``TWINKLE_HUGE_PAGES=0``;
    whether it is installed. Where it cannot be, ``1`` raises and ``auto`` says why once."""
    mode = _mode()
    if mode == "0":
        return False
    reason = _unavailable()
    library = None if reason else _load()
    if library is None:
        reason = reason or f"it could not be built: {_state['failed']}"
        if mode == "1":
            raise UserError(f"TWINKLE_HUGE_PAGES=1, but {reason}; fix that or unset TWINKLE_HUGE_PAGES")
        if not _state["warned"]:
            _state["warned"] = True
            get_logger().warning(
                "CPU tensors stay on 4 KiB pages (long rows train a little slower), as %s; "
                "TWINKLE_HUGE_PAGES=0 silences this",
                reason,
            )
        return False
    if not library.twinkle_huge_pages_installed():
        library.twinkle_huge_pages_install(MIN_BLOCK)
        get_logger().info("CPU tensors of %d MiB or more on transparent huge pages", MIN_BLOCK >> 20)
    return True


def disable() -> None:
    """Put torch's allocator back (blocks made here are still freed correctly)."""
    library = _state["library"]
    if library is not None:
        library.twinkle_huge_pages_uninstall()


def installed() -> bool:
    library = _state["library"]
    return library is not None and bool(library.twinkle_huge_pages_installed())


def stats() -> dict[str, int]:
    """Blocks made by the allocator, of which marked for huge pages, and its bytes in use: all
    zero before the first ``enable``."""
    out = (ctypes.c_uint64 * 3)()
    library = _state["library"]
    if library is not None:
        library.twinkle_huge_pages_stats(out)
    return dict(zip(("made", "marked", "live"), (int(v) for v in out), strict=True))
