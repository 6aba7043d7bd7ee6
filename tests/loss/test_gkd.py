"""``GKDLoss`` (``twinkle.loss.gkd``) against divergences written out in float64.

Tolerances: the references and the loss both run in float64 on the same numbers, so they agree
to a few ulps of values below ~10 (1e-12). The fp32 case: every term is computed in fp32 from
logits of magnitude ~3 over ``V`` tokens; a softmax and a sum over ``V`` terms carry a relative
error of about ``V * eps32`` at worst, so the per-token divergence is compared within
``V * eps32 * (1 + |value|)``."""

import math

import pytest
import torch

from twinkle.loss import GKDLoss, build_loss
from twinkle.loss.gkd import generalized_jsd, topk_prompt_inputs
from twinkle.utils.errors import UserError

IGNORE = -100
B, L, V = 2, 5, 11


def data(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    teacher = (torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :2] = IGNORE  # a prompt
    labels[1, -1] = IGNORE  # padding
    return student, teacher, labels


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of each row, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def reference(student, teacher, labels, beta, temperature=1.0, topk=None):
    """The per-token mean divergence, written out position by position in float64."""
    values = []
    for b in range(B):
        for t in range(L):
            if labels[b, t] == IGNORE:
                continue
            s, te = student[b, t].double() / temperature, teacher[b, t].double() / temperature
            if topk is not None:
                keep = teacher[b, t].double().argsort(descending=True)[:topk]
                s, te = s[keep], te[keep]
            ps, pt = torch.log_softmax(s, -1), torch.log_softmax(te, -1)
            if beta == 0:
                values.append(kl(pt, ps))
            elif beta == 1:
                values.append(kl(ps, pt))
            else:
                m = torch.log(beta * pt.exp() + (1 - beta) * ps.exp())
                values.append(beta * kl(pt, m) + (1 - beta) * kl(ps, m))
    return torch.stack(values).mean()


def call(loss, student, labels, **teacher):
    return loss({"labels": labels}, {"logits": student}, **teacher)["loss"]


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3, 0.5])
def test_full_logits_equal_the_direct_divergence_in_float64(beta):
    student, teacher, labels = data()
    got = call(GKDLoss(beta=beta), student, labels, teacher_logits=teacher)
    assert float(got) == pytest.approx(float(reference(student, teacher, labels, beta)), abs=1e-12)


def test_beta_0_and_1_are_forward_and_reverse_kl():
    student, teacher, labels = data(1)
    mask = labels != IGNORE
    ps, pt = torch.log_softmax(student[mask], -1), torch.log_softmax(teacher[mask], -1)
    forward = call(GKDLoss(beta=0.0), student, labels, teacher_logits=teacher)
    reverse = call(GKDLoss(beta=1.0), student, labels, teacher_logits=teacher)
    assert float(forward) == pytest.approx(float(kl(pt, ps).mean()), abs=1e-12)
    assert float(reverse) == pytest.approx(float(kl(ps, pt).mean()), abs=1e-12)
    assert float(forward) != pytest.approx(float(reverse), abs=1e-3)  # they differ on these numbers


@pytest.mark.parametrize("beta,temperature,k", [(0.0, 1.0, 3), (1.0, 2.0, 4), (0.5, 0.7, 5)])
def test_topk_truncation_matches_the_renormalised_formula(beta, temperature, k):
    student, teacher, labels = data(2)
    want = reference(student, teacher, labels, beta, temperature, topk=k)
    by_logits = call(
        GKDLoss(beta=beta, temperature=temperature, topk=k), student, labels, teacher_logits=teacher
    )
    # a remote teacher's top-k log-probabilities at temperature 1 give the same loss
    logps, ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    remote = call(
        GKDLoss(beta=beta, temperature=temperature),
        student,
        labels,
        teacher_topk_logprobs=logps,
        teacher_topk_indices=ids,
    )
    assert float(by_logits) == pytest.approx(float(want), abs=1e-12)
    assert float(remote) == pytest.approx(float(want), abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_gradients_match_autograd_of_the_reference(beta):
    student, teacher, labels = data(3)
    a = student.clone().requires_grad_()
    call(GKDLoss(beta=beta, temperature=1.5, topk=6), a, labels, teacher_logits=teacher).backward()
    b = student.clone().requires_grad_()
    reference(b, teacher, labels, beta, 1.5, topk=6).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    small = student[:, :, :4].clone().requires_grad_()
    fn = lambda x: call(GKDLoss(beta=beta), x, labels % 4, teacher_logits=teacher[:, :, :4])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (small,))


def test_forward_kl_gradient_is_the_probability_gap():
    # d KL(p_T || p_S) / d s = (p_S - p_T) / T per token, divided by the token count
    student, teacher, labels = data(4)
    x = student.clone().requires_grad_()
    call(GKDLoss(beta=0.0, temperature=2.0), x, labels, teacher_logits=teacher).backward()
    mask = labels != IGNORE
    gap = (torch.softmax(student / 2, -1) - torch.softmax(teacher / 2, -1)) / 2 / mask.sum()
    torch.testing.assert_close(x.grad[mask], gap[mask], rtol=0, atol=1e-14)
    assert float(x.grad[~mask].abs().max()) == 0.0


def test_fp32_within_the_summation_bound():
    student, teacher, labels = data(5)
    got = float(call(GKDLoss(beta=0.5), student.float(), labels, teacher_logits=teacher.float()))
    want = float(reference(student.float().double(), teacher.float().double(), labels, 0.5))
    assert abs(got - want) <= V * torch.finfo(torch.float32).eps * (1 + abs(want))


def test_a_teacher_equal_to_the_student_gives_zero():
    student, _, labels = data(6)
    for beta in (0.0, 0.5, 1.0):
        assert abs(float(call(GKDLoss(beta=beta), student, labels, teacher_logits=student))) < 1e-14


def test_sampler_scores_roll_into_upstreams_layout():
    # position i of a sampler's scores is token i's; the loss's layout holds token i + 1's at i
    scores = [[None, [(3, -0.1), (4, -2.5)], [(5, -0.2), (3, -1.9)]], [None, [(1, -0.3), (2, -1.4)]]]
    out = topk_prompt_inputs(scores, 2)
    ids, lps = out["teacher_topk_indices"], out["teacher_topk_logprobs"]
    assert ids.shape == (2, 3, 2)
    assert ids[0, 0].tolist() == [3, 4] and ids[0, 1].tolist() == [5, 3] and ids[1, 0].tolist() == [1, 2]
    assert lps[0, 1].tolist() == pytest.approx([-0.2, -1.9])
    with pytest.raises(UserError, match="fewer than topk=3"):
        topk_prompt_inputs(scores, 3)


def test_bad_input_is_one_line():
    student, teacher, labels = data()
    cases = [
        (lambda: GKDLoss(temperature=0), "temperature must be > 0"),
        (lambda: GKDLoss(temperature=-1.0), "temperature must be > 0"),
        (lambda: GKDLoss(beta=1.5), r"beta must be in \[0, 1\]"),
        (lambda: GKDLoss(topk=0), "topk must be a whole number"),
        (
            lambda: call(GKDLoss(topk=V + 1), student, labels, teacher_logits=teacher),
            "larger than the vocabulary",
        ),
        (
            lambda: call(
                GKDLoss(), student, labels, teacher_logits=torch.randn(B, L, V + 3, dtype=torch.float64)
            ),
            "another tokenizer",
        ),
        (
            lambda: call(
                GKDLoss(),
                student,
                labels,
                teacher_topk_logprobs=torch.zeros(B, L, 2),
                teacher_topk_indices=torch.full((B, L, 2), V + 5),
            ),
            "another tokenizer",
        ),
        (lambda: call(GKDLoss(), student, labels), "needs the teacher"),
    ]
    for make, message in cases:
        with pytest.raises(UserError, match=message) as info:
            make()
        assert "\n" not in str(info.value)


def test_registered_under_both_names():
    assert isinstance(build_loss("GKDLoss", beta=0.2, temperature=2.0, topk=8), GKDLoss)
    from twinkle.loss import torch_loss_mapping

    assert torch_loss_mapping["gkd"] is GKDLoss


def test_generalized_jsd_is_symmetric_at_one_half():
    g = torch.Generator().manual_seed(7)
    a, b = (
        torch.randn(4, V, generator=g, dtype=torch.float64),
        torch.randn(4, V, generator=g, dtype=torch.float64),
    )
    torch.testing.assert_close(
        generalized_jsd(a, b, 0.5, 1.0), generalized_jsd(b, a, 0.5, 1.0), rtol=0, atol=1e-14
    )
    assert float(generalized_jsd(a, b, 0.5, 1.0).max()) <= math.log(2) + 1e-12
