"""The fused linear CE's softmax pass: one exp per chunk (ours) against log-sum-exp plus a second exp.

    python bench/ce_bench.py                 # SmolLM2's head, fp32, 2 threads
    python bench/ce_bench.py --rows 104 2720

For each row count (W1 supervises ~100 rows a step, W2 a few thousand), the loss with its
hidden-state gradient, computed in the same chunks both ways on the same inputs, alternating
inside each repeat. ``two exps`` is what ``fused_linear_ce`` did before session 8:
``torch.logsumexp`` for the loss, then ``exp(x - lse)`` again for the softmax. Both use the same
head products (``twinkle.utils.gemm``), so the difference is the elementwise passes."""

import argparse
import statistics
import time

import torch

from twinkle.loss.fused_linear_ce import auto_chunk_rows, fused_linear_cross_entropy
from twinkle.utils.gemm import linear, times_weight


def two_exps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    """Loss sum and hidden-state gradient with a log-sum-exp and a second exp per chunk."""
    loss = torch.zeros(())
    grad = torch.empty_like(hidden)
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        logits = linear(h, weight)
        lse = torch.logsumexp(logits, dim=-1)
        loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
        _ = (logits.argmax(-1) == t).sum()
        probs = logits.sub_(lse[:, None]).exp_()
        probs[torch.arange(t.numel()), t] -= 1
        grad[start : start + chunk] = times_weight(probs, weight)
    return loss, grad


def one_exp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    leaf = hidden.detach().requires_grad_()
    loss, _ = fused_linear_cross_entropy(leaf, weight, targets, chunk_rows=chunk)
    loss.backward()
    return loss.detach(), leaf.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[104, 700, 2720])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=gen) * 0.02
    chunk = auto_chunk_rows(args.vocab)
    print(f"head {args.vocab} x {args.hidden}, fp32, {args.threads} threads, chunks of {chunk} rows")
    print("| rows | two exps ms | one exp ms | speed-up | loss diff | max grad diff |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        hidden = torch.randn(rows, args.hidden, generator=gen)
        targets = torch.randint(0, args.vocab, (rows,), generator=gen)
        times: dict[str, list[float]] = {"two": [], "one": []}
        for _ in range(args.repeats + 1):  # the first repeat builds kernels and warms memory
            for name, fn in (("two", two_exps), ("one", one_exp)):
                start = time.perf_counter()
                fn(hidden, weight, targets, chunk)
                times[name].append(time.perf_counter() - start)
        (loss_a, grad_a), (loss_b, grad_b) = (
            two_exps(hidden, weight, targets, chunk),
            one_exp(hidden, weight, targets, chunk),
        )
        two, one = (statistics.median(times[k][1:]) * 1e3 for k in ("two", "one"))
        print(
            f"| {rows} | {two:.1f} | {one:.1f} | {two / one:.2f}x | {abs(float(loss_a - loss_b)):.2e} "
            f"| {float((grad_a - grad_b).abs().max()):.2e} |"
        )


if __name__ == "__main__":
    main()
