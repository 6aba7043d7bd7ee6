"""Upstream's metric names here: ``GRPOMetric`` (and its GSPO/CISPO clip counts) against values
worked out by hand, ``CompletionRewardMetric`` and ``DPOMetric`` in upstream's call shapes.
Tolerance 1e-12: float64 sums of a few values below 10."""

import math

import pytest
import torch

from twinkle.metric import (
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    build_metric,
)
from twinkle.utils.errors import UserError

IGNORE = -100
LABELS = torch.tensor([[IGNORE, 5, 6], [IGNORE, IGNORE, 7]])
NEW = torch.tensor([[0.0, -1.0, -2.0], [0.0, 0.0, -0.5]], dtype=torch.float64)
OLD = [[-1.5, -1.9], [-0.5]]  # token ratios exp(0.5), exp(-0.1), exp(0)
ADV = [1.0, -1.0]


def k3(d: float) -> float:
    return math.exp(d) - d - 1


def test_grpo_metric_values_by_hand():
    m = GRPOMetric(epsilon=0.2)
    m.accumulate({"labels": LABELS}, {"logps": NEW}, old_logps=OLD, advantages=ADV)
    out = m.calculate()
    diffs = [0.5, -0.1, 0.0]
    assert out["train/mean_new_logp"] == pytest.approx(-3.5 / 3, abs=1e-12)
    assert out["train/policy_confidence"] == pytest.approx(math.exp(-3.5 / 3), abs=1e-12)
    assert out["train/mean_old_logp"] == pytest.approx(-3.9 / 3, abs=1e-12)
    assert out["train/logp_diff_mean"] == pytest.approx(0.4 / 3, abs=1e-12)
    assert out["train/approx_kl"] == pytest.approx(sum(map(k3, diffs)) / 3, abs=1e-12)
    assert out["train/token_kl_max"] == pytest.approx(k3(0.5), abs=1e-12)
    assert out["train/token_ratio_max"] == pytest.approx(math.exp(0.5), abs=1e-12)
    # only the first token leaves [0.8, 1.2] on its advantage's side (1.65 > 1.2 with A > 0)
    assert out["train/clip_ratio_high"] == pytest.approx(1 / 3, abs=1e-12)
    assert out["train/clip_ratio_low"] == 0.0 and out["train/clip_ratio"] == pytest.approx(1 / 3)
    assert m.calculate() == {}  # calculate resets


def test_grpo_metric_over_micro_batches_with_entropy():
    m = GRPOMetric()
    rows = [{"labels": LABELS[:1]}, {"labels": LABELS[1:]}]
    m.accumulate(rows, {"logps": [NEW[:1], NEW[1:]], "entropies": [torch.ones(1, 3), torch.zeros(1, 3)]})
    out = m.calculate()
    assert out["train/mean_new_logp"] == pytest.approx(-3.5 / 3, abs=1e-12)
    assert out["train/entropy"] == pytest.approx(2 / 3, abs=1e-12)
    assert "train/approx_kl" not in out  # no old_logps: no drift to report


def test_gspo_and_cispo_count_their_own_clips():
    gspo = GSPOMetric(epsilon=0.2)
    gspo.accumulate({"labels": LABELS}, {"logps": NEW}, old_logps=OLD, advantages=ADV)
    # row 0's ratio exp(mean(0.5, -0.1)) = exp(0.2) > 1.2 with A > 0; row 1's is 1
    assert gspo.calculate()["train/clip_ratio_high"] == pytest.approx(1 / 2, abs=1e-12)
    cispo = CISPOMetric(epsilon=0.2)
    flipped = [-1.0, 1.0]  # CISPO counts whatever the advantage's sign
    cispo.accumulate({"labels": LABELS}, {"logps": NEW}, old_logps=OLD, advantages=flipped)
    assert cispo.calculate()["train/clip_ratio_high"] == pytest.approx(1 / 3, abs=1e-12)


def test_grpo_metric_refuses_what_it_cannot_read():
    m = GRPOMetric()
    with pytest.raises(UserError, match="row 0 has 3 values but 2 labelled positions"):
        m.accumulate({"labels": LABELS}, {"logps": NEW}, old_logps=[[0.0] * 3, [0.0]])
    with pytest.raises(UserError, match="not supported yet: top_k_kl"):
        GRPOMetric(top_k_kl=5)
    assert EmbeddingMetric().calculate() == {}  # built; nothing seen yet


def test_completion_reward_metric_in_the_grpo_scripts_shape():
    m = CompletionRewardMetric()
    m.accumulate(completion_lengths=[4, 6], rewards={"total": [1.0, 0.0], "accuracy": [1.0, 1.0]})
    out = m.calculate()
    assert out["train/total_reward"] == 0.5 and out["train/total_reward_std"] == 0.5
    assert out["train/accuracy_reward"] == 1.0 and out["train/completion_length"] == 5.0
    m.accumulate(completion_lengths=[1], rewards={"total": [1.0]})
    m.reset()
    assert m.calculate() == {}


def test_dpo_metric_takes_beta_through_add_metric_and_reads_ref_outputs():
    m = build_metric(DPOMetric, beta=0.5)
    labels = torch.tensor([[IGNORE, 1, 2], [IGNORE, 3, IGNORE]])
    logps = torch.tensor([[0.0, -1.0, -1.0], [0.0, -3.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -1.5], [0.0, -2.0, 0.0]])
    m.accumulate({"labels": labels}, {"logps": logps}, ref_outputs={"logps": ref})
    out = m.calculate()
    assert out["chosen_reward"] == pytest.approx(0.5) and out["rejected_reward"] == pytest.approx(-0.5)
    assert out["reward_margin"] == pytest.approx(1.0) and out["reward_accuracy"] == 1.0


def test_grpo_metric_reads_a_steps_outputs_as_upstreams_routing_replay_script_passes_them():
    from twinkle.model.outputs import StepOutputs

    out = StepOutputs(0.5, 3, NEW)
    out["logps"] = [NEW[i : i + 1] for i in range(NEW.shape[0])]  # the script's per-row split
    by_step, by_dict = GRPOMetric(), GRPOMetric()
    rows = [{"labels": LABELS[:1]}, {"labels": LABELS[1:]}]
    by_step.accumulate(rows, out, old_logps=OLD, advantages=ADV)
    by_dict.accumulate({"labels": LABELS}, {"logps": NEW}, old_logps=OLD, advantages=ADV)
    assert by_step.calculate() == by_dict.calculate()
