"""This process's peak resident memory."""

import resource
import sys
from pathlib import Path

STATUS = Path("/proc/self/status")


def peak_rss_mib() -> float:
    """The process's peak resident set size in MiB: Linux's ``VmHWM``, the high-water mark of
    this process's own memory. ``getrusage``'s ``ru_maxrss`` is not that on Linux: it carries
    the parent's high-water mark across ``exec``, so a child started by a large process (a
    benchmark driver holding a model, a pytest process) reports the parent's peak until it
    outgrows it. Elsewhere ``ru_maxrss`` is all there is (KiB on Linux, bytes on macOS)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
