"""The rollout's row: labels on exactly the tokens the model generated, the sampler's log-probs
for exactly those, every prompt the model saw a prefix of the final row; bad input becomes an
observation, counted in the metrics."""

import pytest
from scripted import CountingEnv, ScriptedSampler, call

from twinkle.data_format import SamplingParams
from twinkle.utils.errors import UserError
from twinkle_agentic.envs import EnvTool
from twinkle_agentic.rollout import LAST_TURN_NOTICE, MultiTurnRollout
from twinkle_agentic.tools import FunctionTool, ToolManager

PROMPT = {"messages": [{"role": "user", "content": "Reach 3."}], "user_data": {"id": 7}}


def play(template, script, goal=3, max_turns=6, tools=None, **kwargs):
    env = CountingEnv(goal)
    env.reset()
    manager = ToolManager(tools if tools is not None else EnvTool.from_env(env), timeout=0.5)
    sampler = ScriptedSampler(template, script)
    rollout = MultiTurnRollout(
        sampler, template, manager, SamplingParams(max_tokens=64), max_turns=max_turns, **kwargs
    )
    return rollout([PROMPT])[0], sampler, rollout


def test_labels_sit_on_exactly_the_generated_tokens(template):
    script = [call("add", n=1), call("add", n=2), "done"]
    out, sampler, rollout = play(template, script)
    ids, labels = out["input_ids"], out["labels"]
    # every prompt the sampler saw is a prefix of the final row, and its reply follows it there
    spans = []
    for prompt, reply in zip((c[0] for c in sampler.calls), sampler.replies, strict=True):
        assert ids[: len(prompt)] == prompt
        assert ids[len(prompt) : len(prompt) + len(reply)] == reply
        spans += range(len(prompt), len(prompt) + len(reply))
    assert [i for i, label in enumerate(labels) if label != -100] == spans
    assert all(labels[i] == ids[i] for i in spans)
    assert len(out["old_logps"]) == len(spans)
    assert out["old_logps"] == [
        lp for reply in sampler.replies for lp in [-0.1 * (k + 1) for k in range(len(reply))]
    ]
    assert out["stop_reason"] == "env_done" and out["turns"] == 2 and out["reward"] == 1.0
    assert out["turn_rewards"] == [0.0, 1.0] and out["user_data"] == {"id": 7}
    assert [m["role"] for m in out["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert "total=3" in out["messages"][-1]["content"]
    assert rollout.metrics.tool_calls == 2 and rollout.metrics.generated_tokens == len(spans)


def test_the_rows_text_is_the_chat_template_rendering(template):
    out, _, _ = play(template, [call("add", n=1), "the total is 1"], goal=None)
    rendered, decoded = template.render(out["messages"]), template.decode(out["input_ids"])
    assert rendered == decoded + "\n"  # all but the newline ChatML writes after the last reply


def test_an_answer_ends_the_trajectory_and_a_reward_fn_adds(template):
    out, sampler, _ = play(template, ["no tools needed"], reward_fn=lambda t: 0.5 * len(t["messages"]))
    assert out["stop_reason"] == "answer" and out["turns"] == 1 and len(sampler.calls) == 1
    assert out["reward"] == 0.5 * len(out["messages"])


@pytest.mark.parametrize(
    "reply, kind, fragment",
    [
        (call("multiply", n=2), "unknown_tool", "there is no tool 'multiply'"),
        (call("add", n="two"), "bad_arguments", "must be integer"),
        ("<tool_call>add n=1</tool_call>", "malformed", "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"n": 1}}', "malformed", "not closed"),
    ],
)
def test_bad_calls_are_observations_and_the_rollout_goes_on(template, reply, kind, fragment):
    out, sampler, rollout = play(template, [reply, call("add", n=3), "ok"])
    assert fragment in out["messages"][3]["content"] and out["messages"][3]["content"].count("Error:") == 1
    assert rollout.metrics.errors[kind] == 1 and out["tool_errors"] == 1
    assert out["stop_reason"] == "env_done" and out["reward"] == 1.0  # the next call still ran


def test_a_tool_that_raises_or_hangs_is_an_observation(template):
    def boom(**_):
        raise OSError("no route")

    tools = [FunctionTool(boom, name="boom"), FunctionTool(lambda: __import__("time").sleep(5), name="hang")]
    out, _, rollout = play(template, [call("boom"), call("hang"), "giving up"], tools=tools)
    assert "OSError: no route" in out["messages"][3]["content"]
    assert "did not finish within 0.5 s" in out["messages"][5]["content"]
    assert rollout.metrics.errors["raised"] == 1 and rollout.metrics.errors["timeout"] == 1
    assert out["stop_reason"] == "answer" and out["turns"] == 3


def test_an_environment_that_never_ends_stops_at_the_turn_limit(template):
    out, sampler, rollout = play(template, [call("add", n=1)] * 3, goal=None, max_turns=3)
    assert out["stop_reason"] == "max_turns" and out["truncated"] and out["turns"] == 3
    assert rollout.metrics.turn_limit == 1 and len(sampler.calls) == 3
    assert LAST_TURN_NOTICE in out["messages"][-2]["content"]  # told before its last reply
    assert out["messages"][-1]["role"] == "assistant"  # the last reply's call is not run


def test_the_token_limit_ends_a_trajectory(template):
    first, _, _ = play(template, [call("add", n=1), "x"], goal=None)
    limit = len(first["input_ids"]) - 1  # room for the first reply, not the second
    out, _, rollout = play(template, [call("add", n=1), "x" * 50], goal=None, max_trajectory_tokens=limit)
    assert out["stop_reason"] == "max_tokens" and out["truncated"] and len(out["input_ids"]) <= limit
    assert rollout.metrics.token_limit == 1
    short, sampler, rollout = play(template, ["x"], max_trajectory_tokens=5)  # the prompt alone is longer
    assert short["stop_reason"] == "max_tokens" and short["turns"] == 0 and not sampler.calls
    assert short["old_logps"] == [] and rollout.metrics.token_limit == 1
    assert len(out["old_logps"]) == sum(label != -100 for label in out["labels"])


def test_one_line_errors(template):
    sampler = ScriptedSampler(template, ["x"])
    with pytest.raises(UserError, match="at least one reply"):
        MultiTurnRollout(sampler, template, max_turns=0)
    with pytest.raises(UserError, match="repeat a trajectory G times"):
        MultiTurnRollout(sampler, template, sampling_params=SamplingParams(num_samples=2))
    rollout = MultiTurnRollout(sampler, template)
    with pytest.raises(UserError, match="one per trajectory"):
        rollout([PROMPT, PROMPT], tool_manager=[ToolManager()])
    with pytest.raises(UserError, match="needs 'messages'"):
        rollout([{"prompt": "hi"}])
