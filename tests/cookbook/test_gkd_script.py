"""``cookbook/rl/gkd_on_policy.py``, ``gkd_off_policy.py`` and ``cookbook/embedding.py`` run to
the end on the tiny model with small flags and report their before/after numbers (the default
runs on the bundled model are recorded in docs/gkd.md)."""

import json
from pathlib import Path

import pytest
import warm
from harness import script_env

ROOT = Path(__file__).resolve().parents[2]


def run(script: Path, tiny_model_dir: Path, tmp_path: Path, *flags: str) -> dict:
    argv = [str(script), "--model-id", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"), *flags]
    done = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)  # its own process
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess loading two models: over 10 s
@pytest.mark.parametrize("script", ["gkd_on_policy.py", "gkd_off_policy.py"])
def test_gkd_cookbooks_run_and_report_the_held_out_divergence(script, tiny_model_dir, tmp_path):
    flags = ["--max-steps", "2", "--teacher-steps", "2", "--gkd-topk", "8", "--max-tokens", "4"]
    if script == "gkd_off_policy.py":
        flags = [f for f in flags if f not in ("--max-tokens", "4")] + [
            "--train-samples",
            "8",
            "--eval-samples",
            "4",
        ]
    out = run(ROOT / "cookbook" / "rl" / script, tiny_model_dir, tmp_path, *flags)
    assert out["divergence_before"] >= 0 and out["divergence_after"] >= 0
    if script == "gkd_off_policy.py":
        assert out["teacher_rows_scored"] <= 8  # each row scored once, however often it comes back


@pytest.mark.slow
def test_embedding_cookbook_runs_and_reports_held_out_retrieval(tiny_model_dir, tmp_path):
    out = run(ROOT / "cookbook" / "embedding.py", tiny_model_dir, tmp_path, "--max-steps", "2")
    assert 0 <= out["retrieval_accuracy_before"] <= 1 and 0 <= out["retrieval_accuracy_after"] <= 1
