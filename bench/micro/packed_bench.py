"""Frozen weights packed for oneDNN (``twinkle.kernel.cpu_gemm.pack_frozen``) against the dense weight.

    python bench/packed_bench.py                          # products at SmolLM2-135M's shapes
    python bench/packed_bench.py --steps W1 --batches 16 --rounds 3
    python bench/packed_bench.py --steps W2 --batches 4 --rounds 2

Products: for each (rows, in, out), the forward ``x @ W.T`` from the dense weight and from its
packed copy, and the input gradient ``g @ W`` from the dense weight's transposed view (what
``times_weight`` runs) and from a packed copy of ``W.T``, alternating, median of the repeats.

``--steps``: whole training steps of the workload, with and without the packed copies
(``step_ab.py --switch packed-weights``: "on" is packed, "off" dense)."""

import argparse
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from run import WORKLOADS
from step_ab import paired_steps

from twinkle.kernel import cpu_gemm as gemm

# (in, out) of SmolLM2-135M's projections: q/o, k/v, gate/up, down, and the tied head
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _median_us(a: torch.Tensor, w: torch.Tensor, calls: int, repeats: int) -> float:
    """Median microseconds of ``a @ w.T`` on oneDNN."""
    _linear(a, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            _linear(a, w)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def products(rows: list[int], repeats: int) -> None:
    print("| in x out | rows | forward dense / packed us | ratio | input grad dense.T / packed us | ratio |")
    print("|---|---|---|---|---|---|")
    for k, n in SHAPES:
        w = torch.randn(n, k)
        w_packed = gemm._pack(w)
        wt_packed = gemm._pack(w.t().contiguous())
        for m in rows:
            if n > 10_000 and m > 2048:
                continue  # the head runs in chunks of at most 2048 rows
            x, g = torch.randn(m, k), torch.randn(m, n)
            calls = max(2, int(2e7 / (m * k * n) * 50))
            fwd = [0.0, 0.0]
            bwd = [0.0, 0.0]
            for _ in range(2):  # alternate, twice
                fwd[0] += _median_us(x, w, calls, repeats)
                fwd[1] += _median_us(x, w_packed, calls, repeats)
                bwd[0] += _median_us(g, w.t(), calls, repeats)
                bwd[1] += _median_us(g, wt_packed, calls, repeats)
            print(
                f"| {k} x {n} | {m} | {fwd[0] / 2:.0f} / {fwd[1] / 2:.0f} | {fwd[1] / fwd[0]:.3f} "
                f"| {bwd[0] / 2:.0f} / {bwd[1] / 2:.0f} | {bwd[1] / bwd[0]:.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[40, 150, 235, 1000, 2544])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", choices=list(WORKLOADS), help="whole steps of this workload instead")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps:
        paired_steps("packed-weights", args.steps, args.batches, args.rounds, args.threads)
    else:
        products(args.rows, args.repeats)


if __name__ == "__main__":
    main()
