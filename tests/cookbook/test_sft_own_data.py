"""``cookbook/transformers/sft_own_data.py`` trains on a messages JSONL and an Alpaca JSONL."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle.preprocessor import AlpacaProcessor
from twinkle.utils.errors import UserError

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "transformers" / "sft_own_data.py"
ROWS = [
    ("Who are you?", "I am Pip, a small assistant."),
    ("What is 2 + 2?", "4."),
    ("Name a colour.", "Blue."),
] * 4


def test_alpaca_rows_become_messages():
    row = {"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "Be brief."}
    assert AlpacaProcessor().preprocess(row) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Translate.\n\nbonjour"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    assert AlpacaProcessor().preprocess({"instruction": "Hi", "input": "", "output": "Hello"})["messages"][
        0
    ] == {
        "role": "user",
        "content": "Hi",
    }
    with pytest.raises(UserError, match="row 3 has no text field"):
        AlpacaProcessor()({"instruction": "Hi"}, 3)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("data_format", ["messages", "alpaca"])
def test_the_script_trains_on_own_rows(tiny_model_dir, tmp_path, data_format):
    if data_format == "messages":
        rows = [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in ROWS
        ]
    else:
        rows = [{"instruction": q, "input": "", "output": a} for q, a in ROWS]
    data = _write(tmp_path / "rows.jsonl", rows)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-id", str(tiny_model_dir), "--dataset-id", str(data),
         "--data-format", data_format, "--eval-samples", "4", "--eval-interval", "2", "--batch-size", "4",
         "--output-dir", str(tmp_path / "out"), "--lr", "1e-2", "--log-interval", "1"],
        capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "TWINKLE_CACHE": str(tmp_path / "c")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2 of 2" in done.stderr and "eval at step 2" in done.stderr
    assert (tmp_path / "out" / "last-checkpoint" / ".twinkle-complete").exists()


@pytest.mark.slow
def test_the_script_honours_max_steps_and_save_steps(tiny_model_dir, tmp_path):
    """8 rows in batches of 2 are 4 steps; --max-steps 3 stops after the third, --save-steps 2
    saves after the second, and the schedule's horizon ("of 3") and the last checkpoint end at step 3."""
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in ROWS
    ]
    data = _write(tmp_path / "rows.jsonl", rows[:8])
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-id", str(tiny_model_dir), "--dataset-id", str(data),
         "--batch-size", "2", "--max-steps", "3", "--save-steps", "2", "--max-grad-norm", "0.5",
         "--output-dir", str(out), "--log-interval", "1"],
        capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "TWINKLE_CACHE": str(tmp_path / "c")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 3 of 3" in done.stderr and "step 4 of" not in done.stderr
    assert "--max-steps 3: stopping after optimizer step 3" in done.stderr
    checkpoints = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert checkpoints == ["checkpoint-2", "last-checkpoint"]  # beside metrics.jsonl and the curves
    state = json.loads((out / "last-checkpoint" / "trainer_state.json").read_text())
    assert (state["optimizer_steps"], state["consumed_train_samples"]) == (3, 6)
