"""With a real sampler (the tiny model): the sampler's log-probs of the generated tokens equal a
forward pass over the whole trajectory, and a GRPO step trains on exactly those tokens."""

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.loss import GRPOLoss
from twinkle.sampler import TorchSampler
from twinkle_agentic.rollout import MultiTurnRollout
from twinkle_agentic.tools import FunctionTool, ToolManager
from twinkle_agentic.tools.base import ToolOutcome


class EveryReplyCalls(ToolManager):
    """Reads every reply as one call, so a random model plays several turns."""

    def __init__(self):
        super().__init__([FunctionTool(lambda: "x", name="look")])
        self.count = 0

    def parse(self, text):
        return [{"function": {"name": "look", "arguments": {}}}], []

    def execute_reply(self, text):
        self.count += 1
        return [ToolOutcome(f"you see room {self.count}")], True


STOPS = list(range(200, 600))  # token ids that end a reply: the random model's replies end early, not cut

PROMPTS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {"messages": [{"role": "user", "content": "twinkle Paris France"}]},
]


@pytest.fixture
def played(make_model, template):
    model = make_model()
    sampler = TorchSampler(model)
    rollout = MultiTurnRollout(
        sampler, template, sampling_params=SamplingParams(max_tokens=8, seed=3, stop=STOPS), max_turns=3
    )
    out = rollout(PROMPTS, tool_manager=[EveryReplyCalls(), EveryReplyCalls()])
    return model, rollout, out


def test_sampler_logprobs_equal_a_forward_over_the_trajectory(played):
    model, _, out = played
    assert [o["turns"] for o in out] == [3, 3]  # observations between the replies
    logps = model.forward_only(inputs=out)["logps"]
    for i, row in enumerate(out):
        labels = torch.tensor(row["labels"])
        where = (labels != -100).nonzero(as_tuple=True)[0]
        assert len(where) == len(row["old_logps"]) > 0
        torch.testing.assert_close(
            logps[i, where].float(), torch.tensor(row["old_logps"]), atol=2e-4, rtol=1e-4
        )


def test_the_loss_reads_exactly_the_generated_tokens(played):
    """Cross entropy through the model equals the mean of -log p over the generated tokens alone,
    taken from a plain forward of the causal LM."""
    model, _, out = played
    loss = float(model.forward_only(inputs=out)["loss"])
    lm = model.model
    terms = []
    with torch.no_grad():
        for row in out:
            ids = torch.tensor([row["input_ids"]])
            logits = lm(input_ids=ids).logits.float()[0]
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            generated = torch.tensor(row["labels"][1:]) != -100
            terms.append(-lp[generated])
    torch.testing.assert_close(loss, float(torch.cat(terms).mean()), atol=1e-4, rtol=1e-4)


def test_a_grpo_step_takes_the_rollout_rows(played):
    model, _, out = played
    model.set_loss(GRPOLoss(epsilon=0.2))
    advantages = [1.0, -1.0]
    model.forward_backward(inputs=out, old_logps=[o["old_logps"] for o in out], advantages=advantages)
    model.clip_grad_and_step()
    metrics = model.calculate_metric(is_training=True)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
