"""``cookbook/rl/multi_turn_grpo_client.py`` on the tiny model: the script starts its own
``twinkle server`` (a child process), plays the episodes through ``ClientMultiTurnRollout``, trains
with the server's ``GRPOLoss``, and stops the server at the end. The tokens the server trained on
are exactly the tokens the model generated (tool results and the template's tokens between turns
carry no labels), its log-probs of them are the ones the sampler returned, and the child server is
gone once the script has exited."""

import json
import re
import shutil
from pathlib import Path

import pytest
import warm
from harness import script_env

pytest.importorskip("fastapi")
pytest.importorskip("tinker")

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "rl" / "multi_turn_grpo_client.py"
STEP = re.compile(r"step (\d+)/2 .*generated_tokens=(\d+) trained_tokens=(\d+) logp_gap=(\S+)")
SERVING = re.compile(r"twinkle server \(pid (\d+)\) at http://127\.0\.0\.1:\d+,")


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


@pytest.mark.slow
def test_two_steps_over_a_child_server_train_only_generated_tokens(tmp_path, tiny_model_dir):
    # the tiny tokenizer spells the few-shot prompt in many more tokens than SmolLM2's: room for them
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "tiny")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    flags = ["--max-steps", "2", "--batch-size", "2", "--num-generations", "2", "--max-tokens", "6"]
    argv = [str(SCRIPT), "--model-id", str(model_dir), "--output-dir", str(tmp_path / "out"), *flags,
            "--eval-samples", "2", "--lora-r", "4"]  # fmt: skip
    env = {k: v for k, v in script_env(tmp_path).items() if k != "TWINKLE_SERVER_URL"}
    result = warm.run(argv, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "held-out greedy success: " in result.stderr
    steps = STEP.findall(result.stderr)
    assert [int(s[0]) for s in steps] == [1, 2], result.stderr[-4000:]
    for _, generated, trained, gap in steps:
        assert int(generated) > 0 and int(trained) == int(generated)
        # the server's log-probs of the trained tokens are the sampler's (same weights, fp32)
        assert float(gap) < 1e-3
    (pid,) = SERVING.findall(result.stderr)
    assert not alive(int(pid))
    assert list((tmp_path / "out" / "server").rglob("adapter_model.safetensors"))  # its checkpoints
