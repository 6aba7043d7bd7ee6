"""What is alive on the GPU at a run's peak, grouped by the Python line that allocated it.

``profile_step.py --memory`` records the CUDA caching allocator's history over the timed steps
(``torch.cuda.memory._record_memory_history``), then ``peak_breakdown`` replays the allocations
and frees in order, finds the moment the most bytes were allocated, and sums the blocks alive
then by the innermost frame outside torch itself (a Twinkle, transformers, PEFT or Liger line).
The allocator's own ``max_memory_allocated`` counts the same bytes, so the two totals agree
where the history holds every event since the last reset."""

from collections import defaultdict
from typing import Any

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)

# frames inside these are the machinery, not the code that asked for the memory
_SKIP = ("/torch/", "<frozen", "/contextlib.py", "/functools.py", "gpu_peak.py")


def _site(frames: list[dict[str, Any]]) -> str:
    for frame in frames:  # innermost first
        name = frame.get("filename", "")
        if name and not any(part in name for part in _SKIP):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.get('line', 0)} {frame.get('name', '')}"
    return "(torch internals or no Python frame)"


def peak_breakdown(events: list[dict[str, Any]]) -> tuple[int, dict[str, tuple[int, int]]]:
    """The peak of allocated bytes over ``events`` (one device's trace, oldest first: dicts with
    ``action``, ``addr``, ``size`` and ``frames``), and the blocks alive then: site -> (bytes,
    blocks). Frees count at ``free_completed`` (when the memory can be reused), as the
    allocator's own statistics do."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in events:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[site][0] += size
        groups[site][1] += 1
    return peak, {site: (b, n) for site, (b, n) in groups.items()}


def print_peak(snapshot: dict[str, Any], before: int, rows: int = 25) -> None:
    """``before``: the bytes allocated when the recording started (the weights, mostly); they
    are alive at the peak too but have no event in the history."""
    traces = [t for t in snapshot.get("device_traces", []) if t]
    if not traces:
        print("no allocator history was recorded")
        return
    peak, groups = peak_breakdown(traces[0])
    print(
        f"peak of the recorded steps: {(before + peak) / 2**20:.0f} MiB allocated = "
        f"{before / 2**20:.0f} MiB from before the recording + {peak / 2**20:.0f} MiB by site:"
    )
    for site, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"{size / 2**20:10.1f} MiB {count:6d} blocks  {site}")
