"""Upstream's loss names and keywords here: ``SAPOLoss`` and ``BNPOLoss`` against hand
computations, ``torch_loss_mapping``, and the keywords of ``DPOLoss``/``GRPOLoss`` honoured or
refused by name. Hand computations run in float64 with the math module (1e-12: a few roundings
of values below 10)."""

import math

import pytest
import torch

from twinkle.loss import (
    LOSSES,
    BNPOLoss,
    DPOLoss,
    GKDLoss,
    GRPOLoss,
    InfonceLoss,
    SAPOLoss,
    torch_loss_mapping,
)
from twinkle.utils.errors import UserError

IGNORE = -100
# two rows: completions of 2 and 1 tokens; the policy's and the sampler's log-probs
LABELS = torch.tensor([[IGNORE, 5, 6], [IGNORE, IGNORE, 7]])
NEW = [[0.0, -1.0, -2.0], [0.0, 0.0, -0.5]]
OLD = [[-1.2, -1.9], [-0.8]]
ADV = [0.5, -1.0]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def call(loss, **step):
    logps = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    out = loss({"labels": LABELS}, {"logps": logps}, **step)
    value = out["loss"] / out["num_tokens"]  # the model's normalisation: sum / count
    value.backward()
    return float(value), logps.grad


def test_sapo_matches_the_soft_gate_by_hand():
    tau_pos, tau_neg = 1.0, 2.0
    value, grad = call(SAPOLoss(tau_pos=tau_pos, tau_neg=tau_neg), old_logps=OLD, advantages=ADV)
    rows, want_grad = [], [[0.0] * 3, [0.0] * 3]
    for i, (positions, adv) in enumerate(zip(([1, 2], [2]), ADV, strict=True)):
        tau = tau_pos if adv > 0 else tau_neg
        terms = []
        for k, t in enumerate(positions):
            r = math.exp(NEW[i][t] - OLD[i][k])
            s = sigmoid(tau * (r - 1))
            terms.append(-s * 4 / tau * adv)
            # d term / d logp = -adv * 4 s (1 - s) * r, over the row's tokens and the 2 rows
            want_grad[i][t] = -adv * 4 * s * (1 - s) * r / len(positions) / 2
        rows.append(sum(terms) / len(terms))
    assert value == pytest.approx(sum(rows) / 2, abs=1e-12)
    assert grad.flatten().tolist() == pytest.approx(sum(want_grad, []), abs=1e-12)


def test_sapo_on_policy_gradient_is_the_plain_policy_gradient():
    on_policy = [[-1.0, -2.0], [-0.5]]
    _, grad = call(SAPOLoss(tau_pos=3.0, tau_neg=0.5), old_logps=on_policy, advantages=ADV)
    # ratio 1: the gate's slope is 1, so d/dlogp = -A / tokens / rows whatever tau
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.125, -0.125, 0.0, 0.0, 0.5], abs=1e-12)


def test_bnpo_is_the_mean_over_every_completion_token():
    value, _ = call(BNPOLoss(epsilon=0.2), old_logps=OLD, advantages=ADV)
    terms = []
    for i, positions in enumerate(([1, 2], [2])):
        for k, t in enumerate(positions):
            r = math.exp(NEW[i][t] - OLD[i][k])
            terms.append(-min(r * ADV[i], min(max(r, 0.8), 1.2) * ADV[i]))
    assert value == pytest.approx(sum(terms) / 3, abs=1e-12)


def test_upstream_call_without_old_logps_is_on_policy_and_takes_b_by_1_advantages():
    value, _ = call(GRPOLoss(), advantages=torch.tensor([[0.5], [-1.0]]))
    assert value == pytest.approx(-(0.5 - 1.0) / 2, abs=1e-12)


def test_torch_loss_mapping_names_upstreams_classes():
    assert torch_loss_mapping["sapo"] is SAPOLoss and torch_loss_mapping["bnpo"] is BNPOLoss
    assert torch_loss_mapping["dpo"] is DPOLoss and torch_loss_mapping["grpo"] is GRPOLoss
    assert LOSSES["SAPOLoss"] is SAPOLoss
    assert torch_loss_mapping["gkd"] is GKDLoss and torch_loss_mapping["infonce"] is InfonceLoss


def test_dpo_and_grpo_take_upstreams_keywords():
    loss = DPOLoss(beta=0.2, loss_type="ipo", reference_free=True, sft_weight=0.5, ignore_index=-100)
    assert (loss.beta, loss.loss_type, loss.reference_free, loss.sft_weight) == (0.2, "ipo", True, 0.5)
    assert GRPOLoss(epsilon=0.3).epsilon_high == 0.3


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: DPOLoss(loss_type="kto_pair"), "not supported yet: loss_type='kto_pair'"),
        (lambda: DPOLoss(ignore_index=0), "not supported yet: ignore_index=0"),
        (lambda: GRPOLoss(entropy_coef=0.01), "not supported yet: entropy_coef=0.01"),
        (lambda: SAPOLoss(tau_pos=0), "SAPOLoss: tau_pos must be a number above 0"),
        (lambda: GKDLoss(beta=2.0), "GKDLoss: beta must be in"),
        (lambda: InfonceLoss(include_qq=True), "InfonceLoss: not supported yet: include_qq=True"),
        (lambda: call(GRPOLoss(), advantages=ADV, old=OLD), "unexpected keyword"),
    ],
)
def test_refused_in_one_line(build, needle):
    with pytest.raises(UserError, match=needle) as info:
        build()
    assert "\n" not in str(info.value)
