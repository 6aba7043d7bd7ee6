"""``twinkle_agentic.reward`` (answer F1 and the two shaping bonuses) and
``twinkle_agentic.chunker.NativeChunker`` with ``Chunks.to_trajectory``."""

import pytest

from twinkle.utils.errors import UserError
from twinkle_agentic.chunker.native import NativeChunker
from twinkle_agentic.data_format import Chunks
from twinkle_agentic.reward import CoTReward, F1Reward, ToolExploreReward
from twinkle_agentic.reward.f1 import _extract_final_answer, _f1_score


def answered(reply, truth, *middle):
    return {
        "messages": [{"role": "user", "content": "q"}, *middle, {"role": "assistant", "content": reply}],
        "user_data": {"ground_truth": truth},
    }


def test_final_answer_and_f1():
    assert (
        _extract_final_answer(r"first \boxed{1}, then \boxed{\frac{1}{2}} and \boxed{open") == r"\frac{1}{2}"
    )
    assert _extract_final_answer("no box") == ""
    assert _f1_score("The Eiffel Tower!", "eiffel tower") == (1.0, 1.0)
    f1, exact = _f1_score("Paris France", "Paris")
    assert f1 == pytest.approx(2 / 3) and exact == 0.0
    assert _f1_score("", "") == (1.0, 1.0) and _f1_score("x", "") == (0.0, 0.0)


def test_f1_reward_takes_the_best_ground_truth():
    trajectories = [
        answered(r"It is \boxed{Paris}.", ["Lyon", "Paris"]),
        answered(r"\boxed{New York City}", "New York"),
        answered("Answer: Rome", "Rome"),
        {**answered(r"\boxed{Oslo}", None), "user_data": [("ground_truth", "Oslo")]},  # upstream's pairs
    ]
    rewards = F1Reward()(trajectories)
    assert rewards[:3] == [1.0, pytest.approx(0.8), 0.0] and rewards[3] == 1.0
    assert F1Reward(answer_pattern=r"Answer: (\w+)")(trajectories[2:3]) == [1.0]


def test_cot_and_tool_explore_bonuses():
    steps = "\n".join(f"Step {i}: work" for i in range(1, 5)) + "\n\\boxed{4}"
    many = "\n".join(f"Step {i}. work" for i in range(1, 9)) + "\n\\boxed{4}"
    assert CoTReward()([answered(steps, "4"), answered(many, "4"), answered("Step 1: 4", "4")]) == [
        0.3,
        0.1,
        0.0,
    ]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    found = [call, {"role": "tool", "content": "page text"}]
    failed = [call, {"role": "tool", "content": "ERROR: timeout"}]
    reward = ToolExploreReward()
    assert reward([answered(r"\boxed{4}", "4", *found)]) == [1.0]
    assert reward([answered(r"\boxed{4}", "4", *failed)]) == [0.0]
    assert reward([answered(r"\boxed{5}", "4", *found)]) == [0.0]  # a wrong answer earns nothing
    assert reward([answered(r"\boxed{4}", "4", *(found * 4))]) == [0.5]


def test_native_chunker_cuts_the_first_user_message_and_puts_it_back():
    context = "".join(f"<block_{i}>Passage {i}. " + "word " * 30 + "\n\n" for i in range(1, 4))
    trajectory = {
        "messages": [
            {"role": "system", "content": "Answer from the passages."},
            {"role": "user", "content": context},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "result", "tool_call_id": "1"},
            {"role": "user", "content": "And then?"},
        ]
    }
    chunker = NativeChunker(chunk_size=80, passage_boundary_re=r"<block_\d+>")
    chunks = chunker(trajectory)
    pieces = [c["content"] for c in chunks.chunks if c["raw"].get("kind") == "piece"]
    assert "".join(pieces) == context and all(len(p) <= 80 for p in pieces)
    assert all(p.count("<block_") <= 1 for p in pieces)  # no piece spans two passages
    assert [c["round"] for c in chunks.chunks][:2] == [0, 1] and chunks.chunks[-1]["round"] == 2
    assert chunks.to_trajectory(block_wrapper=None) == trajectory
    chunks.chunks[1] = {**chunks.chunks[1], "content": "short", "raw": {"kind": "piece", "condensed": True}}
    again = Chunks(chunks.chunks).to_trajectory()["messages"][1]["content"]
    assert again.startswith("<block_1>short</block_1>")
    assert NativeChunker(chunk_size=4).split("abcdefghij") == ["abcd", "efgh", "ij"]
    with pytest.raises(UserError):
        NativeChunker(chunk_size=0)
