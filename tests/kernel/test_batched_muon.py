"""``BatchedMuon`` computes torch's Muon step (the same momentum, weight decay, learning-rate
adjustment and bf16 Newton-Schulz iteration), batched per matrix shape, with the same state."""

import copy

import pytest
import torch
from tolerances import gamma, rounding_tolerances

from twinkle.kernel import switched
from twinkle.kernel.muon import BatchedMuon
from twinkle.optim.optimizer import build_optimizer

# one layer's LoRA shapes at SmolLM2's sizes, wide A and tall B, each shape several times
SHAPES = (
    [(8, 576)] * 6 + [(8, 1536)] + [(576, 8), (192, 8), (192, 8), (576, 8), (1536, 8), (1536, 8), (576, 8)]
)


def _pair(**kwargs):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES * 2]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, BatchedMuon(ours, **kwargs), theirs, torch.optim.Muon(theirs, **kwargs)


def _step(pairs, grads) -> float:
    """One step of each optimizer on the same gradients; returns how far the two parameter lists
    may now be apart at most on account of this step (``_step_bound`` of the last pair's update)."""
    before = [p.detach().clone() for p in pairs[-1][0]]
    for params, optimizer in pairs:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        optimizer.step()
    return _step_bound([p.detach() - b for p, b in zip(pairs[-1][0], before, strict=True)], pairs[-1][1])


def _step_bound(updates: list[torch.Tensor], optimizer) -> float:
    """Both run the same elementwise momentum, weight decay and update on each parameter, and the
    same bf16 Newton-Schulz arithmetic, batched or not: only the fp32 sums inside its bf16
    products differ in order, which may flip a bf16 rounding by one ulp. The iteration rounds
    3 times per step plus twice for the normalisation; to first order the flips add
    (tolerances.rounding_tolerances: 2 * 17 * 2^-8 = 13% of the update's largest element for 5
    steps). The momentum does not depend on the parameters, so the steps' errors do not compound,
    they add up. A wrong learning-rate adjustment, orientation or momentum changes the update by
    about its own size."""
    group = optimizer.param_groups[0]
    roundings = 3 * group["ns_steps"] + 2
    return max(rounding_tolerances(roundings, u)["atol"] for u in updates)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 1e-3, "adjust_lr_fn": "match_rms_adamw"},  # the contract's
        {"lr": 2e-2, "weight_decay": 0.0, "nesterov": False},
        {"lr": 1e-3, "momentum": 0.9, "adjust_lr_fn": "original", "ns_steps": 3},
    ],
)
def test_equals_torchs_muon_step_after_step(kwargs):
    ours, batched, theirs, reference = _pair(**kwargs)
    allowed, grad_scale = 0.0, 0.0
    for _ in range(4):
        grads = [torch.randn_like(p) for p in ours]
        grads[3] = None  # a matrix without a gradient this step is left alone, as torch does
        allowed += _step([(ours, batched), (theirs, reference)], grads)
        grad_scale = max([grad_scale] + [float(g.abs().max()) for g in grads if g is not None])
        assert torch.equal(ours[3], theirs[3])  # untouched in both
        worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        assert worst <= allowed, (worst, allowed)
    assert batched.state[ours[3]] == reference.state[theirs[3]] == {}  # never had a gradient
    # the momentum is a lerp of the gradients, a few fp32 roundings a step on values of the
    # gradients' scale (foreach or not, fused multiply-add or not): gamma(3 * 4 steps) of it
    momentum_atol = gamma(3 * 4) * grad_scale
    for a, b in zip(ours, theirs, strict=True):
        if b in reference.state and reference.state[b]:
            torch.testing.assert_close(
                batched.state[a]["momentum_buffer"],
                reference.state[b]["momentum_buffer"],
                atol=momentum_atol,
                rtol=0,
            )


def test_state_moves_between_the_two():
    ours, batched, theirs, reference = _pair(lr=1e-3)
    _step([(theirs, reference)], [torch.randn_like(p) for p in theirs])
    batched.load_state_dict(copy.deepcopy(reference.state_dict()))  # not the same buffers
    for p, q in zip(ours, theirs, strict=True):
        p.data.copy_(q.data)
    grads = [torch.randn_like(p) for p in ours]
    allowed = _step([(ours, batched), (theirs, reference)], grads)  # the step's bf16 bound
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) <= allowed
    reference.load_state_dict(copy.deepcopy(batched.state_dict()))  # and back


def test_build_optimizer_batches_torchs_muon_unless_switched_off():
    params = [torch.nn.Parameter(torch.randn(4, 8))]
    assert type(build_optimizer(torch.optim.Muon, params, lr=1e-3)) is BatchedMuon
    assert type(build_optimizer("Muon", params, lr=1e-3)) is BatchedMuon
    with switched({"TWINKLE_BATCHED_MUON": "off"}):
        assert type(build_optimizer(torch.optim.Muon, params, lr=1e-3)) is torch.optim.Muon

    class MyMuon(torch.optim.Muon):  # a user's subclass keeps its own step
        pass

    assert type(build_optimizer(MyMuon, params, lr=1e-3)) is MyMuon
