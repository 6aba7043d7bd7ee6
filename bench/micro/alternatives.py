"""Ways to compute a step's products and attention that we measured and did not adopt.

    python bench/alternatives.py                      # both tables, 176 rows, 2 threads
    python bench/alternatives.py --only products --rows 176 1000
    python bench/alternatives.py --only attention --lengths 567 720

``products``: SmolLM2-135M's frozen-weight products as torch runs them (``x @ W.T`` forward,
``g @ W`` input gradient) against
- the transposed product (``(W @ x.T).T`` made contiguous again, likewise for the gradient);
- MKL's own packed weight (``torch.ops.mkl._mkl_linear``), with the packed copy's size;
- for the input gradient, oneDNN on a packed copy of ``W.T`` (``bench/step_ab.py --switch
  packed-transposed`` runs it in whole steps);
- the q/k/v and the gate/up weights concatenated into one product each (forward, and the input
  gradient as one product of the concatenated output gradients against the summed three);
- two products at once, each on one of two single-threaded workers, against one after the other
  on both threads.

``attention``: the backward of one causal sample (SmolLM2's 9 query and 3 key/value heads of 64)
as Twinkle runs it (torch's flash kernel, one single-threaded call per head on a pool,
``twinkle.kernel.attention.pooled``) against a tiled backward from batched products: each block of
queries against all keys up to it, the probabilities recomputed from the forward's log-sum-exp.

None of these is used by Twinkle; measured on a 2-core Zen 3 EPYC (bench/README.md, measured alternatives):
- the transposed products 0.88-1.37x at 176 rows, 1.16-1.71x at 1000 (the copy back costs more
  than the layout gains); MKL's packed weight 0.97-1.10x for 3.4-16x the weight's memory;
- the concatenated q/k/v and gate/up products 0.85-1.03x at 176 rows, 0.93-1.02x at 1000: a
  few milliseconds a W1 step, for a second copy of those weights or weights made views of one
  buffer;
- two products at once on single-threaded workers 1.05-1.35x (MKL already uses both cores);
- the tiled attention backward 0.63x at 300 tokens, 0.74-0.78x at 567, 0.88-0.90x at 720,
  1.02-1.04x at 1000. Wired into ``cpu_attention`` for samples up to 800 tokens, whole W2 steps
  took 1.036x the time (17.00 vs 16.41 s median, 8 steps each, alternating in one process):
  in a step the per-head flash calls, whose working set stays in each core's cache, keep up.

Each row alternates the variants and prints the median time of ``--repeats`` each, as a ratio to
the first (below 1: faster); the results are checked equal to the first's."""

import argparse
import statistics
import time
from collections.abc import Callable

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel.attention.pooled import _FORWARD, PooledCausalAttention, pool

SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576)}


def timed(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _joined(out: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A variant's result for the check: separate products side by side, as one product gives them."""
    return torch.cat(out, dim=1) if isinstance(out, list) else out


def compare(label: str, variants: dict[str, Callable[[], object]], repeats: int, calls: int) -> None:
    results = {name: _joined(fn()) for name, fn in variants.items()}
    first = next(iter(results.values()))
    for name, out in results.items():
        assert torch.allclose(out, first, rtol=1e-4, atol=1e-4), f"{label}: {name} differs"
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn, calls))
    base = statistics.median(times[next(iter(variants))])
    cells = [f"{name} {statistics.median(t) / base:.2f}x" for name, t in list(times.items())[1:]]
    print(f"| {label} | {base * 1e6:.0f} us | " + " | ".join(cells) + " |")


def products(rows: int, repeats: int) -> None:
    print(f"\n{rows} rows: first column torch's product; the others as a ratio of its time")
    workers = pool(torch.get_num_threads())
    for name, (fan_in, fan_out) in SHAPES.items():
        x, w, g = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in), torch.randn(rows, fan_out)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        packed_t = gemm._pack(w.t().contiguous())
        compare(
            f"{name} forward",
            {
                "x @ W.T": lambda x=x, w=w: x @ w.t(),
                "transposed": lambda x=x, w=w: (w @ x.t()).t().contiguous(),
                f"MKL packed ({packed.nbytes / w.nbytes:.1f}x the weight)": lambda x=x, w=w, p=packed: (
                    torch.ops.mkl._mkl_linear(x, p, w, None, rows)
                ),
            },
            repeats,
            20,
        )
        compare(
            f"{name} input gradient",
            {
                "g @ W": lambda g=g, w=w: g @ w,
                "transposed": lambda g=g, w=w: (w.t() @ g.t()).t().contiguous(),
                "oneDNN, packed W.T": lambda g=g, p=packed_t: gemm._linear_pointwise(g, p, None),
            },
            repeats,
            20,
        )
    x = torch.randn(rows, 576)
    for name, outs in {"q, k, v": [576, 192, 192], "gate, up": [1536, 1536]}.items():
        ws = [torch.randn(n, 576) for n in outs]
        joined = torch.cat(ws)
        gs = [torch.randn(rows, n) for n in outs]
        joined_g = torch.cat(gs, dim=1)

        def apart(gs=gs, ws=ws) -> torch.Tensor:
            out = gs[0] @ ws[0]
            for g, w in zip(gs[1:], ws[1:], strict=True):
                out.add_(g @ w)
            return out

        compare(
            f"{name} forward",
            {
                "apart": lambda ws=ws: [x @ w.t() for w in ws],
                "one product": lambda j=joined: x @ j.t(),
            },
            repeats,
            20,
        )
        compare(
            f"{name} input gradient",
            {"apart": apart, "one product": lambda j=joined, g=joined_g: g @ j},
            repeats,
            20,
        )
        if workers is not None:
            compare(
                f"{name} forward, two workers",
                {
                    "in turn, 2 threads": lambda ws=ws: [x @ w.t() for w in ws],
                    "at once, 1 thread each": lambda ws=ws: [
                        f.result() for f in [workers.submit(lambda w=w: x @ w.t()) for w in ws]
                    ],
                },
                repeats,
                20,
            )


def tiled_backward(q, k, v, out, lse, grad, scale: float, block: int) -> torch.Tensor:
    """Gradients of causal attention for ``q (1, H, L, D)``, ``k, v (1, KV, L, D)``: query blocks
    against the keys up to them, the query heads of a key/value head stacked as rows; returned
    flattened and concatenated (q, k, v) for the comparison."""
    _, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg, dog = q[0].view(kv_heads, group, length, dim), grad[0].reshape(kv_heads, group, length, dim)
    keys, values = k[0], v[0]
    neg_lse = lse.reshape(kv_heads, group, length, 1).neg()
    neg_delta = (out[0].reshape(kv_heads, group, length, dim) * dog).sum(-1, keepdim=True).neg_()
    dq = torch.empty(kv_heads, group, length, dim)
    dk, dv = torch.zeros(kv_heads, length, dim), torch.zeros(kv_heads, length, dim)
    for s in range(0, length, block):
        e = min(s + block, length)
        n = e - s
        qb = qg[:, :, s:e].reshape(kv_heads, group * n, dim)
        gb = dog[:, :, s:e].reshape(kv_heads, group * n, dim)
        probs = torch.baddbmm(
            neg_lse[:, :, s:e].reshape(-1, group * n, 1), qb, keys[:, :e].transpose(1, 2), alpha=scale
        )
        future = torch.ones(n, n, dtype=torch.bool).triu_(1)
        probs.view(kv_heads, group, n, e)[..., s:e].masked_fill_(future, float("-inf"))
        probs.exp_()
        dv[:, :e].baddbmm_(probs.transpose(1, 2), gb)
        scores_grad = torch.baddbmm(
            neg_delta[:, :, s:e].reshape(-1, group * n, 1), gb, values[:, :e].transpose(1, 2)
        )
        scores_grad.mul_(probs)
        dq[:, :, s:e] = torch.bmm(scores_grad, keys[:, :e]).view(kv_heads, group, n, dim)
        dk[:, :e].baddbmm_(scores_grad.transpose(1, 2), qb, alpha=scale)
    return torch.cat([dq.mul_(scale).flatten(), dk.flatten(), dv.flatten()])


def attention_row(length: int, blocks: list[int], repeats: int) -> None:
    heads, kv_heads, dim = 9, 3, 64
    scale = dim**-0.5
    q, grad = torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim)
    k, v = torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
    out, lse = _FORWARD(q, k, v, 0.0, True, scale=scale)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (result,) = PooledCausalAttention.apply(scale, *leaves)

    def flash() -> torch.Tensor:
        for leaf in leaves:
            leaf.grad = None
        result.backward(grad, retain_graph=True)
        return torch.cat([leaf.grad.flatten() for leaf in leaves])

    variants = {"flash": flash}
    for block in blocks:
        variants[f"block {block}"] = lambda b=block: tiled_backward(q, k, v, out, lse, grad, scale, b)
    compare(f"{length} tokens", variants, repeats, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["products", "attention"])
    parser.add_argument("--rows", type=int, nargs="+", default=[176])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 567, 720, 1000])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.threads} threads, torch {torch.__version__}")
    if args.only != "attention":
        for rows in args.rows:
            products(rows, args.repeats)
    if args.only != "products":
        print("\nattention backward: first column Twinkle's (flash kernel, pooled); the others tiled")
        for length in args.lengths:
            attention_row(length, args.blocks, args.repeats)


if __name__ == "__main__":
    main()
