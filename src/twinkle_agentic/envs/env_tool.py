"""``EnvTool``: an environment's step offered to the model as a tool."""

from typing import Any

from twinkle_agentic.envs.base import StepResult
from twinkle_agentic.tools.base import Tool, function_info


class EnvTool(Tool):
    """Calls of tool ``tool_name`` step ``env``. ``step`` returns the ``StepResult`` (the
    ``ToolManager`` reads its reward and ``done``); calling the tool returns the observation
    text, as upstream's. ``episode_reward`` sums the rewards since the last ``reset`` (or, where
    the environment reports it in ``info['episode_reward']``, that)."""

    def __init__(
        self,
        env: Any,
        tool_name: str = "env_action",
        description: str = "Execute an action in the environment.",
        parameters: dict[str, Any] | None = None,
    ):
        self._env = env
        self._tool_name = tool_name
        self._description = description
        self._parameters = parameters or {"type": "object", "properties": {}}
        self.last_result: StepResult | None = None
        self._total = 0.0

    def step(self, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        result = self._env.step(tool_name, arguments)
        self.last_result = result
        self._total += float(result.reward or 0.0)
        return result

    def __call__(self, tool_name: str, arguments: dict[str, Any]) -> str:
        return self.step(tool_name, arguments).observation

    def tool_info(self) -> dict[str, Any]:
        return function_info(self._tool_name, self._description, self._parameters)

    @property
    def done(self) -> bool:
        return bool(self.last_result and self.last_result.done)

    @property
    def episode_reward(self) -> float:
        if self.last_result is not None and "episode_reward" in self.last_result.info:
            return float(self.last_result.info["episode_reward"])
        return self._total

    @classmethod
    def from_env(cls, env: Any) -> list["EnvTool"]:
        """One tool per action the environment describes (``env.tools()``), or one generic
        ``env_action`` tool when it describes none. The tools share one environment."""
        infos = env.tools() if hasattr(env, "tools") else []
        if not infos:
            return [cls(env)]
        tools = []
        for info in infos:
            function = info.get("function", info)
            tools.append(
                cls(env, function["name"], function.get("description", ""), function.get("parameters"))
            )
        return tools
