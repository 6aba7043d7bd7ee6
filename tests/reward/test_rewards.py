"""GSM8K answer extraction, accuracy and format rewards."""

import pytest

from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward, Reward, extract_answer


def _trajectory(answer: str, truth="72", as_pairs=True) -> dict:
    messages = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": answer}]
    user_data = [("ground_truth", truth)] if as_pairs else {"ground_truth": truth}
    return {"messages": messages, "user_data": user_data}


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 8 * 9 = 72\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("first #### 3 then #### -4.5", "-4.5"),
        ("the answer is \\boxed{72}", "72"),
        ("\\boxed{\\frac{1}{2}} beats #### 3", "\\frac{1}{2}"),  # boxed wins, nested braces kept
        ("I think it is 72.", None),
        ("\\boxed{72", None),  # unclosed
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_accuracy_compares_numbers_and_reads_both_ground_truth_forms():
    reward = GSM8KAccuracyReward()
    batch = [
        _trajectory("#### 72"),
        _trajectory("#### 72.0", truth="Janet sells ... #### 72"),  # GSM8K's own answer field
        _trajectory("\\boxed{71}"),
        _trajectory("no answer here"),
        _trajectory("#### 1,000", truth="1000", as_pairs=False),
        {"messages": [{"role": "user", "content": "q"}], "user_data": [("ground_truth", "72")]},  # no reply
        {"messages": [{"role": "assistant", "content": "#### 72"}]},  # no ground truth
    ]
    assert reward(batch) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_format_rewards_the_form_whatever_the_number():
    batch = [_trajectory("#### 5"), _trajectory("\\boxed{x+1}"), _trajectory("5")]
    assert GSM8KFormatReward()(batch) == [1.0, 1.0, 0.0]


def test_a_reward_is_one_method():
    class Length(Reward):
        def score(self, completion, trajectory):
            return len(completion)

    assert Length()([_trajectory("abc")]) == [3.0]
