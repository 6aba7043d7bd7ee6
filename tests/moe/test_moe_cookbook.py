"""``cookbook/rl/moe_routing_replay.py``: GRPO steps on a tiny Qwen3-MoE, the sampler's routes
replayed in training, each step logging how many routes the update moved."""

import re
from pathlib import Path

import warm
from harness import script_env

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "rl" / "moe_routing_replay.py"


def test_two_steps_replay_the_sampled_routes(tmp_path, qwen3_moe_dir):
    flags = [
        "--model-id",
        str(qwen3_moe_dir),
        "--max-steps",
        "2",
        "--num-generations",
        "2",
        "--max-tokens",
        "4",
    ]
    result = warm.run([str(SCRIPT), *flags], cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = re.findall(
        r"step (\d)/2: loss=\S+ reward=\S+ route_drift=([0-9.]+) \(routes replayed: (\d+)", result.stderr
    )
    assert [s[0] for s in steps] == ["1", "2"], result.stderr[-2000:]
    assert all(0.0 <= float(drift) <= 1.0 and int(tokens) > 0 for _, drift, tokens in steps)
