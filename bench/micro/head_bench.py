"""The output head on the supervised rows: ``F.linear`` (torch's ``mm``, MKL on the CPU) against
``twinkle.loss.head`` / ``head_logps`` (``twinkle.kernel.cpu_gemm``: oneDNN), alternating.

    python bench/micro/head_bench.py                  # SmolLM2's head (49152 x 576), fp32, 2 threads
    python bench/micro/head_bench.py --rows 40 189 680

For each row count: the head's product alone; the plain cross-entropy's logits with its backward
(``F.linear`` against ``head_logits``); and the rows' target log-probabilities without gradients,
as a DPO reference pass reads them (``-cross_entropy(F.linear(...), reduction="none")`` against
``head_logps``). Medians of ``--repeats`` alternating repeats; the hidden states require
gradients, the head weight does not (it is frozen under LoRA)."""

import argparse
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
import torch.nn.functional as F

from twinkle.kernel.cpu_gemm import linear
from twinkle.loss.head import head_logits
from twinkle.loss.head_logps import head_logps


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pairs(rows: int, weight: torch.Tensor) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, weight.shape[1], generator=g).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (rows,), generator=g)

    def ce(head):
        return lambda: F.cross_entropy(head(hidden, weight), targets, reduction="sum").backward()

    @torch.no_grad()
    def mkl_logps():
        return -F.cross_entropy(F.linear(hidden, weight), targets, reduction="none")

    @torch.no_grad()
    def ours_logps():
        return head_logps(hidden, weight, targets)

    with torch.no_grad():
        plain = hidden.detach()
        return {
            "product": (lambda: F.linear(plain, weight), lambda: linear(plain, weight)),
            "cross-entropy, forward+backward": (ce(F.linear), ce(head_logits)),
            "log-probs, no grad": (mkl_logps, ours_logps),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[40, 189, 400])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    weight = torch.randn(opts.vocab, opts.hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    print(f"head {opts.vocab} x {opts.hidden} fp32, {opts.threads} threads; medians of {opts.repeats}")
    print("| rows | what | F.linear (ms) | twinkle (ms) | ratio |")
    print("|---|---|---|---|---|")
    for rows in opts.rows:
        for what, (theirs, ours) in _pairs(rows, weight).items():
            theirs(), ours()  # warm-up: oneDNN builds its kernel for this row count
            a, b = [], []
            for _ in range(opts.repeats):
                a.append(_seconds(theirs))
                b.append(_seconds(ours))
            ta, tb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
            print(f"| {rows} | {what} | {ta:.1f} | {tb:.1f} | {tb / ta:.2f} |")


if __name__ == "__main__":
    main()
