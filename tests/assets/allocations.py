"""The most bytes allocated at once while a function runs, from torch.profiler's allocation
timeline: every CPU tensor allocated and freed, in order, so the count is exact and the same
on every run. The timeline is a private torch API (``torch.profiler._memory_profiler``); the
install pins torch, and a change there fails these tests rather than passing them."""

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action


def peak_bytes(run: Callable[[], Any]) -> tuple[int, int]:
    """(the most bytes allocated at once above the start, the bytes still allocated at the end)
    while ``run()`` runs. Tensors that existed before do not count until they are freed."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run()
    now = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            now += size
        elif action == Action.DESTROY:
            now -= size
        peak = max(peak, now)
    return peak, now
