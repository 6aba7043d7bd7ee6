"""``GSM8KFormatReward`` rewards one final answer that ends the completion: a list of ``####``
answers (the form a GRPO run collapsed into when any ``####`` scored) or text running on after
the answer scores 0, while the accuracy reward still reads the last answer as before."""

import pytest

from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward


def _trajectory(answer: str, truth: str = "8") -> dict:
    messages = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "user_data": [("ground_truth", truth)]}


@pytest.mark.parametrize(
    ("text", "score"),
    [("5 + 3 = 8\n#### 8", 1.0), ("#### 8\n", 1.0), ("#### 1,234.", 1.0), ("so \\boxed{8}$.", 1.0),
     ("\\boxed{x+1}", 1.0), ("#### 5\n#### 2\n#### 8", 0.0), ("#### 8 apples, then 3 more", 0.0),
     ("\\boxed{7} or \\boxed{8}", 0.0), ("#### 8 and \\boxed{8}", 0.0), ("\\boxed{8} is the answer", 0.0),
     ("8", 0.0), ("#### ", 0.0)],
)  # fmt: skip
def test_one_final_answer_that_ends_the_completion(text, score):
    assert GSM8KFormatReward()([_trajectory(text)]) == [score]


def test_accuracy_still_reads_the_last_answer():
    batch = [_trajectory("#### 5\n#### 2\n#### 8"), _trajectory("#### 8 apples, then 3 more")]
    assert GSM8KAccuracyReward()(batch) == [1.0, 1.0]
    assert GSM8KFormatReward()(batch) == [0.0, 0.0]
