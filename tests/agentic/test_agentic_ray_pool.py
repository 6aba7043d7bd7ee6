"""``EnvPool`` on Ray workers plays the same episodes as in-process for the same seed."""

import os

import pytest
from scripted import ScriptedSampler, call

from twinkle.data_format import SamplingParams
from twinkle_agentic.envs import ArithmeticEnv, EnvPool, EnvTool
from twinkle_agentic.rollout import MultiTurnRollout
from twinkle_agentic.tools import ToolManager

pytestmark = pytest.mark.cluster
pytest.importorskip("ray")


def play(pool: EnvPool, template, env_name: str) -> list[dict]:
    adapters = pool.get_adapters(pool.pool_size)
    starts = [a.reset() for a in adapters]
    managers = [ToolManager(EnvTool.from_env(a)) for a in adapters]
    script = (
        [call("calculator", expression="6 * 7"), "done"]
        if env_name == "arithmetic"
        else [call("play", action="hit"), call("play", action="hit"), call("play", action="stand"), "done"]
    )
    rollout = MultiTurnRollout(
        ScriptedSampler(template, script), template, sampling_params=SamplingParams(max_tokens=8)
    )
    prompts = [{"messages": [{"role": "user", "content": s.observation}]} for s in starts]
    return rollout(prompts, tool_manager=managers)


@pytest.fixture
def own_environment():
    """``ray.init`` in this process sets ``RAY_AUTH_MODE`` and friends in ``os.environ``; every
    later test's subprocess (a ``ray start`` cluster, a ``--mode ray`` job) would inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("env_name", ["arithmetic", "blackjack"])
def test_ray_workers_give_the_in_process_trajectories(template, env_name, own_environment):
    import ray

    if env_name == "blackjack":
        pytest.importorskip("pyspiel")
        env_cls, kwargs = "twinkle_agentic.envs.openspiel:OpenSpielEnv", {"game_name": "blackjack"}
    else:
        env_cls, kwargs = ArithmeticEnv, {}
    local = play(EnvPool(6, kwargs, env_cls, num_workers=0, seed=11), template, env_name)
    remote_pool = EnvPool(6, kwargs, env_cls, num_workers=2, seed=11)
    try:
        remote = play(remote_pool, template, env_name)
    finally:
        remote_pool.close()
        ray.shutdown()
    keys = ("input_ids", "labels", "reward", "turn_rewards", "stop_reason", "messages")
    assert [{k: r[k] for k in keys} for r in remote] == [{k: r[k] for k in keys} for r in local]
    assert len({str(r["messages"][1]) for r in local}) > 1  # the slots' episodes differ


@pytest.mark.slow
def test_the_cookbook_runs_its_environments_on_ray_workers(tmp_path, tiny_model_dir):
    import json
    import shutil
    from pathlib import Path

    import warm
    from harness import script_env

    script = Path(__file__).resolve().parents[2] / "cookbook" / "rl" / "multi_turn_grpo.py"
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "tiny")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    argv = [str(script), "--model-id", str(model_dir), "--output-dir", str(tmp_path / "out"), "--max-steps", "1",
            "--batch-size", "2", "--num-generations", "2", "--max-tokens", "4", "--eval-samples", "2"]  # fmt: skip
    env = {**script_env(tmp_path), "ENV_NUM_WORKERS": "2", "RAY_AUTH_MODE": "disabled"}
    result = warm.run(argv, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "held-out greedy success:" in result.stderr
