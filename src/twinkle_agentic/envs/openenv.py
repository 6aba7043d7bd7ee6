"""``OpenEnv``: an environment that speaks OpenEnv's protocol, as an ``Env``.

- ``OpenEnv(base_url="http://127.0.0.1:8000")``: an OpenEnv server over HTTP (``POST /reset``,
  ``POST /step`` with ``{"action": {...}}``, answers ``{"observation", "reward", "done"}``). A
  server that does not answer is one line when the environment is built, not a hang later.
- ``OpenEnv(env_cls=..., env_kwargs=...)``: an OpenEnv-style class in this process (its
  ``reset()``/``step(action)`` return such results as dicts or objects).

``action_mapper(tool_name, arguments) -> action dict`` turns a tool call into the environment's
action (default: the arguments as they are); ``action_cls`` builds an action object from it."""

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.envs.base import Environment, StepResult
from twinkle_agentic.envs.pool import resolve_env_class


def _text(observation: Any) -> str:
    """An observation as the text the model reads."""
    if observation is None:
        return ""
    if isinstance(observation, str):
        return observation
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump()
    elif hasattr(observation, "__dict__") and not isinstance(observation, dict):
        observation = vars(observation)
    if isinstance(observation, dict):
        for key in ("text", "message", "content", "result", "output", "info_state_text"):
            if isinstance(observation.get(key), str):
                return observation[key]
        return json.dumps(observation, ensure_ascii=False, default=str)
    return str(observation)


def _field(value: Any, key: str) -> Any:
    if value is None or isinstance(value, str):
        return None
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


def _result(raw: Any) -> StepResult:
    """A reset's or step's answer (a dict or an object) as a ``StepResult``; OpenEnv's
    observations may carry ``reward`` and ``done`` themselves."""
    wrapped = (isinstance(raw, dict) and "observation" in raw) or hasattr(raw, "observation")
    observation = _field(raw, "observation") if wrapped else raw
    reward = _field(raw, "reward") if wrapped else None
    done = _field(raw, "done") if wrapped else None
    reward = _field(observation, "reward") if reward is None else reward
    done = _field(observation, "done") if done is None else done
    return StepResult(_text(observation), float(reward or 0.0), bool(done))


class OpenEnv(Environment):
    """See the module docstring. ``timeout``: seconds an HTTP request may take."""

    def __init__(
        self,
        env_name: str | None = None,
        env_cls: Any = None,
        env_kwargs: dict[str, Any] | None = None,
        action_cls: Any = None,
        action_mapper: Callable[[str, dict[str, Any]], Any] | None = None,
        base_url: str | None = None,
        timeout: float = 30.0,
    ):
        if env_name is not None:
            raise UserError(
                f"OpenEnv(env_name={env_name!r}): not supported yet: discovering an installed OpenEnv "
                "package; pass env_cls='package.module:Class', or base_url= of its running server"
            )
        if (env_cls is None) == (base_url is None):
            raise UserError(
                "OpenEnv: pass env_cls= (in this process) or base_url= (an OpenEnv server), one of them"
            )
        self.action_mapper, self.timeout = action_mapper, timeout
        self.action_cls = resolve_env_class(action_cls) if action_cls is not None else None
        self.base_url = base_url.rstrip("/") if base_url else None
        self._env = None if base_url else resolve_env_class(env_cls)(**(env_kwargs or {}))
        if self.base_url:
            self._post("/health", None, method="GET", probe=True)

    def _post(self, path: str, body: Any, method: str = "POST", probe: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            if probe:  # a server without /health still answered: it is there
                return None
            raise UserError(f"OpenEnv {self.base_url}{path}: HTTP {exc.code} {exc.reason}") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UserError(
                f"OpenEnv {self.base_url}: no environment server answers ({reason}); start it, "
                "or use an in-process environment (env_cls=)"
            ) from exc
        return json.loads(text) if text.strip() else {}

    def _action(self, tool_name: str, arguments: dict[str, Any]) -> Any:
        action = self.action_mapper(tool_name, arguments) if self.action_mapper else dict(arguments)
        if self.action_cls is not None and isinstance(action, dict) and self._env is not None:
            return self.action_cls(**action)
        return action

    def reset(self, trajectory: Any = None, seed: int | None = None) -> StepResult:
        if self._env is None:
            return _result(self._post("/reset", {} if seed is None else {"seed": seed}))
        reset = self._env.reset
        try:
            raw = reset(seed=seed) if seed is not None else reset()
        except TypeError:  # an environment without a seed keyword
            raw = reset()
        return _result(raw)

    def step(self, tool_name: str, arguments: dict[str, Any] | None = None) -> StepResult:
        action = self._action(tool_name, arguments or {})
        if self._env is None:
            return _result(self._post("/step", {"action": action}))
        return _result(self._env.step(action))

    def close(self) -> None:
        if self._env is not None and hasattr(self._env, "close"):
            self._env.close()
