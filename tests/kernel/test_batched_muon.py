"""``BatchedMuon`` computes torch's Muon step (the same momentum, weight decay, learning-rate
adjustment and bf16 Newton-Schulz iteration), batched per matrix shape, with the same state."""

import copy

import pytest
import torch

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


def _step(pairs, grads):
    for params, optimizer in pairs:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        optimizer.step()


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
    for _ in range(4):
        grads = [torch.randn_like(p) for p in ours]
        grads[3] = None  # a matrix without a gradient this step is left alone, as torch does
        _step([(ours, batched), (theirs, reference)], grads)
        equal = sum(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        # bf16 products batched may round a few elements differently: most matrices bit for bit
        assert equal >= 0.9 * len(ours) and worst < 1e-5, (equal, worst)
    assert batched.state[ours[3]] == reference.state[theirs[3]] == {}  # never had a gradient
    for a, b in zip(ours, theirs, strict=True):
        if b in reference.state and reference.state[b]:
            assert torch.allclose(
                batched.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"], atol=1e-6
            )


def test_state_moves_between_the_two():
    ours, batched, theirs, reference = _pair(lr=1e-3)
    _step([(theirs, reference)], [torch.randn_like(p) for p in theirs])
    batched.load_state_dict(copy.deepcopy(reference.state_dict()))  # not the same buffers
    for p, q in zip(ours, theirs, strict=True):
        p.data.copy_(q.data)
    grads = [torch.randn_like(p) for p in ours]
    _step([(ours, batched), (theirs, reference)], grads)
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 1e-5
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
