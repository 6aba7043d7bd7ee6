"""``peak_rss_mib`` is the process's own peak: a child started by a large process does not
report the parent's (``ru_maxrss`` does on Linux, carried across ``exec``)."""

import subprocess
import sys

import pytest

from twinkle.utils.memory import peak_rss_mib

CHILD = "from twinkle.utils.memory import peak_rss_mib; print(peak_rss_mib())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_of_a_large_process_reports_its_own_peak():
    held = bytearray(400 * 2**20)
    held[::4096] = b"\1" * len(held[::4096])  # touch every page: resident
    parent = peak_rss_mib()
    assert parent >= 400
    child = float(
        subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    )
    assert 0 < child < parent - 300, (
        child,
        parent,
    )  # the child's own peak is an interpreter's, far below 400 MiB
    big = "x = bytearray(200 * 2**20); x[::4096] = b'\\1' * len(x[::4096]); " + CHILD.replace("; ", "\n", 1)
    grown = float(
        subprocess.run(
            [sys.executable, "-c", big.replace("\n", "; ")], capture_output=True, text=True, check=True
        ).stdout
    )
    assert grown >= child + 190, (grown, child)  # and it sees its own growth
    del held
