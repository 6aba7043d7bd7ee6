"""``curves.png`` of preference and RL runs: their scores (reward margin and accuracy, the GRPO
cookbook's rewards) get a panel of their own between the losses and the learning rate."""

import json
import math

from PIL import Image

from twinkle.metric.curves import draw_curves, score_series

DPI = 110  # curves.py saves at this resolution


def dpo_records() -> list[dict]:
    records = []
    for step in (0, 5, 10):
        if step:
            records.append(
                {"kind": "train", "step": step, "loss": 1.0 / step, "lr": 1e-3,
                 "reward_margin": 0.5 * step, "reward_accuracy": min(1.0, 0.1 * step)}
            )  # fmt: skip
        records.append(
            {
                "kind": "eval",
                "step": step,
                "loss": 0.7,
                "reward_margin": 0.4 * step,
                "reward_accuracy": 0.08 * step,
            }
        )
    return records


def test_dpo_scores_are_read_by_kind():
    scores = score_series(dpo_records())
    assert list(scores) == [
        "train reward_margin",
        "eval reward_margin",
        "train reward_accuracy",
        "eval reward_accuracy",
    ]
    assert scores["train reward_margin"] == ([5, 10], [2.5, 5.0])
    assert scores["eval reward_accuracy"] == ([0, 5, 10], [0.0, 0.4, 0.8])


def test_rl_rewards_keep_their_own_names_and_skip_what_is_not_finite():
    """CompletionRewardMetric's mean rewards (not their std, nor the completion length) and the
    GRPO cookbook's held-out accuracy."""
    records = [
        {"kind": "train", "step": 1, "loss": 0.0, "train/total_reward": 0.2, "train/total_reward_std": 0.4,
         "train/completion_length": 30.0, "eval/greedy_accuracy": 0.1},
        {"kind": "train", "step": 2, "loss": 0.0, "train/total_reward": math.nan, "train/format_reward": 0.5},
        {"kind": "train", "step": 3, "loss": 0.0, "train/total_reward": 1.4, "eval/greedy_accuracy": 0.6},
    ]  # fmt: skip
    assert score_series(records) == {
        "train/total_reward": ([1, 3], [0.2, 1.4]),
        "eval/greedy_accuracy": ([1, 3], [0.1, 0.6]),
        "train/format_reward": ([2], [0.5]),
    }


def test_scores_are_per_adapter():
    records = [dict(r, adapter="a") for r in dpo_records()] + [
        {"kind": "train", "adapter": "b", "step": 5, "loss": 1.0, "lr": 1e-3}
    ]
    assert score_series(records, "b") == {}
    assert score_series(records, "a")["train reward_margin"] == ([5, 10], [2.5, 5.0])


def heights(tmp_path, records) -> int:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = draw_curves(jsonl, tmp_path / "curves.png")
    assert png is not None
    with Image.open(png) as image:
        return image.size[1]


def test_a_run_with_scores_draws_three_panels_one_without_draws_two(tmp_path):
    with_scores = heights(tmp_path, dpo_records())
    plain = heights(tmp_path, [{k: v for k, v in r.items() if "reward" not in k} for r in dpo_records()])
    assert (with_scores, plain) == (8 * DPI, 6 * DPI)
