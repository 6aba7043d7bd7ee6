"""Checkpoints are data, never code: a pickle that would run a command, placed in any ``.pt``
file of a checkpoint with its checksum recomputed (the marker proves no authorship), is refused
in one line naming the file by every reader, or ignored by one that does not read it, and never
runs. A ``trainer_state.json`` cut short or hand-edited is one line too (``auto`` skips it).

One model saves the checkpoint (module fixture); each case poisons a copy."""

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from harness import run_script, trainable
from peft import LoraConfig
from torch.optim.lr_scheduler import LambdaLR

from twinkle.checkpoint import integrity, latest_checkpoint, read_trainer_state
from twinkle.checkpoint.layout import MARKER, TRAINER_STATE
from twinkle.cli.main import main as twinkle_main
from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError

PT_FILES = ("rank_state_rank0.pt", "scheduler.pt", "optimizer.pt")
REFUSED_PT = r"holds more than tensors and plain values: it calls posix\.system; Twinkle reads checkpoint files as data"
# name -> (trainer_state.json text, what the one line says)
BAD_STATES = {
    "cut-short": ('{"cur_step": 3, "optimizer_steps"', r"is not valid JSON \(.+\)"),
    "cur-step-null": (
        None,
        r"is not a trainer state Twinkle writes \('cur_step' is null, expected an integer",
    ),
    "a-list": ("[1, 2, 3]", r"is not a trainer state Twinkle writes \(it is not a JSON object\)"),
    "code-as-text": (
        "__import__('os').system('touch {pwned}')",
        r"is not a trainer state Twinkle writes \('cur_step' is \"__import__",
    ),
    "not-utf8": (b"\xff\xfe{}", r"is not valid JSON"),
}


class RunsACommand:
    """Unpickling this calls ``os.system``: what a malicious checkpoint file would hold."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (self.command,))


def reseal(folder: Path) -> None:
    """Recompute the completion marker, as anyone who edits a checkpoint can."""
    (folder / MARKER).write_text(integrity.marker_text(folder))


def poison_pt(folder: Path, name: str, pwned: Path) -> None:
    """Keep the file's own state and slip the command into it, then reseal the folder."""
    torch.save({"state": {"rng": RunsACommand(f"touch {pwned}")}, "param_groups": []}, folder / name)
    reseal(folder)


def write_state(folder: Path, case: str, pwned: Path) -> None:
    text, _ = BAD_STATES[case]
    path = folder / TRAINER_STATE
    if text is None:  # the saved state with one field nulled
        state = json.loads(path.read_text())
        state["cur_step"] = None
        text = json.dumps(state)
    elif case == "code-as-text":
        state = json.loads(path.read_text())
        state["cur_step"] = text.format(pwned=pwned)
        text = json.dumps(state)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    reseal(folder)


def new_model(model_dir: Path, r: int = 4) -> TransformersModel:
    """A model with adapter ``default``, AdamW and a warm-up schedule; the same each time."""
    model = TransformersModel(str(model_dir))
    torch.manual_seed(0)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0)
    model.add_adapter_to_model("default", config)
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("LinearWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    return model


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory) -> Path:
    """A checkpoint whose adapter differs from a fresh model's (so a load that replaced the
    weights shows)."""
    model = new_model(tiny_model_dir)
    with torch.no_grad():
        for p in model.model.parameters():
            if p.requires_grad:
                p.add_(0.5)
    return model.save("checkpoint-2", output_dir=str(tmp_path_factory.mktemp("saved")))


@pytest.fixture
def pwned(tmp_path) -> Path:
    """The file the poisoned pickles would create; each test checks that it does not exist."""
    return tmp_path / "pwned"


def copy_of(saved: Path, to: Path) -> Path:
    shutil.copytree(saved, to)
    return to


def assert_one_line(exc: pytest.ExceptionInfo, file: Path, pattern: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    assert re.match(rf"{re.escape(str(file))} {pattern}", message), message


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("name", PT_FILES)
def test_explicit_resume_runs_nothing_and_refuses_in_one_line(name, saved, tmp_path, pwned, tiny_model_dir):
    folder = copy_of(saved, tmp_path / "checkpoint-2")
    poison_pt(folder, name, pwned)
    before_files = snapshot(folder)
    model = new_model(tiny_model_dir)
    before = trainable(model)
    with pytest.raises(UserError) as exc:
        model.resume_from_checkpoint(str(folder))
    assert not pwned.exists()
    assert_one_line(exc, folder / name, REFUSED_PT)
    after = trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # refused before the weights changed
    assert snapshot(folder) == before_files


# name -> (file, plain data that is not what a save writes, what the one line says)
WRONG_DATA = {
    "rng-not-a-dict": (
        "rank_state_rank0.pt",
        {"rng": "x", "grads": {}},
        r"is not the rank state a Twinkle save",
    ),
    "grad-of-no-parameter": (
        "rank_state_rank0.pt",
        {"rng": {}, "grads": {"nowhere.weight": torch.zeros(1)}},
        r"is not the rank state \(gradients of this model's parameters\)",
    ),
    "schedule-replaces-its-optimizer": (
        "scheduler.pt",
        {"optimizer": {}},
        r"does not fit this run's LR schedule \('optimizer' would replace the schedule's own optimizer\)",
    ),
    "schedule-step-as-text": (
        "scheduler.pt",
        {"last_epoch": "ten"},
        r"does not fit this run's LR schedule \('last_epoch' is a str, not a int\)",
    ),
    "optimizer-of-another-model": (
        "optimizer.pt",
        {"state": {}, "param_groups": [{"params": [0]}]},
        r"does not fit this run's optimizer \(",
    ),
    "a-bare-tensor": ("optimizer.pt", torch.zeros(2), r"is not the optimizer a Twinkle save writes"),
}


@pytest.mark.parametrize("case", list(WRONG_DATA))
def test_plain_data_of_the_wrong_shape_is_one_line(case, saved, tmp_path, tiny_model_dir):
    name, data, pattern = WRONG_DATA[case]
    folder = copy_of(saved, tmp_path / "checkpoint-2")
    torch.save(data, folder / name)
    reseal(folder)
    model = new_model(tiny_model_dir)
    before = trainable(model)
    with pytest.raises(UserError) as exc:
        model.resume_from_checkpoint(str(folder))
    assert_one_line(exc, folder / name, pattern)
    after = trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


class CallableFactor:
    """An ``lr_lambda`` object: LambdaLR saves its attributes, here a function (code)."""

    def __init__(self) -> None:
        self.shape = math.cos

    def __call__(self, step: int) -> float:
        return 1.0


def test_a_schedule_whose_state_is_not_data_is_refused_before_the_save(tiny_model_dir, tmp_path):
    model = new_model(tiny_model_dir)
    model.set_lr_scheduler(lambda optimizer: LambdaLR(optimizer, CallableFactor()), num_training_steps=10)
    with pytest.raises(UserError) as exc:
        model.save("ck", output_dir=str(tmp_path / "out"))
    assert re.fullmatch(
        r"cannot save scheduler.pt: the LR schedule state holds state\['lr_lambdas'\]\[0\]\['shape'\] "
        r"\(builtins.builtin_function_or_method\), which does not load as data .*",
        str(exc.value),
    ), str(exc.value)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_model_load_with_the_optimizer_runs_nothing(name, saved, tmp_path, pwned, tiny_model_dir):
    folder = copy_of(saved, tmp_path / "ck")
    poison_pt(folder, name, pwned)
    model = new_model(tiny_model_dir)
    before = trainable(model)
    with pytest.raises(UserError) as exc:
        model.load(str(folder), load_optimizer=True)
    assert not pwned.exists()
    assert_one_line(exc, folder / name, REFUSED_PT)
    after = trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_model_load_of_the_adapter_never_reads_the_other_files(saved, tmp_path, pwned, tiny_model_dir):
    folder = copy_of(saved, tmp_path / "ck")
    for name in PT_FILES:
        poison_pt(folder, name, pwned)
    model = new_model(tiny_model_dir)
    before = trainable(model)
    model.load(str(folder))
    assert not pwned.exists()
    after = trainable(model)
    assert all(torch.equal(after[n], before[n] + 0.5) for n in before)  # the saved adapter, loaded


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_a_bad_trainer_state_is_one_line_for_resume_and_verify(
    case, saved, tmp_path, pwned, tiny_model_dir, capsys
):
    folder = copy_of(saved, tmp_path / "checkpoint-2")
    write_state(folder, case, pwned)
    pattern = BAD_STATES[case][1]
    with pytest.raises(UserError) as exc:
        read_trainer_state(folder)
    assert_one_line(exc, folder / TRAINER_STATE, pattern)
    with pytest.raises(UserError) as exc:
        new_model(tiny_model_dir).resume_from_checkpoint(str(folder))
    assert_one_line(exc, folder / TRAINER_STATE, pattern)
    capsys.readouterr()
    assert twinkle_main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"{re.escape(str(folder))}: {TRAINER_STATE} {pattern}", lines[0]), (
        lines
    )
    assert not pwned.exists()


def test_auto_skips_a_bad_trainer_state_and_resumes_from_the_previous(saved, tmp_path, pwned, tiny_model_dir):
    out = tmp_path / "out"
    good = copy_of(saved, out / "checkpoint-1")
    state = json.loads((good / TRAINER_STATE).read_text())
    (good / TRAINER_STATE).write_text(json.dumps({**state, "cur_step": 1}))
    reseal(good)
    for case in ("cur-step-null", "a-list"):  # newer by name and by marker time, never chosen
        write_state(copy_of(saved, out / f"checkpoint-{case}"), case, pwned)
    assert latest_checkpoint(out) == good
    assert new_model(tiny_model_dir).resume_from_checkpoint(str(good))["cur_step"] == 1
    shutil.rmtree(good)
    with pytest.raises(UserError, match=r"^every complete checkpoint under .* is damaged"):
        latest_checkpoint(out)
    assert not pwned.exists()


@pytest.mark.parametrize("name", PT_FILES)
def test_auto_then_resume_runs_nothing(name, saved, tmp_path, pwned, tiny_model_dir):
    out = tmp_path / "out"
    folder = copy_of(saved, out / "checkpoint-2")
    poison_pt(folder, name, pwned)
    found = latest_checkpoint(out)  # chosen: its checksums pass; it is refused when read
    assert found == folder
    with pytest.raises(UserError) as exc:
        new_model(tiny_model_dir).resume_from_checkpoint(str(found))
    assert_one_line(exc, folder / name, REFUSED_PT)
    assert not pwned.exists()


@pytest.mark.parametrize("name", PT_FILES)
def test_verify_names_the_file_and_runs_nothing(name, saved, tmp_path, pwned, capsys):
    folder = copy_of(saved, tmp_path / "ck")
    poison_pt(folder, name, pwned)
    capsys.readouterr()
    assert twinkle_main(["verify", str(folder)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{folder}: {name} holds more than tensors"), lines
    assert re.search(REFUSED_PT, lines[0]), lines
    assert not pwned.exists()


@pytest.fixture(scope="module")
def poisoned(saved, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of ``saved`` with every ``.pt`` file poisoned, and the file they would create."""
    work = tmp_path_factory.mktemp("poisoned")
    folder, pwned = copy_of(saved, work / "checkpoint-2"), work / "pwned"
    for name in PT_FILES:
        poison_pt(folder, name, pwned)
    return folder, pwned


def test_eval_export_and_chat_read_only_the_adapter(poisoned, tiny_model_dir, tmp_path, capsys):
    folder, pwned = poisoned
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"query": "Who are you?", "response": "I am {{NAME}}."}\n' * 2)
    assert (
        twinkle_main(["eval", "--adapter", str(folder), "--dataset-id", str(rows), "--eval-samples", "2"])
        == 0
    )
    assert twinkle_main(["export", "--adapter", str(folder), "--output", str(tmp_path / "merged")]) == 0
    chat = ["chat", "--model-id", str(tiny_model_dir), "--adapter", str(folder)]
    assert twinkle_main([*chat, "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert not pwned.exists()
    assert (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_refuse_a_bad_trainer_state_in_one_line(command, saved, tmp_path, pwned, capsys):
    folder = copy_of(saved, tmp_path / "ck")
    write_state(folder, "cur-step-null", pwned)
    capsys.readouterr()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"query": "Who are you?", "response": "I am {{NAME}}."}\n' * 2)
    flags = ["--output", str(tmp_path / "merged")] if command == "export" else ["--dataset-id", str(rows)]
    assert twinkle_main([command, "--adapter", str(folder), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: {folder / TRAINER_STATE} is not a trainer state"), err
    assert not (tmp_path / "merged").exists()


# ------------------------------------------------ the contract script and the twinkle command
FAST = ("--train-samples", "4", "--batch-size", "4", "--eval-samples", "4", "--eval-interval", "100")


def last_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    return last


@pytest.mark.slow
def test_the_script_resuming_auto_runs_nothing(tiny_model_dir, tmp_path):
    """The verbatim contract script: ``auto`` picks the poisoned ``last-checkpoint`` (it passes its
    checksums) and refuses it in one line; a cut-short trainer state is skipped, and with
    nothing else left the run refuses rather than start afresh over it."""
    out, pwned, rows = tmp_path / "out", tmp_path / "pwned", tmp_path / "rows.jsonl"
    rows.write_text('{"query": "Who are you?", "response": "I am {{NAME}}."}\n' * 4)
    flags = (*FAST, "--dataset-id", str(rows))
    first = run_script(tmp_path, tiny_model_dir, out, *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    folder = out / "last-checkpoint"
    poison_pt(folder, "rank_state_rank0.pt", pwned)
    files = snapshot(folder)
    result = run_script(tmp_path, tiny_model_dir, out, *flags, "--resume-from-checkpoint", "auto")
    line = last_error(result)
    assert re.fullmatch(rf"error: {re.escape(str(folder / 'rank_state_rank0.pt'))} {REFUSED_PT}.*", line), (
        line
    )
    assert snapshot(folder) == files and not pwned.exists()

    write_state(folder, "cut-short", pwned)
    result = run_script(tmp_path, tiny_model_dir, out, *flags, "--resume-from-checkpoint", "auto")
    assert re.match(r"error: every complete checkpoint under .* is damaged", last_error(result))
    assert f"skipping checkpoint {folder}: {TRAINER_STATE} is damaged" not in result.stderr  # resealed
    assert f"skipping checkpoint {folder}: {TRAINER_STATE} is not valid JSON (" in result.stderr
    assert not pwned.exists()
