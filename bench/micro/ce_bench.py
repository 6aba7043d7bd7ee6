"""The fused linear CE's softmax pass: torch's softmax kernel (ours) against two other ways to compute it.

    python bench/micro/ce_bench.py                 # SmolLM2's head, fp32, 2 threads
    python bench/micro/ce_bench.py --rows 104 2720

For each row count (W1 supervises ~100 rows a step, W2 a few thousand), the loss with its
hidden-state gradient, computed in the same chunks both ways on the same inputs, alternating
inside each repeat. ``two exps``:
``torch.logsumexp`` for the loss, then ``exp(x - lse)`` again for the softmax. ``max + exp``:
a max with its indices (the predictions), an in-place ``exp(x - max)``, a sum and
a division. ``softmax`` is what ``fused_linear_ce`` does: a max without indices, torch's softmax kernel in place, and
the largest probability's log for the log-sum-exp. All use the same head products
(``twinkle.kernel.cpu_gemm``), so the difference is the elementwise passes."""

import argparse
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch

from twinkle.kernel.cpu_gemm import linear, times_weight
from twinkle.loss.fused_linear_ce import auto_chunk_rows, fused_linear_cross_entropy


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, passes):
    """Loss sum and hidden-state gradient, ``passes(logits, t)`` giving each chunk's loss sum and
    softmax (in place of the logits)."""
    loss = torch.zeros(())
    grad = torch.empty_like(hidden)
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        chunk_loss, probs = passes(linear(h, weight), t)
        loss += chunk_loss
        probs[torch.arange(t.numel()), t] -= 1
        grad[start : start + chunk] = times_weight(probs, weight)
    return loss, grad


def _two_exps_passes(logits: torch.Tensor, t: torch.Tensor):
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
    _ = (logits.argmax(-1) == t).sum()
    return loss, logits.sub_(lse[:, None]).exp_()


def _max_exp_passes(logits: torch.Tensor, t: torch.Tensor):
    top, predicted = logits.max(dim=-1)
    _ = (predicted == t).sum()
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    exps = logits.sub_(top[:, None]).exp_()
    total = exps.sum(dim=-1)
    return (total.log() + top - target_logit).sum(), exps.div_(total[:, None])


def two_exps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    """With a log-sum-exp and a second exp per chunk."""
    return _chunked(hidden, weight, targets, chunk, _two_exps_passes)


def max_exp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    """With a max (and its indices) and one exp per chunk."""
    return _chunked(hidden, weight, targets, chunk, _max_exp_passes)


def softmax(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
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
    variants = {"two exps": two_exps, "max + exp": max_exp, "softmax": softmax}
    print(
        "| rows | " + " | ".join(f"{name} ms" for name in variants) + " | softmax vs max + exp "
        "| loss diff | max grad diff |"
    )
    print("|---" * (len(variants) + 4) + "|")
    for rows in args.rows:
        hidden = torch.randn(rows, args.hidden, generator=gen)
        targets = torch.randint(0, args.vocab, (rows,), generator=gen)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats + 1):  # the first repeat builds kernels and warms memory
            for name, fn in variants.items():
                start = time.perf_counter()
                fn(hidden, weight, targets, chunk)
                times[name].append(time.perf_counter() - start)
        (loss_a, grad_a), (loss_b, grad_b) = (
            max_exp(hidden, weight, targets, chunk),
            softmax(hidden, weight, targets, chunk),
        )
        ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
        print(
            f"| {rows} | "
            + " | ".join(f"{v:.1f}" for v in ms.values())
            + f" | {ms['softmax'] / ms['max + exp']:.2f}x | {abs(float(loss_a - loss_b)):.2e} "
            f"| {float((grad_a - grad_b).abs().max()):.2e} |"
        )


if __name__ == "__main__":
    main()
