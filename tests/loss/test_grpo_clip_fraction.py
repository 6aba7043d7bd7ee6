"""The GRPO losses' clip count and the name the model reports it under: ``clip_fraction`` (the
share of the loss's units whose clipped term was taken), never ``accuracy``.

The hand cases use ratios of 1.5 and 0.5 against clip ranges of 0.2 (GRPO, CISPO) and 3e-4 /
4e-4 (GSPO), so no count sits near a boundary. Through the model the sampler's log-probs equal
the trainer's within 1e-4 (``tests/sampler``): a ratio meant as 2 lands within 2e-4 of 2, far
from the clip at 1.2, so the reported fraction is exact."""

import math

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.loss import CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss
from twinkle.sampler import TorchSampler

# Two completions: row 0 has 4 tokens (one at ratio 1.5, A > 0), row 1 has 2 (both at 0.5, A < 0)
SAMPLES = torch.tensor([0, 0, 0, 0, 1, 1])
RATIOS = torch.tensor([1.5, 1.0, 1.0, 1.0, 0.5, 0.5], dtype=torch.float64)
ADV = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)


def counts(loss) -> tuple[float, int]:
    old = torch.full((6,), -1.0, dtype=torch.float64)
    out = loss.from_rows(old + RATIOS.log(), old, ADV, SAMPLES, 2)
    return float(out.num_correct), out.num_tokens


@pytest.mark.parametrize(
    ("loss", "clipped", "count"),
    [(GRPOLoss(), 0.25 + 1.0, 2),  # each completion's clipped share, over completions
     (DRGRPOLoss(max_tokens=8), 0.25 + 1.0, 2),
     (CISPOLoss(epsilon_high=0.2), 1.0, 6),  # tokens above 1 + epsilon_high, over tokens
     (GSPOLoss(), 2.0, 2)],  # completions: 1.5 ** (1/4) > 1 + 4e-4 with A > 0, 0.5 < 1 - 3e-4 with A < 0
)  # fmt: skip
def test_the_clip_count_is_in_the_units_the_loss_counts(loss, clipped, count):
    assert counts(loss) == (pytest.approx(clipped, abs=1e-12), count)
    assert loss.correct_metric == "clip_fraction"


def test_the_model_reports_clip_fraction_not_accuracy(make_model):
    model = make_model(init_lora_weights=False)
    model.set_loss("GRPOLoss", epsilon=0.2)
    responses = TorchSampler(model).sample(
        [{"messages": [{"role": "user", "content": "Who are you?"}]}],
        SamplingParams(max_tokens=5, num_samples=4, seed=3),
    )
    seqs = [s for r in responses for s in r.sequences]
    old = [[lp[0][1] - math.log(2.0) for lp in s.logprobs] for s in seqs]  # every ratio is 2
    # A > 0: every token clipped at 1.2; A < 0: min(2A, 1.2A) is 2A, no token clipped
    model.forward_backward(
        inputs=[s.new_input_feature for s in seqs], old_logps=old, advantages=[1.0, -1.0, 1.0, -1.0]
    )
    model.clip_grad_and_step()
    metrics = model.calculate_metric(is_training=True)
    assert "accuracy" not in metrics
    assert metrics["clip_fraction"] == pytest.approx(0.5, abs=1e-12)
    # the loss is a mean over completions, and its count is reported as what it counts
    assert metrics["completions"] == 4 and "supervised_tokens" not in metrics
