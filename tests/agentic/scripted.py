"""A scripted "model" and a scripted environment: the rollout's bookkeeping is checked against
replies and observations known in advance, with no sampling involved."""

from typing import Any

from twinkle.data_format import SampledSequence, SampleResponse
from twinkle.template import Template
from twinkle_agentic.envs import Env, StepResult


class ScriptedSampler:
    """Replies with ``script[turn]`` (text) to every prompt in call ``turn``; or, with a list of
    lists, ``script[row][turn]`` per row of the first call's order. Each reply ends with the
    end-of-turn token, its log-probs are ``-0.1 * (position + 1)``. Records the prompts."""

    def __init__(self, template: Template, script: list[Any]):
        self.template, self.script, self.calls = template, script, []
        self.replies: list[list[int]] = []  # every reply's tokens, in order

    def sample(self, rows: list[dict[str, Any]], params: Any) -> list[SampleResponse]:
        turn = len(self.calls)
        self.calls.append([list(r["input_ids"]) for r in rows])
        out = []
        for i, _ in enumerate(rows):
            text = self.script[turn] if isinstance(self.script[turn], str) else self.script[turn][i]
            tokens = self.template.tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens = tokens + [self.template.tokenizer.eos_token_id]
            self.replies.append(tokens)
            logprobs = [[(t, -0.1 * (k + 1))] for k, t in enumerate(tokens)]
            out.append(SampleResponse([SampledSequence(tokens, logprobs, text, "stop")]))
        return out


class CountingEnv(Env):
    """Each step adds the call's ``n`` to a total and answers ``total=T``; done once the total
    reaches ``goal`` (None: never), with reward 1 then."""

    def __init__(self, goal: int | None = 3):
        self.goal, self.total = goal, 0

    def reset(self, trajectory: Any = None, seed: int | None = None) -> StepResult:
        self.total = 0
        return StepResult(f"start {seed}")

    def step(self, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        self.total += int(arguments["n"])
        done = self.goal is not None and self.total >= self.goal
        return StepResult(f"total={self.total}", reward=1.0 if done else 0.0, done=done)

    def tools(self) -> list[dict[str, Any]]:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        return [
            {"type": "function", "function": {"name": "add", "description": "add n", "parameters": schema}}
        ]


def call(name: str, **arguments: Any) -> str:
    """A reply that calls ``name`` in the hermes format."""
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
