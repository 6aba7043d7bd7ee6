"""``fixed_mmap_threshold``, which ``initialize()`` applies on the CPU: a large tensor freed
after a larger one goes back to the system. By default glibc raises its mapping threshold when
the first large block is freed, so the second comes from the heap and stays resident after it is
freed (the control, which shows the check can fail). Each case runs in a fresh process: the
threshold is the process's allocator state."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

CHILD = """
import sys
import torch
from twinkle.utils.memory import fixed_mmap_threshold

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "fixed":
    assert fixed_mmap_threshold()
if sys.argv[1] == "initialize":  # a CPU run's initialize() sets it
    import twinkle
    twinkle.initialize(seed=0)
first = torch.ones(6 << 20)  # 24 MiB, mapped on its own; freeing it raises glibc's threshold
del first
before = rss_mib()
second = torch.ones(4 << 20)  # 16 MiB: below the raised threshold, from the heap
del second
print(rss_mib() - before)
"""


def _kept_mib(how: str) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def test_a_freed_tensor_goes_back_to_the_system():
    assert _kept_mib("fixed") < 2  # unmapped when freed
    assert _kept_mib("initialize") < 2
    assert _kept_mib("default") > 12  # most of the 16 MiB stays resident
