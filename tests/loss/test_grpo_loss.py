"""``GRPOLoss`` and its variants (``twinkle.loss.grpo``): values and gradients against hand
computations, the clip, the KL term, ragged old log-probs, and a step of the tiny model on its
own sampler's completions.

Tolerances: the hand computations run in float64 on the same numbers with the math module
(1e-12: a few roundings of values below 10). Through the model, the sampler's log-probs equal the
trainer's within 1e-4 per token (``tests/sampler``), so each ratio is within ``exp(1e-4) - 1`` of
1 and the on-policy loss within that times ``max |A|`` of ``-mean(A)``."""

import math

import pytest
import torch

from twinkle.advantage import GRPOAdvantage
from twinkle.data_format import SamplingParams
from twinkle.loss import CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, build_loss
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

IGNORE = -100
LENGTHS = [2, 3, 4]  # completion tokens per row, after 2 prompt tokens; L = 6
ADV = [0.5, -1.0, 2.0]


def batch(seed: int = 0, lengths=LENGTHS):
    """labels (B, L) with 2 prompt positions, then the completion, then padding; policy logps
    (fp64 leaf); old and reference logps as one ragged list per row (completion only)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), 2 + max(lengths)
    labels = torch.full((rows, width), IGNORE)
    for i, n in enumerate(lengths):
        labels[i, 2 : 2 + n] = torch.arange(n) + 5
    logps = (-torch.rand(rows, width, generator=g, dtype=torch.float64) * 3).requires_grad_()
    mask = labels != IGNORE
    ragged = lambda t: [t[i][mask[i]].tolist() for i in range(rows)]  # noqa: E731
    old = ragged(logps.detach() + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3)
    ref = ragged(logps.detach() + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3)
    return labels, logps, old, ref


def run(loss, labels, logps, old, advantages=ADV, ref=None):
    inputs = {"labels": labels, "old_logps": old, "advantages": torch.tensor(advantages, dtype=torch.float64)}
    if ref is not None:
        inputs["ref_logps"] = ref
    out = loss(inputs, {"logps": logps})
    value = out["loss"] / out["num_tokens"]  # the model's normalisation: sum / count
    value.backward()
    return float(value.detach()), logps.grad


def completion(logps, labels, i):
    return [float(v) for v in logps.detach()[i][labels[i] != IGNORE]]


def test_on_policy_loss_is_minus_mean_advantage_and_its_gradient():
    labels, logps, _, _ = batch()
    old = [completion(logps, labels, i) for i in range(3)]
    value, grad = run(GRPOLoss(), labels, logps, old)
    assert value == pytest.approx(-sum(ADV) / 3, abs=1e-12)
    mask = labels != IGNORE
    for i, n in enumerate(LENGTHS):
        expected = torch.full((n,), -ADV[i] / (n * 3), dtype=torch.float64)
        torch.testing.assert_close(grad[i][mask[i]], expected, rtol=0, atol=1e-12)
    assert not grad[~mask].any()


def test_ratio_above_the_clip_gives_no_gradient_for_positive_advantages():
    labels, logps, _, _ = batch()
    old = [[v - math.log(1.5) for v in completion(logps, labels, i)] for i in range(3)]  # ratio 1.5
    value, grad = run(GRPOLoss(epsilon=0.2), labels, logps, old)
    mask = labels != IGNORE
    assert not grad[0][mask[0]].any() and not grad[2][mask[2]].any()  # A > 0: clipped at 1.2
    # A < 0: min(1.5 A, 1.2 A) is 1.5 A, unclipped: d/dlogp of -1.5 A over 3 tokens and 3 rows
    torch.testing.assert_close(
        grad[1][mask[1]], torch.full((3,), 1.5 * 1.0 / 9, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert value == pytest.approx(-(1.2 * 0.5 - 1.5 * 1.0 + 1.2 * 2.0) / 3, abs=1e-12)


def test_kl_to_a_reference_equal_to_the_policy_adds_nothing():
    labels, logps, old, _ = batch()
    plain, plain_grad = run(GRPOLoss(), labels, logps, old)
    plain_grad = plain_grad.clone()
    logps.grad = None
    same = [completion(logps, labels, i) for i in range(3)]
    with_kl, kl_grad = run(GRPOLoss(beta=0.5), labels, logps, old, ref=same)
    assert with_kl == pytest.approx(plain, abs=1e-12)
    torch.testing.assert_close(kl_grad, plain_grad, rtol=0, atol=1e-12)


def hand_token(lp, o, a, low, high):
    r = math.exp(lp - o)
    return -min(r * a, min(max(r, 1 - low), 1 + high) * a)


def hand_losses(labels, logps, old, ref):
    """Each variant's value by hand (module docstring of twinkle.loss.grpo)."""
    seqs = [completion(logps, labels, i) for i in range(3)]
    kl = [
        [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(s, rf, strict=True)]
        for s, rf in zip(seqs, ref, strict=True)
    ]
    grpo = [
        sum(hand_token(lp, o, a, 0.2, 0.28) + 0.1 * k for lp, o, k in zip(s, od, kk, strict=True)) / len(s)
        for s, od, kk, a in zip(seqs, old, kl, ADV, strict=True)
    ]
    gspo = []
    for s, od, a in zip(seqs, old, ADV, strict=True):
        r = math.exp(sum(lp - o for lp, o in zip(s, od, strict=True)) / len(s))
        gspo.append(-min(r * a, min(max(r, 1 - 0.1), 1 + 0.15) * a))
    dr = [
        sum(hand_token(lp, o, a, 0.2, 0.2) for lp, o in zip(s, od, strict=True)) / 8
        for s, od, a in zip(seqs, old, ADV, strict=True)
    ]
    cispo = [
        -min(math.exp(lp - o), 1.2) * a * lp
        for s, od, a in zip(seqs, old, ADV, strict=True)
        for lp, o in zip(s, od, strict=True)
    ]
    return {"grpo": sum(grpo) / 3, "gspo": sum(gspo) / 3, "dr": sum(dr) / 3, "cispo": sum(cispo) / len(cispo)}


@pytest.mark.parametrize(
    ("key", "loss", "with_ref"),
    [
        ("grpo", GRPOLoss(epsilon=0.2, epsilon_high=0.28, beta=0.1), True),
        ("gspo", GSPOLoss(epsilon=0.1, epsilon_high=0.15), False),
        ("dr", DRGRPOLoss(max_tokens=8), False),
        ("cispo", CISPOLoss(epsilon=0.2), False),
    ],
)
def test_each_variant_matches_a_hand_computation(key, loss, with_ref):
    labels, logps, old, ref = batch(seed=3)
    value, _ = run(loss, labels, logps, old, ref=ref if with_ref else None)
    assert value == pytest.approx(hand_losses(labels, logps, old, ref)[key], abs=1e-12)


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    labels, logps, old, _ = batch(seed=4)
    _, grad = run(CISPOLoss(epsilon=0.2), labels, logps, old)
    mask = labels != IGNORE
    for i in range(3):
        weights = [
            min(math.exp(lp - o), 1.2) for lp, o in zip(completion(logps, labels, i), old[i], strict=True)
        ]
        expected = torch.tensor([-w * ADV[i] / sum(LENGTHS) for w in weights], dtype=torch.float64)
        torch.testing.assert_close(grad[i][mask[i]], expected, rtol=0, atol=1e-12)


def test_every_variant_is_registered():
    for name in ("GRPOLoss", "GSPOLoss", "DRGRPOLoss", "CISPOLoss"):
        assert type(build_loss(name)).__name__ == name
    assert build_loss("GRPOLoss", beta=0.1).extra_inputs == ("old_logps", "advantages", "ref_logps")


def test_ragged_old_logps_of_the_wrong_length_name_the_row():
    labels, logps, old, _ = batch()
    old[1] = old[1][:-1]
    with pytest.raises(UserError, match=r"^old_logps row 1 has 2 values, but that row's completion has 3 "):
        run(GRPOLoss(), labels, logps, old)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"epsilon": -0.1}, "GRPOLoss: epsilon must be a number at least 0, got -0.1"),
     ({"beta": float("nan")}, "GRPOLoss: beta must be a number at least 0, got nan")],
)  # fmt: skip
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(UserError, match=f"^{message}$"):
        GRPOLoss(**kwargs)


PROMPTS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {"messages": [{"role": "user", "content": "twinkle"}]},
]


def test_a_step_on_the_tiny_model_from_its_sampler(make_model):
    model = make_model(init_lora_weights=False)  # B != 0: the adapter changes the policy
    model.set_loss("GRPOLoss", epsilon=0.2)
    sampler = TorchSampler(model)
    responses = sampler.sample(PROMPTS, SamplingParams(max_tokens=5, num_samples=3, seed=7))
    seqs = [s for r in responses for s in r.sequences]
    rows = [s.new_input_feature for s in seqs]
    old = [[lp[0][1] for lp in s.logprobs] for s in seqs]
    advantages = [1.0, -0.5, 2.0, 0.0, -1.5, 0.5]  # not centred: the on-policy loss is -mean(A)
    loss = model.forward_backward(inputs=rows, old_logps=old, advantages=advantages)
    bound = max(map(abs, advantages)) * (math.exp(1e-4) - 1)
    assert loss == pytest.approx(-sum(advantages) / len(advantages), abs=bound)
    assert model.clip_grad_and_step()
    # GRPOAdvantage's output goes in as it is; a wrong old_logps row is one line naming it
    centred = GRPOAdvantage()([1, 0, 0, 1, 1, 1], num_generations=3)
    assert math.isfinite(model.forward_backward(inputs=rows, old_logps=old, advantages=centred))
    model.clip_grad_and_step()
    old[4] = old[4] + [-1.0]
    with pytest.raises(
        UserError, match=r"^old_logps row 4 has \d+ values, but that row's completion has \d+"
    ):
        model.forward_backward(inputs=rows, old_logps=old, advantages=advantages)
