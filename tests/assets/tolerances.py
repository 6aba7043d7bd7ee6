"""Float comparison bounds derived from the computation, so that a test passes on any CPU.

Two fp32 computations of the same value differ in the order of their sums (SIMD width, threads,
oneDNN vs MKL vs a plain loop, fused vs unfused), never in the terms. A sum of n terms, each
possibly one more rounding away from exact, computed in ANY order (one accumulator, pairwise,
VW-wide lanes then a horizontal sum, blocks per thread, with or without FMA) is within
``gamma(n) * sum |term|`` of the exact sum, ``gamma(n) = n u / (1 - n u)``, u the unit roundoff
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1). That worst case
holds on every machine; the typical error is about sqrt(n) u times the same sum.

So a kernel is checked against the same computation in float64 (``assert_within``), with the
bound of its fp32 sums (``matmul_bound``), elementwise: it scales with each element's own terms, so
an element that is a cancelling sum of large terms gets the room it needs and a large element no
more than it needs. A real bug (a wrong mask, a missing or doubled term) moves an element by about
one of its terms, n times the bound's per-term share, and still fails.

For a whole model (a chain of sums), ``chain_tolerances`` adds the chain's sums to first order:
the errors of successive steps add while a layer does not amplify them much, as in the tiny test
models (normalised activations, weights at initialisation scale). Its worst case stays about
sqrt(n) times the typical error, and a bug (a wrong mask, a dropped adapter, a wrong scale) moves
a gradient by a fraction of its scale, over 100 times the bound.

bf16 layers sum in fp32 and round their outputs: two computations that round at the same points
differ only where a rounding flips, by one ulp (``rounding_tolerances``). Runs of several
optimizer steps (``run_loss_rtol``, ``adamw_weight_atol``, ``muon_weight_atol``): a loss at Higham
and Mary's probabilistic bound of its chain (``probable_gamma``, where the worst case would leave
the check no power); a weight only within what a step may move it, since AdamW can send a weight
whose gradient is within its rounding error of zero the other way, and Muon's bf16 iteration can
flip a rounding.
"""

import math

import torch

# The unit roundoff u = 2^-p of a type with a p-bit significand (round to nearest): the largest
# relative error of one rounding.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,  # 53 bits: the references, 2^29 times finer than what they check
    torch.float32: 2.0**-24,  # 24 bits: the CPU kernels and torch's CPU ops under test
    torch.float16: 2.0**-11,  # 11 bits
    torch.bfloat16: 2.0**-8,  # 8 bits: bf16 training; products are summed in fp32, rounded once
}


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n: the relative bound of n successive roundings in ``dtype``."""
    nu = n * UNIT_ROUNDOFF[dtype]
    if nu >= 0.5:
        raise ValueError(f"gamma({n}) for {dtype}: n u = {nu} is too large for a bound")
    return nu / (1 - nu)


def dot_bound(n: int, abs_sum, dtype: torch.dtype = torch.float32):
    """The worst error of an n-term dot product in ``dtype`` (any order) whose terms' absolute
    values sum to ``abs_sum`` (a number or a tensor of them)."""
    return gamma(n, dtype) * abs_sum


def matmul_bound(a: torch.Tensor, b: torch.Tensor, extra: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Elementwise worst error of ``a @ b`` computed in ``dtype`` in any order: gamma(k + extra)
    times ``|a| @ |b|`` (in float64), k the inner size. ``extra``: roundings each term sees
    besides the sum's own (a scaled copy of an input: 1; a product rounded then scaled: 2)."""
    return gamma(a.shape[-1] + extra, dtype) * (a.double().abs() @ b.double().abs())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound, what: str = "") -> None:
    """``|actual - expected| <= bound`` elementwise, ``expected`` the float64 reference. The final
    rounding of each result to ``actual``'s dtype (u |expected|) is added to ``bound``."""
    expected = expected.double()
    u = UNIT_ROUNDOFF.get(actual.dtype, 0.0)
    allowed = torch.as_tensor(bound, dtype=torch.float64) + u * expected.abs()
    error = (actual.double() - expected).abs()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~(error <= allowed)  # NaN fails too
    if bad.any():
        excess = torch.where(bad, error / allowed.clamp(min=1e-300), torch.zeros_like(error))
        i = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {error.numel()} elements off; the worst, at flat index {i}, "
            f"by {error.flatten()[i].item():.3e} against a bound of {allowed.flatten()[i].item():.3e}"
        )


def assert_matmul(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias=None, what: str = "") -> None:
    """``actual`` is ``a @ b`` (+ ``bias``) computed in fp32 in some order: within the worst error
    of its k (+1) term sums of the float64 product, elementwise (a wrong element, row or
    transpose is off by about one term, k times the bound's share of it)."""
    expected = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    if bias is not None:
        expected, magnitude = expected + bias.double(), magnitude + bias.double().abs()
    assert_within(actual, expected, gamma(a.shape[-1] + 1) * magnitude, what)


def chain_tolerances(sizes, reference: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict:
    """``assert_close`` keywords for two computations of a chain of sums of the given sizes that
    differ in their orders: to first order each step's relative error adds to the ones before, so
    each result is within gamma(sum(sizes)) of exact and the two within twice that: rtol, and
    atol the same times the reference's largest magnitude (an element of a tensor is a sum of
    terms of about the tensor's scale, and may cancel to near zero)."""
    g = 2 * gamma(int(sum(sizes)), dtype)
    return {"atol": g * scale_of(reference), "rtol": g}


def llama_sums(hidden: int, intermediate: int, layers: int, tokens: int, vocab: int = 0) -> list[int]:
    """The sums along a Llama's forward and backward: per layer q/k/v (hidden), scores and values
    (tokens), o (hidden), gate/up (hidden), down (intermediate) and the norms (hidden), each twice
    (forward, backward); the head (hidden, twice), the softmax (vocab) and a weight's gradient
    (tokens)."""
    per_layer = 2 * (hidden + 2 * tokens + hidden + hidden + intermediate + 2 * hidden)
    return [per_layer] * layers + [2 * hidden, vocab, tokens]


def tiny_llama_sums(tokens: int, vocab: int = 100, layers: int | None = None) -> list[int]:
    """``llama_sums`` for the tests' tiny Llama (``tiny.TINY_LLAMA_SHAPE``) over ``tokens``
    tokens per sequence."""
    from tiny import TINY_LLAMA_SHAPE as shape

    layers = shape["num_hidden_layers"] if layers is None else layers
    return llama_sums(shape["hidden_size"], shape["intermediate_size"], layers, tokens, vocab)


def tiny_batch_sums(input_ids: torch.Tensor, vocab: int = 600) -> list[int]:
    """``tiny_llama_sums`` for a (rows, tokens) batch of the tiny chat model (``tiny.py``, a
    600-token vocabulary): attention over one row's tokens, and a weight's gradient summed over
    every row's tokens (``rows - 1`` more rows than one)."""
    rows, tokens = input_ids.shape[0], input_ids.shape[-1]
    return tiny_llama_sums(tokens, vocab) + [(rows - 1) * tokens]


def attention_sums(tokens: int, dim: int, rep: int = 1) -> list[int]:
    """The sums of one attention forward and backward over ``tokens`` keys of ``dim`` channels:
    the scores (dim; exp turns their absolute error, gamma(dim) times sum|q_i k_i| scaled by
    1/sqrt(dim), about sqrt(dim) for unit inputs, into a relative one: dim * sqrt(dim)), the
    softmax's normaliser and the output (tokens each), the probabilities' gradient and the
    softmax backward's row dot (dim each), the inputs' gradients (tokens) summed over ``rep``
    query heads per key head, and a few roundings per element (scaling, exp, the division)."""
    return [dim * math.ceil(math.sqrt(dim)), tokens, tokens, dim, dim, tokens, rep, 8]


def scale_of(t: torch.Tensor) -> float:
    """The largest magnitude of ``t`` (1 for an empty or all-zero tensor)."""
    m = float(t.detach().double().abs().max()) if t.numel() else 0.0
    return m if m > 0 and math.isfinite(m) else 1.0


def rounding_tolerances(roundings: int, reference: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict:
    """``assert_close`` keywords for two computations that round to ``dtype`` at the same
    ``roundings`` points of a chain and differ only in the order of their fp32 sums (bf16 layers
    sum in fp32). A value rounds the same way in both unless the sums' tiny difference straddles a
    rounding boundary; then it lands one ulp (2u relative) away. To first order the flips of
    successive points add: 2 * roundings * u, relative (rtol) and of the reference's largest
    magnitude (atol: an element may be a cancelling sum of terms of that size)."""
    g = 2 * roundings * UNIT_ROUNDOFF[dtype]
    return {"atol": g * scale_of(reference), "rtol": g}


def probable_gamma(n: int, dtype: torch.dtype = torch.float32, lam: float = 8.0) -> float:
    """Higham and Mary's probabilistic gamma_n ("A new approach to probabilistic rounding error
    analysis", SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4): with the roundings' errors
    independent and of mean zero, a chain of n roundings stays within
    exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1 of exact with probability at least
    1 - 2n exp(-lam^2 (1 - u)^2 / 2): lam = 8, n = 10^4 fails once in 4 * 10^9. About sqrt(n) / lam
    times tighter than ``gamma(n)``; for comparisons of long runs (several optimizer steps, many
    processes) whose worst case would leave the check no power."""
    u = UNIT_ROUNDOFF[dtype]
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def run_loss_rtol(rows: int, tokens: int, ranks: int = 1) -> float:
    """The relative distance two runs of the tiny chat model (``tiny_batch_sums``) may log for one
    loss over ``rows`` rows of at most ``tokens`` tokens when they sum in other orders (other
    rank counts, kernels, processes): twice ``probable_gamma`` of its chain of sums and of the
    ranks' reduction. AdamW's or Muon's carry-over of earlier steps stays far below it over a few
    steps (kernel/test_kernel_convergence.py measures it against a float64 run)."""
    return 2 * probable_gamma(sum(tiny_batch_sums(torch.empty(rows, tokens))) + ranks)


def adamw_weight_atol(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """How far one weight of two AdamW runs from the same start can be apart after ``steps``
    steps of (at most) ``lr`` whose gradients differ by rounding. A step moves a weight by
    lr * m / (sqrt(v) + eps); m and v are weighted means of the gradients and their squares, so by
    Cauchy-Schwarz |m| / sqrt(v) <= sqrt(sum of w_k^2 / omega_k) over their weights (1 at the
    first step, 1.03 at the eighth with torch's betas). A weight whose gradient is within its
    rounding error of zero may step the other way in one run: twice that a step."""
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        w = [(1 - b1) * b1 ** (t - k) / (1 - b1**t) for k in range(1, t + 1)]
        omega = [(1 - b2) * b2 ** (t - k) / (1 - b2**t) for k in range(1, t + 1)]
        total += math.sqrt(sum(a * a / c for a, c in zip(w, omega, strict=True)))
    return 2 * lr * total


def muon_weight_atol(lr: float, steps: int, shapes, ns_steps: int = 5) -> float:
    """How far one weight of two runs of torch's Muon (``adjust_lr_fn='match_rms_adamw'``) from
    the same start can be apart after ``steps`` steps whose gradients differ by rounding. The
    update is lr * 0.2 * sqrt(max(rows, cols)) times the bf16 Newton-Schulz result, whose singular
    values the iteration keeps under 1.21 (so are its entries, up to bf16 rounding: 1.25). A
    gradient that differs in its last fp32 bits may flip each bf16 rounding of the iteration (the
    cast and the normalisation, then 3 per step) by one ulp; to first order the flips add:
    2 * (3 ns_steps + 2) * 2^-8 of the update a step (13% for 5 steps)."""
    adjusted = lr * 0.2 * math.sqrt(max(max(shape) for shape in shapes))
    flips = 2 * (3 * ns_steps + 2) * UNIT_ROUNDOFF[torch.bfloat16]
    return steps * flips * 1.25 * adjusted
