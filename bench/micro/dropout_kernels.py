"""The masked LoRA products against the same products without a mask, at a layer's shapes.

    python bench/micro/dropout_kernels.py --tokens 1024 --rank 8 --reps 50

For each input width (SmolLM2's hidden 576 and intermediate 1536), times per call:
- forward: ``dropout.masked_low`` (mask and down product in one pass) against ``A x^T``;
- backward: ``dropout.masked_input_grads`` (A's gradient and the branch's share of x's gradient
  through the mask, one pass), with the bits the forward kept and with the mask hashed again
  from its seed, against ``g^T x`` plus ``x_grad += g A`` in torch's library.
The unmasked pair is what a dropout-0 node computes for the same adapter (before fusing A into
the base product, which a mask rules out). Prints medians in microseconds and ns per element."""

import argparse
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch

from twinkle.kernel.lora import dropout


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    assert dropout._library() is not None, "the dropout kernel did not build"
    print(
        f"tokens {args.tokens}, rank {args.rank}, {args.threads} threads; microseconds per call (ns/element)"
    )
    for hidden in (576, 1536):
        for name, us, n in rows(args.tokens, hidden, args.rank, args.reps):
            print(f"hidden {hidden:5d}  {name:18s} {us:9.1f} us  ({us * 1e3 / n:.2f} ns/element)")


def rows(tokens: int, hidden: int, rank: int, reps: int) -> list[tuple[str, float, int]]:
    """``(what, microseconds a call, elements)`` for each way at one input width."""
    x = torch.randn(tokens, hidden)
    a = torch.randn(rank, hidden)
    g_low = torch.randn(rank, tokens).t()
    grad_x = torch.randn(tokens, hidden)
    drops = (dropout.draw(0.05),)
    bits = dropout.masked_low(x, a, drops)[1]
    ways = {
        "forward, masked": lambda: dropout.masked_low(x, a, drops),
        "forward, no mask": lambda: torch.mm(a, x.t()),
        "backward, bits": lambda: dropout.masked_input_grads(x, a, g_low, drops, grad_x, True, bits),
        "backward, seed": lambda: dropout.masked_input_grads(x, a, g_low, drops, grad_x, True),
        "backward, no mask": lambda: (g_low.t() @ x, grad_x.addmm_(g_low, a)),
        "mask only": lambda: dropout.apply(x, drops[0]),
    }
    return [(name, median_us(fn, reps), x.numel()) for name, fn in ways.items()]


if __name__ == "__main__":
    main()
