"""Environments the model acts in through tool calls.

Public names: ``Env`` (also ``Environment``), ``StepResult``, ``EnvTool``, ``EnvPool``,
``EnvPoolAdapter``, ``OpenEnv``, ``OpenSpielEnv`` (needs ``twinkle[agentic]``), ``ArithmeticEnv``,
``answer_reward``, ``calculate``."""

from twinkle_agentic.envs.arithmetic import ArithmeticEnv, answer_reward, calculate
from twinkle_agentic.envs.base import Env, Environment, StepResult
from twinkle_agentic.envs.env_tool import EnvTool
from twinkle_agentic.envs.openenv import OpenEnv
from twinkle_agentic.envs.openspiel import OpenSpielEnv
from twinkle_agentic.envs.pool import EnvPool, EnvPoolAdapter

__all__ = [
    "Env",
    "Environment",
    "StepResult",
    "EnvTool",
    "EnvPool",
    "EnvPoolAdapter",
    "OpenEnv",
    "OpenSpielEnv",
    "ArithmeticEnv",
    "answer_reward",
    "calculate",
]
