"""torch.mm (MKL) against oneDNN for a frozen weight's two products, at a model's shapes.

    python bench/gemm_bench.py                       # SmolLM2-135M's shapes, 2 threads
    python bench/gemm_bench.py --rows 176 1000 --threads 1

For each (rows, in, out) it times the forward ``x @ W.T`` and the input gradient ``g @ W`` both
ways, alternating, and prints the median GFLOP/s of the repeats, the speed-up, and the largest
relative difference of the results. As in a training step, each row count is used ``--layers``
times (once per decoder layer), and each batch brings a row count not seen before (``rows``,
then one more per batch): oneDNN builds a kernel for each new shape, and those builds are
counted (in a long run row counts come back, and are then cached).

A second table gives that build's cost on its own: for each product, a call at a row count not
seen before minus a call at a known one (one row fewer or so, the weight warm), median of seven,
for both libraries: what a step pays once per shape, however many layers share it.
``--builds`` prints only that table."""

import argparse
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import set_switches

# (in, out) of SmolLM2-135M's projections: q/o, k/v, gate/up, down, and the tied head
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def rate(product, operands: list[tuple[torch.Tensor, torch.Tensor]], flops: int) -> float:
    start = time.perf_counter()
    for a, w in operands:
        product(a, w)
    return flops / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[60, 176, 1000, 3000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10, help="row counts per repeat")
    parser.add_argument("--layers", type=int, default=30, help="calls per row count")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--builds", action="store_true", help="only the kernel-build table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if gemm.onednn_enabled():  # the oneDNN column is oneDNN for every shape, not auto's choice
        set_switches({"TWINKLE_ONEDNN": "on"})
    print(f"oneDNN on: {gemm.onednn_enabled()}, {args.threads} threads, torch {torch.__version__}")
    if args.builds:
        build_table(args.rows[0])
        return
    print("| rows | in -> out | product | torch.mm GFLOP/s | oneDNN GFLOP/s | speed-up | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for fan_in, fan_out in SHAPES:
            w = torch.randn(fan_out, fan_in)
            for name, width, ours, theirs in [
                ("x @ W.T", fan_in, gemm.linear, lambda a, w: a @ w.t()),
                ("g @ W", fan_out, gemm.times_weight, lambda a, w: a @ w),
            ]:
                mkl, dnn = [], []
                for repeat in range(args.repeats):
                    first = rows + repeat * args.batches
                    batches = [torch.randn(first + i, width) for i in range(args.batches)]
                    operands = [(a, w) for a in batches for _ in range(args.layers)]
                    flops = sum(2 * a.shape[0] * fan_in * fan_out for a, _ in operands)
                    mkl.append(rate(theirs, operands, flops))
                    dnn.append(rate(ours, operands, flops))
                a = operands[0][0]
                ref = theirs(a, w)
                diff = ((ours(a, w) - ref).abs().max() / ref.abs().max()).item()
                m, d = statistics.median(mkl), statistics.median(dnn)
                print(
                    f"| {rows} | {fan_in} -> {fan_out} | {name} | {m:.0f} | {d:.0f} | {d / m:.2f}x | {diff:.1e} |"
                )
    build_table(args.rows[0], skip=args.repeats * args.batches)


def build_cost(product, w: torch.Tensor, width: int, rows: int) -> float:
    """ms a call at a row count not seen before takes beyond a call at a known one (``rows``),
    the weight warm for both: median over seven new counts."""
    known = torch.randn(rows, width)
    product(known, w)
    extra = []
    for count in range(rows + 1, rows + 8):
        fresh = torch.randn(count, width)
        start = time.perf_counter()
        product(known, w)
        middle = time.perf_counter()
        product(fresh, w)
        extra.append((time.perf_counter() - middle) - (middle - start))
    return statistics.median(extra) * 1e3


def build_table(rows: int, skip: int = 0) -> None:
    """``skip``: row counts after ``rows`` already used (and built) in this process."""
    print(f"\na call at a new row count minus one at a known count, ms (about {rows} rows):")
    print("| in -> out | product | torch.mm | oneDNN |")
    print("|---|---|---|---|")
    for fan_in, fan_out in SHAPES:
        w = torch.randn(fan_out, fan_in)
        for name, width, ours, theirs in [
            ("x @ W.T", fan_in, gemm.linear, lambda a, w: a @ w.t()),
            ("g @ W", fan_out, gemm.times_weight, lambda a, w: a @ w),
        ]:
            mkl = build_cost(theirs, w, width, rows + skip)
            dnn = build_cost(ours, w, width, rows + skip + 8)
            print(f"| {fan_in} -> {fan_out} | {name} | {mkl:.2f} | {dnn:.2f} |")


if __name__ == "__main__":
    main()
