"""Frozen weights packed for oneDNN (``twinkle.utils.gemm.pack_frozen``) against the dense weight.

    python bench/packed_bench.py                          # products at SmolLM2-135M's shapes
    python bench/packed_bench.py --steps W1 --batches 16 --rounds 3
    python bench/packed_bench.py --steps W2 --batches 4 --rounds 2

Products: for each (rows, in, out), the forward ``x @ W.T`` from the dense weight and from its
packed copy, and the input gradient ``g @ W`` from the dense weight's transposed view (what
``times_weight`` runs) and from a packed copy of ``W.T``, alternating, median of the repeats.

``--steps``: whole training steps of the workload in one process, the same batches run with
and without the packed copies, alternating which goes first; prints the median step of each.
The model trains on every run, so both see the same sequence of weights but not the same ones
at the same batch: that shifts both alike."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import build_dataset, profiled_model, sync
from run import WORKLOADS, prepare

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.utils import gemm

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


def steps(workload: str, batches: int, rounds: int, threads: int) -> None:
    spec = prepare(
        workload,
        argparse.Namespace(
            steps=batches, warmup=2, seed=42, threads=threads, model="smollm2", tokenizer=None, dtype="auto"
        ),
        Path(tempfile.mkdtemp(prefix="twinkle-packed-")),
    )
    twinkle.initialize(seed=42)
    dataset = build_dataset(spec)
    model = profiled_model(spec)
    assert gemm.packed_bytes(), "nothing was packed: is TWINKLE_ONEDNN off?"
    data = [b for _, b in zip(range(batches), DataLoader(dataset=dataset, batch_size=4), strict=False)]
    packed_table = gemm._packed

    def step(batch, packed: bool) -> float:
        gemm._packed = packed_table if packed else {}
        start = time.perf_counter()
        model.forward_backward(inputs=batch, task="fused_lm_ce")
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()
        return time.perf_counter() - start

    for batch in data[:2]:  # warm-up, both ways
        step(batch, True)
        step(batch, False)
    times = {True: [], False: []}
    for r in range(rounds):
        for i, batch in enumerate(data):
            for packed in (True, False) if (i + r) % 2 == 0 else (False, True):
                times[packed].append(step(batch, packed))
    gemm._packed = packed_table
    dense, packed = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{workload}: median step dense {dense:.3f} s, packed {packed:.3f} s, packed / dense {packed / dense:.3f} "
        f"({len(times[True])} steps each; {gemm.packed_bytes() / 2**20:.0f} MiB packed)"
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
        steps(args.steps, args.batches, args.rounds, args.threads)
    else:
        products(args.rows, args.repeats)


if __name__ == "__main__":
    main()
