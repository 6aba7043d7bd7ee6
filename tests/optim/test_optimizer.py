"""Optimizer construction defaults and the single-process path of ``ReplicatedOptimizer``."""

import torch
from tolerances import assert_within, gamma

from twinkle.optim import build_optimizer
from twinkle.optim.replicated import ReplicatedOptimizer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(8, 5, generator=g)),
        torch.nn.Parameter(torch.randn(3, 8, generator=g)),
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_adam_family_defaults_to_fused_unless_told():
    assert build_optimizer("AdamW", _params(), lr=1e-3).defaults["fused"] is True
    assert build_optimizer("Adam", _params(), lr=1e-3).defaults["fused"] is True
    assert not build_optimizer("AdamW", _params(), lr=1e-3, foreach=True).defaults["fused"]
    assert build_optimizer("AdamW", _params(), lr=1e-3, fused=False).defaults["fused"] is False
    assert "fused" not in build_optimizer("Muon", _params(), lr=1e-3).defaults


def test_fused_adamw_matches_the_loop_implementation():
    ours, ref = _params(), _params()
    steps, lr = 3, 1e-2
    fused = build_optimizer("AdamW", ours, lr=lr)
    loop = torch.optim.AdamW(ref, lr=lr, foreach=False)
    for _ in range(steps):
        fused.step()
        loop.step()
    for a, b in zip(ours, ref, strict=True):
        # the same elementwise AdamW on the same gradients, arranged otherwise (fused kernel, FMA):
        # about 12 roundings a step (moments, bias corrections, sqrt, eps, division, decay, the
        # update) on values of the weight's size or lr's (|m / sqrt(v)| = 1 for a constant
        # gradient): gamma(12 steps) of them. A wrong moment, bias correction or decay moves a
        # weight by about lr.
        bound = gamma(12 * steps) * (b.detach().double().abs() + 2 * steps * lr)
        assert_within(a.detach(), b.detach(), bound, "fused AdamW")


def test_unsharded_parameters_are_stepped_in_place():
    params, ref = _params(), _params()
    grads = [p.grad.clone() for p in params]
    opt = ReplicatedOptimizer(params, lambda ps: torch.optim.SGD(ps, lr=0.5))
    assert opt.copies[0] is params[0]  # no copies in one process
    opt.gather_grads(scale=0.25)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * 0.25, rtol=0, atol=0)  # a power of two: exact
    opt.step()
    with torch.no_grad():
        for p, r, g in zip(params, ref, grads, strict=True):
            # SGD adds the exactly scaled gradient: one rounding, the reference's own
            torch.testing.assert_close(p, r - 0.5 * 0.25 * g, rtol=0, atol=0)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
