"""``InfonceLoss`` (``twinkle.loss.infonce``) against a float64 reference written group by group,
``task='embedding'`` through the model and ``EmbeddingMetric``.

Tolerances: loss and reference both run in float64 on the same embeddings: 1e-12. The fp32 case:
unit vectors of dimension ``D`` give cosines with an fp32 error of about ``D * eps32``, divided
by the temperature, and a log-sum-exp over ``docs`` terms adds ``docs * eps32``; the bound is their
sum times the loss's magnitude plus one."""

import math

import pytest
import torch

from twinkle.loss import InfonceLoss
from twinkle.metric import EmbeddingMetric
from twinkle.utils.errors import UserError

D = 8


def groups(sizes, seed=0, dtype=torch.float64):
    """Unit embeddings of groups of ``sizes`` rows (anchor, positive, negatives) and their marks."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    emb = torch.nn.functional.normalize(torch.randn(rows, D, generator=g, dtype=torch.float64), dim=-1)
    marks = torch.zeros(rows, dtype=torch.long)
    start = 0
    for n in sizes:
        marks[start] = 1
        start += n
    return emb.to(dtype), marks


def reference(emb, sizes, temperature, use_batch):
    emb = emb.double()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    docs_of = [list(range(s + 1, s + n)) for s, n in zip(starts, sizes, strict=True)]
    total = 0.0
    for s, mine in zip(starts, docs_of, strict=True):
        docs = [d for group in docs_of for d in group] if use_batch else mine
        scores = [float(emb[s] @ emb[d]) / temperature for d in docs]
        top = max(scores)
        lse = top + math.log(sum(math.exp(x - top) for x in scores))
        total += lse - float(emb[s] @ emb[mine[0]]) / temperature
    return total / len(sizes)


@pytest.mark.parametrize("sizes", [[2, 2, 2], [2, 4, 3], [3, 3]])
@pytest.mark.parametrize("use_batch", [True, False])
def test_loss_equals_the_float64_reference(sizes, use_batch):
    if not use_batch and sizes == [2, 2, 2]:
        sizes = [3, 2, 4]  # without in-batch negatives every group needs its own
    emb, marks = groups(sizes)
    got = InfonceLoss(temperature=0.07, use_batch=use_batch)({"labels": marks}, {"embeddings": emb})["loss"]
    assert float(got) == pytest.approx(reference(emb, sizes, 0.07, use_batch), abs=1e-12)


def test_gradient_matches_autograd_of_the_reference():
    sizes = [2, 3, 2]
    emb, marks = groups(sizes, seed=1)
    x = emb.clone().requires_grad_()
    InfonceLoss(temperature=0.1)({"labels": marks}, {"embeddings": x})["loss"].backward()
    assert torch.autograd.gradcheck(
        lambda e: InfonceLoss(temperature=0.1)({"labels": marks}, {"embeddings": e})["loss"],
        (emb.clone().requires_grad_(),),
    )
    assert float(x.grad.abs().sum()) > 0


def test_fp32_within_the_summation_bound():
    sizes = [2, 3, 2, 2]
    emb, marks = groups(sizes, seed=2)
    got = float(InfonceLoss(temperature=0.05)({"labels": marks}, {"embeddings": emb.float()})["loss"])
    want = reference(emb.float().double(), sizes, 0.05, True)
    eps = torch.finfo(torch.float32).eps
    assert abs(got - want) <= (D * eps / 0.05 + sum(sizes) * eps) * (1 + abs(want))


def test_hard_negatives_cut_and_repeat_in_order():
    emb, marks = groups([4, 3], seed=3)  # 2 negatives, then 1
    loss = InfonceLoss(temperature=0.1, use_batch=False, hard_negatives=2)
    got = float(loss({"labels": marks}, {"embeddings": emb})["loss"])
    # the second group's single negative (row 6) is used twice
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
    want = reference(emb[rows], [4, 4], 0.1, False)
    assert got == pytest.approx(want, abs=1e-12)


def test_bad_input_is_one_line():
    emb, marks = groups([2, 2])
    cases = [
        (lambda: InfonceLoss(temperature=0), "temperature must be a number > 0"),
        (lambda: InfonceLoss()({"labels": marks[:1]}, {"embeddings": emb[:1]}), r"2 rows\), got 1 row"),
        (lambda: InfonceLoss()({"labels": torch.tensor([1, 0])}, {"embeddings": emb[:2]}), "no contrast"),
        (
            lambda: InfonceLoss()({"labels": torch.tensor([1, 1, 0, 0])}, {"embeddings": emb}),
            "has no positive",
        ),
        (lambda: InfonceLoss()({"labels": torch.tensor([0, 1, 1, 0])}, {"embeddings": emb}), "first row"),
        (lambda: InfonceLoss(pooling="cls"), "pooling must be one of"),
    ]
    for make, message in cases:
        with pytest.raises(UserError, match=message) as info:
            make()
        assert "\n" not in str(info.value)


def test_embedding_metric_counts_in_batch_retrieval():
    emb, marks = groups([2, 2, 2], seed=4)
    emb[1] = emb[0]  # group 0's positive is its anchor: found
    emb[3] = emb[4]  # group 1's positive equals group 2's anchor, so group 2 finds the wrong one
    m = EmbeddingMetric()
    m.accumulate({"labels": marks}, {"embeddings": emb, "loss": 3.0, "num_tokens": 3})
    out = m.calculate()
    sims = emb @ emb.T
    hits = sum(int(max([1, 3, 5], key=lambda d: float(sims[a, d])) == a + 1) for a in (0, 2, 4))
    assert out["retrieval_accuracy"] == pytest.approx(hits / 3)
    assert out["pos_sim_max"] == pytest.approx(1.0)
    assert out["pos_sim"] == pytest.approx(float(sims[0, 1] + sims[2, 3] + sims[4, 5]) / 3)
    assert out["loss"] == pytest.approx(1.0)
    assert m.calculate() == {}
