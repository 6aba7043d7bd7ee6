"""Runs that cannot succeed end at once with one line: a run that learns nothing (no supervised
token, a NaN/inf eval loss, a diverged last step), a damaged ``run_args.json`` read by
``twinkle eval``, SIGTERM before the training loop, and Ctrl-C.

In ``tests/run`` because a run ends early from several packages: the model's health checks,
``twinkle eval``, and the runtime's signal handling."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import warm
from batches import padded_batches
from harness import run_script, script_command, script_env
from peft import LoraConfig

from twinkle.cli.evaluate import read_run_args
from twinkle.cli.main import main
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.model.health import NO_TOKEN_WINDOWS
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.runtime.preemption import BEFORE_LOOP_MESSAGE
from twinkle.utils.errors import UserError

QUESTIONS = ("Who are you?", "What is your name?", "Who made you?", "Introduce yourself.")
SIGNAL_TIMEOUT_S = 30  # from the signal to the exit: generous for two loaded cores, far below a hang
SHORT_RUN = ("--train-samples", "8", "--batch-size", "4", "--eval-samples", "4", "--log-interval", "1")


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    rows = [
        {"query": QUESTIONS[i % 4], "response": f"I am {{{{NAME}}}}, made by {{{{AUTHOR}}}}; answer {i}."}
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _batches(model_dir: Path, rows_file: Path, max_length: int, n: int) -> list[dict]:
    data = Dataset(DatasetMeta(str(rows_file), data_slice=range(2 * n)))
    data.set_template("Template", model_id=str(model_dir), max_length=max_length, truncation_strategy="left")
    data.map(SelfCognitionProcessor("Twinkle", "Acme"))
    data.encode()
    return list(padded_batches(data, batch_size=2, world_size=1, rank=0))


@pytest.fixture(scope="module")
def empty_batches(tiny_model_dir, rows_file) -> list[dict]:
    """Rows cut to their last token: the shifted labels hold no supervised token."""
    batches = _batches(tiny_model_dir, rows_file, 1, NO_TOKEN_WINDOWS)
    assert all(int((b["labels"][:, 1:] != -100).sum()) == 0 for b in batches)
    return batches


@pytest.fixture(scope="module")
def batches(tiny_model_dir, rows_file) -> list[dict]:
    return _batches(tiny_model_dir, rows_file, 128, 2)


def _poison_lora(model) -> None:
    with torch.no_grad():
        next(p for n, p in model.model.named_parameters() if "lora_B" in n).fill_(float("nan"))


# ---------------------------------------------------------------------- learning nothing, in process
def test_no_supervised_token_in_any_step_stops_at_the_end_of_the_data(make_model, empty_batches):
    model = make_model()
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=0, num_training_steps=2)
    model.forward_backward(inputs=empty_batches[0])
    assert not model.clip_grad_and_step()  # one empty window can be legitimate
    model.forward_backward(inputs=empty_batches[1])
    with pytest.raises(
        UserError, match=r"no supervised token in any of the 2 optimizer step\(s\).*--max-length"
    ):
        model.clip_grad_and_step()


def test_no_supervised_token_stops_a_long_run_after_a_few_steps(make_model, empty_batches, batches):
    model = make_model()  # no scheduler: the end of the data is unknown
    for batch in empty_batches[: NO_TOKEN_WINDOWS - 1]:
        model.forward_backward(inputs=batch)
        assert not model.clip_grad_and_step()
    model.forward_backward(inputs=empty_batches[NO_TOKEN_WINDOWS - 1])
    with pytest.raises(UserError, match=f"no supervised token in any of the {NO_TOKEN_WINDOWS} optimizer"):
        model.clip_grad_and_step()

    learned = make_model()  # once a step had tokens, empty windows later are only skipped
    learned.forward_backward(inputs=batches[0])
    assert learned.clip_grad_and_step()
    for batch in empty_batches:
        learned.forward_backward(inputs=batch)
        assert not learned.clip_grad_and_step()
    assert learned.calculate_metric(is_training=True)["skipped_steps"] == NO_TOKEN_WINDOWS


def test_a_nonfinite_eval_loss_stops_the_run(make_model, batches, empty_batches):
    model = make_model()
    model.forward_backward(inputs=batches[0])
    assert model.clip_grad_and_step()
    model.forward_only(inputs=batches[1])
    model.calculate_loss()
    assert model.calculate_metric(is_training=False)["loss"] < 1e3  # a finite eval passes
    model.forward_only(inputs=empty_batches[0])
    model.calculate_loss()
    with pytest.raises(UserError, match="eval at step 1 saw no supervised token in 2 rows"):
        model.calculate_metric(is_training=False)
    _poison_lora(model)
    model.forward_only(inputs=batches[1])
    model.calculate_loss()
    with pytest.raises(
        UserError, match=r"eval loss is nan at step 1: training diverged; lower --lr \(it is 0.01\)"
    ):
        model.calculate_metric(is_training=False)

    saved = make_model()  # evaluating an adapter that this process did not train
    _poison_lora(saved)
    saved.forward_only(inputs=batches[1])
    saved.calculate_loss()
    with pytest.raises(UserError, match="this adapter's weights give a NaN/inf loss"):
        saved.calculate_metric(is_training=False)


def test_a_nonfinite_last_step_stops_the_run(make_model, batches):
    model = make_model()
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=0, num_training_steps=2)
    model.forward_backward(inputs=batches[0])
    assert model.clip_grad_and_step()
    _poison_lora(model)
    model.forward_backward(inputs=batches[1])
    with pytest.raises(UserError, match=r"training diverged: the last step \(step 2\) had a NaN/inf loss"):
        model.clip_grad_and_step()


# ---------------------------------------------------------------------- learning nothing, the script
def _no_checkpoint(out: Path) -> bool:
    return not out.exists() or not [p.name for p in out.iterdir() if "checkpoint" in p.name]


def _last_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode not in (0, None), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_script_fails_when_truncation_leaves_no_supervised_token(tiny_model_dir, rows_file, tmp_path):
    out = tmp_path / "out"
    flags = (*SHORT_RUN, "--eval-interval", "100", "--max-length", "1", "--truncation-strategy", "left")
    result = run_script(tmp_path, tiny_model_dir, out, "--dataset-id", str(rows_file), *flags)
    assert re.fullmatch(
        r"error: no supervised token in any of the 2 optimizer step\(s\).*", _last_line(result)
    )
    assert _no_checkpoint(out)


@pytest.mark.slow
def test_the_script_fails_when_the_eval_loss_diverges(tiny_model_dir, rows_file, tmp_path):
    out = tmp_path / "out"
    flags = (*SHORT_RUN, "--eval-interval", "1", "--lr", "1e30")
    result = run_script(tmp_path, tiny_model_dir, out, "--dataset-id", str(rows_file), *flags)
    assert re.fullmatch(
        r"error: eval loss is (nan|inf|-inf) at step 1: training diverged; lower --lr.*", _last_line(result)
    )
    assert _no_checkpoint(out)


# ---------------------------------------------------------------------- run_args.json
@pytest.fixture(scope="module")
def saved_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A checkpoint folder as a run saves it (no run_args.json: the tests add one)."""
    model = TransformersModel(str(tiny_model_dir))
    model.add_adapter_to_model("default", LoraConfig(r=2, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    return Path(model.save("checkpoint-2", output_dir=str(tmp_path_factory.mktemp("saved"))))


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "is empty"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds a JSON list"),
        ('{"template": [1]}', "'template' is list"),
        ('{"template": {"max_length": "long"}}', "template.max_length is str"),
        ('{"training": {"batch_size": true}}', "training.batch_size is bool"),
        ('{"training": {"eval_samples": 0}}', "training.eval_samples is 0, not a positive count"),
        ('{"model": {"model_id": 7}}', "model.model_id is int"),
    ],
)
def test_twinkle_eval_names_a_damaged_run_args_file(saved_adapter, tmp_path, capsys, content, problem):
    folder = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(saved_adapter, folder)
    (tmp_path / "out" / "run_args.json").write_text(content)
    assert main(["eval", "--adapter", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'out' / 'run_args.json'}"), err
    assert problem in err[0] and "remove it and give the settings as flags" in err[0]


def test_run_args_keeps_the_settings_twinkle_eval_uses(tmp_path):
    path = tmp_path / "run_args.json"
    run = {"template": {"max_length": 64, "template_cls": "Template"}, "training": {"eval_samples": None}}
    path.write_text(json.dumps({**run, "extra": {"model_name": "N"}, "lora": {"lora_rank": 8}}))
    assert read_run_args(path) == {"max_length": 64, "template_cls": "Template", "model_name": "N"}


# ---------------------------------------------------------------------- SIGTERM and Ctrl-C
def _hold_fifo_open(fifo: Path, proc_alive, deadline: float) -> int:
    """Wait until a process opens ``fifo`` to read, then open its writing end and never write:
    the reader stays blocked in ``read``. Returns the writing end."""
    while time.monotonic() < deadline and proc_alive():
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        time.sleep(0.05)
    raise AssertionError("the script never opened the dataset")


def _reader_of(fifo: Path) -> int:
    """The pid of the process with ``fifo`` open (for reading: the test holds the writing end)."""
    for _ in range(200):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(fifo) for fd in fds):
                    return int(pid)
            except OSError:  # not ours, or it ended
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process holds {fifo}")


def _signal_while_blocked(tiny_model_dir: Path, tmp_path: Path, signum: int) -> subprocess.CompletedProcess:
    """The contract script with a dataset that never arrives (a FIFO nobody writes), sent
    ``signum`` while it is blocked reading it, before the training loop."""
    fifo, out = tmp_path / "stalled.jsonl", tmp_path / "out"
    os.mkfifo(fifo)
    result: dict = {}
    argv = script_command(tiny_model_dir, out, "--dataset-id", str(fifo))[1:]

    def run() -> None:
        result["done"] = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=240)

    runner = threading.Thread(target=run)
    runner.start()
    writer = _hold_fifo_open(fifo, runner.is_alive, time.monotonic() + 200)
    try:
        os.kill(_reader_of(fifo), signum)
        runner.join(timeout=SIGNAL_TIMEOUT_S)
        assert not runner.is_alive(), f"signal {signum} before the loop did not end the process"
    finally:
        os.close(writer)
        runner.join()
    done = result["done"]
    assert "Traceback" not in done.stderr and _no_checkpoint(out), done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_sigterm_before_the_training_loop_ends_the_process_at_once(tiny_model_dir, tmp_path):
    done = _signal_while_blocked(tiny_model_dir, tmp_path, signal.SIGTERM)
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]  # 143 in a shell
    assert done.stderr.strip().splitlines()[-1] == BEFORE_LOOP_MESSAGE


@pytest.mark.slow
def test_ctrl_c_in_the_script_prints_one_line(tiny_model_dir, tmp_path):
    done = _signal_while_blocked(tiny_model_dir, tmp_path, signal.SIGINT)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1] == "error: interrupted"


def _as_a_shell_starts_it() -> None:
    """SIGINT at its default and unblocked in the child, as a shell starts a command, whatever
    this test process inherited or was left with (both carry across fork and exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_a_cli_parsed_process_as_interrupted(tmp_path):
    """In a fresh interpreter (the exit status is Python's own): status 130 in a shell. The hook is
    one of the effects ``initialize()`` applies for a parsed command line."""
    code = (
        "import time, twinkle; from twinkle.cli import CLI; CLI.from_args(); twinkle.initialize(); "
        "print('ready', flush=True); time.sleep(120)"
    )
    command = [sys.executable, "-c", code, "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(
        command,
        env=script_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_a_shell_starts_it,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=SIGNAL_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGINT, err[-3000:]
    assert err == "error: interrupted\n"


def test_ctrl_c_in_the_twinkle_command_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(paths):
        raise KeyboardInterrupt

    monkeypatch.setattr("twinkle.cli.verify.verify_paths", interrupted)
    assert main(["verify", "anything"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
