"""A packed row's attention on the CPU, forward + backward: the per-sample SDPA calls against the
pooled causal path (``twinkle.kernel.attention.pooled``), the batched products
(``twinkle.kernel.attention.batched``) and the C kernel (``twinkle.kernel.attention.native``; a
row it does not take, such as one long sample, falls through to the others), on the same
inputs, alternating.

    python bench/attention_bench.py [--threads 2] [--repeats 30]
    python bench/attention_bench.py --fit     # the batched path's cost model, refitted

Rows are laid out as in W1 and W2 (a 14-token shared prefix, then the samples; SmolLM2's 9
query and 3 key/value heads of 64). Prints the per-sample calls' median time, each other path's
time as a ratio of it, and the largest difference of the outputs and gradients.

``--fit``: 28 random rows of 2-4 samples of 10-157 tokens, the per-sample calls against the
batched products (one sample a block), and the least-squares fit of the cost model in
``twinkle.kernel.attention.batched``: batched = fixed + per padded pair, per-sample = per call +
per pair."""

import argparse
import random
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch

from twinkle.kernel import set_switches, switches
from twinkle.kernel.attention import batched as batched_attention
from twinkle.kernel.attention.packed import Segments, segment_attention

ROWS = {
    # W1's first six batches
    "W1 1": (14, [58, 31, 42, 31]),
    "W1 2": (14, [37, 28, 40, 26]),
    "W1 3": (14, [40, 27, 38, 26]),
    "W1 4": (14, [51, 25, 40, 28]),
    "W1 5": (14, [41, 23, 42, 25]),
    "W1 6": (14, [47, 25, 82, 41]),
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


PATHS = ("per-sample", "pooled", "batched", "native")


def run(segments: Segments, leaves: list[torch.Tensor], grad: torch.Tensor, path: str):
    set_switches(
        {
            "TWINKLE_POOLED_ATTENTION": "always" if path == "pooled" else "off",
            "TWINKLE_BATCHED_ATTENTION": "always" if path == "batched" else "off",
            "TWINKLE_NATIVE_ATTENTION": "on" if path == "native" else "off",
        }
    )
    for leaf in leaves:
        leaf.grad = None
    start = time.perf_counter()
    out = segment_attention(*leaves, segments)
    out.backward(grad)
    return time.perf_counter() - start, [out.detach(), *(leaf.grad for leaf in leaves)]


def _median_ms(segments: Segments, path: str, repeats: int) -> float:
    t = segments.length
    leaves = [torch.randn(1, t, h, 64).transpose(1, 2).requires_grad_() for h in (9, 3, 3)]
    grad = torch.randn(1, t, 9, 64)
    run(segments, leaves, grad, path)
    return statistics.median(run(segments, leaves, grad, path)[0] for _ in range(repeats)) * 1e3


def fit(repeats: int) -> None:
    """Refit the cost model on random rows, one sample a block (as it was fitted)."""
    rng = random.Random(1)
    original = batched_attention.layout
    batched_attention.layout = lambda lengths, prefix: (
        [[i] for i in range(len(lengths))],
        min(range(len(lengths)), key=lengths.__getitem__) if prefix else -1,
    )
    rows = []
    for _ in range(28):
        base = rng.choice([20, 30, 40, 50, 60, 80, 100])
        lengths = [max(5, int(base * rng.uniform(0.5, 1.6))) for _ in range(rng.choice([2, 3, 4, 4, 4]))]
        prefix = rng.choice([0, 14, 14])
        segments = segments_of(prefix, lengths)
        pairs = batched_attention.flash_pairs(lengths, prefix)
        padded = batched_attention.padded_size(lengths, prefix)[0]
        flash, batched = (_median_ms(segments, path, repeats) for path in ("per-sample", "batched"))
        rows.append((len(lengths), pairs, padded, flash, batched))
        print(f"{prefix:3} {str(lengths):22} per-sample {flash:6.2f} ms  batched {batched:6.2f} ms")
    batched_attention.layout = original
    data = torch.tensor(rows, dtype=torch.float64)
    calls, pairs, padded, flash, batched = data.T
    fixed, per_padded = torch.linalg.lstsq(
        torch.stack([torch.ones_like(padded), padded], 1), batched[:, None]
    ).solution[:, 0]
    per_call, per_pair = torch.linalg.lstsq(torch.stack([calls, pairs], 1), flash[:, None]).solution[:, 0]
    print(f"batched: {fixed * 1e3:.0f} us + {per_padded * 1e3:.3f} us per padded pair")
    print(f"per-sample: {per_call * 1e3:.0f} us a call + {per_pair * 1e3:.3f} us per pair")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--fit", action="store_true", help="refit the batched path's cost model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.fit:
        fit(args.repeats)
        return
    saved = switches.values()
    print(
        f"{'row':10} {'per-sample ms':>14} {'pooled / per-sample':>20} {'batched / per-sample':>21}"
        f" {'native / per-sample':>20} {'max diff':>9}"
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
            for path in PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]:
                seconds, results[path] = run(segments, leaves, grad, path)
                if r:
                    times[path].append(seconds)
        diff = max(
            float((a - b).abs().max())
            for path in PATHS[1:]
            for a, b in zip(results["per-sample"], results[path], strict=True)
        )
        plain, pooled, batched, native = (statistics.median(times[k]) * 1e3 for k in PATHS)
        print(
            f"{name:10} {plain:14.2f} {pooled / plain:20.2f} {batched / plain:21.2f}"
            f" {native / plain:20.2f} {diff:9.1e}"
        )
    set_switches(saved)


if __name__ == "__main__":
    main()
