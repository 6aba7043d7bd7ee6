"""Helpers of the tests that run the contract script: run it in its own process, check that it
failed in one line, snapshot weights."""

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch
import warm

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "transformers" / "fsdp2.py"


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """One thread (two shared cores), a private cache, and no network for the hub clients."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TWINKLE_CACHE": str(tmp_path / "twinkle-cache"),
        "HF_HUB_OFFLINE": "1",
        **extra,
    }


def script_command(model_dir: Path, output_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--model-id",
        str(model_dir),
        "--output-dir",
        str(output_dir),
        *flags,
    ]


def run_script(tmp_path: Path, model_dir: Path, output_dir: Path, *flags: str, **env: str):
    """The script in its own process (forked from one with torch and peft imported: ``warm``)."""
    argv = script_command(model_dir, output_dir, *flags)[1:]
    return warm.run(argv, cwd=tmp_path, env=script_env(tmp_path, **env), timeout=300)


class Beside(threading.Thread):
    """``fn(*args)`` in a thread, started at once (a run beside another one: the tests share two
    cores and a run's imports and start-up use one); ``result()`` joins it and returns its value
    or raises its error."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.value, self.error = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # raised again in the test's thread
            self.error = exc

    def result(self, timeout: float = 600):
        self.join(timeout)
        assert not self.is_alive(), f"{self.fn.__name__} still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


def trainable(model) -> dict[str, torch.Tensor]:
    """Copies of the trainable (LoRA) weights of a ``TransformersModel``."""
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}


def no_checkpoint_written(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


def assert_one_line_error(result: subprocess.CompletedProcess, pattern: str, out: Path) -> str:
    """A non-zero exit whose last stderr line is ``error: ...`` matching ``pattern``, no
    traceback, and nothing left in ``out``; returns that line."""
    assert result.returncode != 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    assert re.search(pattern, last), last
    assert no_checkpoint_written(out), sorted(p.name for p in out.iterdir())
    return last
