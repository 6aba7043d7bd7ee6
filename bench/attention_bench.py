"""A packed row's attention on the CPU, forward + backward: the per-sample SDPA calls against the
pooled causal path (``twinkle.model.cpu_attention``) and the batched products
(``twinkle.model.batched_attention``), on the same inputs, alternating.

    python bench/attention_bench.py [--threads 2] [--repeats 7]

Rows are laid out as in W1 and W2 (a 14-token shared prefix, then the samples; SmolLM2's 9
query and 3 key/value heads of 64). Prints the per-sample calls' median time, each other path's
time as a ratio of it, and the largest difference of the outputs and gradients."""

import argparse
import statistics
import time

import torch

from twinkle.model import batched_attention, cpu_attention
from twinkle.model.attention import Segments, segment_attention

ROWS = {
    "W1 a": (14, [58, 31, 42, 31]),
    "W1 b": (14, [37, 28, 40, 26]),
    "W1 c": (14, [47, 25, 82, 41]),
    "no prefix": (0, [50, 45, 61, 33]),
    "80-96": (14, [80, 96, 85, 90]),
    "100-130": (14, [120, 100, 130, 110]),
    "mid": (14, [150, 200, 120, 180]),
    "300s": (14, [300, 250, 350, 280]),
    "400s": (14, [400, 450, 380, 420]),
    "W2-like": (14, [553, 706, 438, 779]),
    "W2-long": (14, [984, 757, 906, 500]),
    "one long": (0, [1000]),
}


def segments_of(prefix: int, lengths: list[int]) -> Segments:
    spans, start = [], prefix
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return Segments(tuple(spans), prefix)


PATHS = ("per-sample", "pooled", "batched")


def run(segments: Segments, leaves: list[torch.Tensor], grad: torch.Tensor, path: str):
    cpu_attention.MIN_WORK = 0 if path == "pooled" else 1 << 62
    batched_attention.CHOICE = "always" if path == "batched" else "never"
    for leaf in leaves:
        leaf.grad = None
    start = time.perf_counter()
    out = segment_attention(*leaves, segments)
    out.backward(grad)
    return time.perf_counter() - start, [out.detach(), *(leaf.grad for leaf in leaves)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    saved = cpu_attention.MIN_WORK, batched_attention.CHOICE
    print(
        f"{'row':10} {'per-sample ms':>14} {'pooled / per-sample':>20} {'batched / per-sample':>21} {'max diff':>9}"
    )
    for name, (prefix, lengths) in ROWS.items():
        torch.manual_seed(0)
        segments = segments_of(prefix, lengths)
        t = segments.length
        # laid out as the model hands them over: (1, T, heads, 64) transposed
        leaves = [torch.randn(1, t, h, 64).transpose(1, 2).requires_grad_() for h in (9, 3, 3)]
        grad = torch.randn(1, t, 9, 64)
        times = {path: [] for path in PATHS}
        results = {}
        for r in range(args.repeats + 1):
            for path in PATHS[r % 3 :] + PATHS[: r % 3]:
                seconds, results[path] = run(segments, leaves, grad, path)
                if r:
                    times[path].append(seconds)
        diff = max(
            float((a - b).abs().max())
            for path in PATHS[1:]
            for a, b in zip(results["per-sample"], results[path], strict=True)
        )
        plain, pooled, batched = (statistics.median(times[k]) * 1e3 for k in PATHS)
        print(f"{name:10} {plain:14.2f} {pooled / plain:20.2f} {batched / plain:21.2f} {diff:9.1e}")
    cpu_attention.MIN_WORK, batched_attention.CHOICE = saved


if __name__ == "__main__":
    main()
