"""``CompletionRewardMetric`` (rewards and lengths of sampled completions into ``metrics.jsonl``),
``GSM8KProcessor`` (GSM8K rows -> sampler prompts) and the bundled ``arithmetic-gsm8k`` set.

Tolerances: means and population std of a few small numbers (1e-12)."""

import json
import math

import pytest

import twinkle
from twinkle.hub.dataset import resolve_dataset
from twinkle.metric import CompletionRewardMetric, build_metric, report
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward
from twinkle.runtime import RunDefaults
from twinkle.utils.errors import UserError


def test_means_std_and_lengths_then_reset():
    metric = build_metric("CompletionRewardMetric")
    metric.accumulate(rewards={"accuracy": [1, 0, 0, 1]}, completion_lengths=[4, 6])
    metric.accumulate(
        rewards={"accuracy": [1, 1], "format": [1, 1]}, completion_lengths=[5], generate_time=2.0
    )
    out = metric.calculate()
    mean = 4 / 6
    assert out["train/accuracy_reward"] == pytest.approx(mean, abs=1e-12)
    assert out["train/accuracy_reward_std"] == pytest.approx(math.sqrt(mean * (1 - mean)), abs=1e-12)
    assert out["train/format_reward"] == 1.0 and out["train/format_reward_std"] == 0.0
    assert out["train/completion_length"] == 5.0 and out["profiling/generate_seconds"] == 2.0
    assert metric.calculate() == {}  # calculate resets
    with pytest.raises(
        UserError, match=r"^CompletionRewardMetric: reward 'x' holds a NaN or inf; rewards must be finite$"
    ):
        metric.accumulate(rewards={"x": [float("nan")]})


def test_reaches_metrics_jsonl_through_calculate_metric(make_model, tmp_path):
    twinkle.initialize(seed=0, run=RunDefaults(output_dir=str(tmp_path), report_to=()))
    model = make_model()
    metric = CompletionRewardMetric()
    model.add_metric(metric, is_training=True)
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]}
    for step in range(2):
        metric.accumulate(rewards={"accuracy": [step, step]}, completion_lengths=[3, 5])
        model.forward_backward(inputs=[row])
        model.clip_grad_and_step()
        model.calculate_metric(is_training=True)
    report.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["train/accuracy_reward"] for r in train] == [0.0, 1.0]
    assert all(r["train/completion_length"] == 4.0 for r in train)


def test_gsm8k_processor_keeps_the_answer_for_the_reward():
    rows = resolve_dataset("arithmetic-gsm8k", split="eval")
    assert len(rows) == 100 and len(resolve_dataset("twinkle://arithmetic-gsm8k")) == 400
    prompt = GSM8KProcessor(system="Be brief.").preprocess(dict(rows[0]), 0)
    truth = rows[0]["answer"].rsplit("####", 1)[1].strip()
    assert prompt == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": rows[0]["question"]},
        ],
        "user_data": [("ground_truth", truth)],
    }
    assert GSM8KProcessor(system=None).preprocess(dict(rows[0]))["messages"][0]["role"] == "user"
    reply = {
        **prompt,
        "messages": [*prompt["messages"], {"role": "assistant", "content": f"so\n#### {truth}"}],
    }
    assert GSM8KAccuracyReward()([reply]) == [1.0]
    with pytest.raises(UserError, match=r"^row 3: 'answer' has no final '#### N'; GSM8K answers end with"):
        GSM8KProcessor().preprocess({"question": "1+1?", "answer": "2"}, 3)
    with pytest.raises(
        UserError, match=r"^the bundled dataset arithmetic-gsm8k has no 'test' split; use split"
    ):
        resolve_dataset("arithmetic-gsm8k", split="test")
