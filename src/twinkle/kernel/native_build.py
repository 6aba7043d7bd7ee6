"""Build a small C source into a shared library at first use and load it.

The library is compiled with the system's C compiler (``-O3 -march=native``, about a second)
into ``<cache>/native/``, keyed by the source, the flags, the compiler and the CPU, and loaded
from there afterwards. The build goes to a temporary file renamed into place, under a file lock,
so processes starting together build it once. A file that does not load (a full disk, a killed
build) is built again once. Callers turn the ``RuntimeError`` / ``OSError`` of a machine without a
compiler into a fall-through to their torch path."""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from twinkle.utils.fileio import file_lock

COMPILER = "cc"
OPENMP_FLAGS = (
    "-O3 -march=native -fopenmp -fno-math-errno -fassociative-math -fno-signed-zeros "
    "-fno-trapping-math -ffp-contract=fast -shared -fPIC"
).split()


def cpu_identity() -> str:
    """The CPU lines a build depends on (model, flags), so a cache shared across machines never
    loads code built for another instruction set."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def library_path(source: Path, flags: list[str], compiler: str) -> Path:
    from twinkle.utils.cache import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = "\n".join(
        [source.read_text(encoding="utf-8"), " ".join(flags), version, cpu_identity(), platform.machine()]
    )
    return cache_root() / "native" / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def compile_library(source: Path, flags: list[str], path: Path, compiler: str) -> None:
    """Build into a temporary file beside ``path`` and rename it into place (another process may
    be loading the same path)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300
        )
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: Path, flags: list[str] = OPENMP_FLAGS, compiler: str = COMPILER) -> ctypes.CDLL:
    """``source`` built with ``flags`` and loaded; raises ``RuntimeError`` without a compiler."""
    found = shutil.which(compiler)
    if found is None:
        raise RuntimeError(f"no C compiler ({compiler!r}) on PATH")
    path = library_path(source, flags, found)
    with file_lock(path.with_name(path.name + ".lock")):
        if not path.is_file():
            compile_library(source, flags, path, found)
        try:
            return ctypes.CDLL(str(path))
        except OSError:  # a damaged file: build it again once
            compile_library(source, flags, path, found)
            return ctypes.CDLL(str(path))


def lazy(load: Callable[[], ctypes.CDLL], what: str) -> Callable[[], ctypes.CDLL | None]:
    """A function that returns ``load()``'s library, built at its first call; None (with one
    warning naming ``what`` and why) where it cannot be had: no compiler, a failed build, a
    build lacking a symbol."""
    state: dict[str, ctypes.CDLL | None] = {}

    def library() -> ctypes.CDLL | None:
        if "lib" not in state:
            try:
                state["lib"] = load()
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
                from twinkle.utils.logger import get_logger

                get_logger().warning("%s not available: %s", what, error)
                state["lib"] = None
        return state["lib"]

    return library
