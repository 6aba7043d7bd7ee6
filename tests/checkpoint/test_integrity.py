"""A checkpoint damaged after its save (truncated, a flipped bit, a file gone) is refused in one
line naming the file, before anything is read; ``auto`` falls back to the newest intact one;
``twinkle verify`` says the same by hand.

One run of the verbatim contract script writes the checkpoints (``checkpoint-1`` and
``last-checkpoint`` at step 2); each case damages a copy."""

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import assert_one_line_error, run_script, trainable

from twinkle.checkpoint import (
    check_checkpoint,
    complete_checkpoints,
    is_complete,
    load_checkpoint,
    read_trainer_state,
)
from twinkle.cli import CLI
from twinkle.cli.main import main as twinkle_main
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

FLAGS = (
    *("--train-samples", "8", "--batch-size", "4", "--eval-samples", "4"),
    *("--eval-interval", "1", "--lr", "1e-2"),
)
FIX = "resume from an earlier checkpoint or delete this one"


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory) -> Path:
    """The output dir of a 2-step contract run that evaluated (and saved) after every step."""
    work = tmp_path_factory.mktemp("trained")
    result = run_script(work, tiny_model_dir, work / "out", *FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert is_complete(work / "out" / "checkpoint-1") and is_complete(work / "out" / "last-checkpoint")
    return work / "out"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def verify_command(*paths: Path, capsys) -> tuple[int, list[str]]:
    """``twinkle verify PATH...`` in this process: its exit status and output lines."""
    code = twinkle_main(["verify", *map(str, paths)])
    return code, capsys.readouterr().out.strip().splitlines()


# name -> (file, damage, what the error says about it)
DAMAGE = {
    "truncated-adapter": ("adapter_model.safetensors", truncate, r"is damaged \(size \d+ of \d+ bytes\)"),
    "bit-flipped-optimizer": ("optimizer.pt", flip_a_bit, r"is damaged \(.*checksum mismatch\)"),
    "missing-scheduler": ("scheduler.pt", Path.unlink, r"is missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_in_the_script_and_in_verify(
    case, trained, tmp_path, tiny_model_dir, capsys
):
    name, damage, what = DAMAGE[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(trained / "last-checkpoint", folder)
    damage(folder / name)
    before = snapshot(folder)
    result = run_script(
        tmp_path, tiny_model_dir, tmp_path / "out", *FLAGS, "--resume-from-checkpoint", str(folder)
    )
    assert_one_line_error(result, rf"ckpt/{re.escape(name)} {what}: {FIX}$", tmp_path / "out")
    assert snapshot(folder) == before  # a refused checkpoint is left as it was

    code, lines = verify_command(folder, capsys=capsys)
    assert code == 1 and len(lines) == 1, lines
    assert re.fullmatch(rf"{re.escape(str(folder))}: {re.escape(name)} {what}", lines[0]), lines


@pytest.mark.slow
def test_auto_falls_back_to_the_newest_intact_checkpoint(trained, tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    damaged = [f for f in complete_checkpoints(out) if f.name != "checkpoint-1"]  # everything at step 2
    assert damaged and all(
        json.loads((f / "trainer_state.json").read_text())["cur_step"] == 2 for f in damaged
    )
    for folder in damaged:
        truncate(folder / "adapter_model.safetensors")
    result = run_script(tmp_path, tiny_model_dir, out, *FLAGS, "--resume-from-checkpoint", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stderr
    for folder in damaged:
        assert re.search(
            rf"skipping checkpoint \S*{folder.name}: adapter_model.safetensors is damaged \(size \d+ of \d+ bytes\)",
            log,
        ), log[-3000:]
    assert re.search(r"--resume-from-checkpoint auto: resuming from \S*/checkpoint-1\n", log), log[-3000:]
    assert re.search(r"resumed from \S*/checkpoint-1 at step 1", log), log[-3000:]
    assert check_checkpoint(out / "last-checkpoint").ok  # the run went on and saved an intact one


def test_auto_refuses_when_every_checkpoint_is_damaged(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained / "checkpoint-1", out / "checkpoint-1")
    flip_a_bit(out / "checkpoint-1" / "adapter_model.safetensors")
    with pytest.raises(UserError, match=r"every complete checkpoint under .*out is damaged"):
        CLI.from_args(["--output-dir", str(out), "--resume-from-checkpoint", "auto"], env={})


def test_the_marker_lists_every_file_with_its_size_and_checksum(trained):
    folder = trained / "last-checkpoint"
    marker = json.loads((folder / ".twinkle-complete").read_text())
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    del files[".twinkle-complete"]
    assert marker["files"].keys() == files.keys()
    assert {
        "adapter_model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rank_state_rank0.pt",
    } <= files.keys()
    for rel, entry in marker["files"].items():
        assert entry["size"] == files[rel].stat().st_size and re.fullmatch(r"[0-9a-f]{8}", entry["crc32"])
    report = check_checkpoint(folder)
    assert report.ok and report.verified and report.files == len(files)


def test_verify_checks_every_checkpoint_of_an_output_dir(trained, tmp_path, capsys):
    code, lines = verify_command(trained, capsys=capsys)
    assert code == 0, lines
    assert len(lines) == len(complete_checkpoints(trained)) and all(
        re.search(r": ok \(\d+ files, [\d.]+ MiB\)$", line) for line in lines
    ), lines

    out = tmp_path / "out"
    shutil.copytree(trained, out)
    (out / "last-checkpoint" / ".twinkle-complete").unlink()  # a save that did not finish
    (out / "checkpoint-1" / "rank_state_rank0.pt").unlink()
    (tmp_path / "empty").mkdir()
    code, lines = verify_command(out, tmp_path / "empty", tmp_path / "nowhere", capsys=capsys)
    assert code == 1
    text = "\n".join(lines)
    assert re.search(r"checkpoint-1: rank_state_rank0.pt is missing$", text, re.M), text
    assert re.search(
        r"last-checkpoint: incomplete \(no .twinkle-complete: its save was interrupted\)$", text, re.M
    )
    assert f"{tmp_path / 'empty'}: no checkpoint in this folder" in lines
    assert f"{tmp_path / 'nowhere'}: does not exist" in lines


@pytest.mark.slow
def test_the_twinkle_command_verifies(trained, tmp_path):
    """The installed console script: exit 0 on intact checkpoints, 1 with the damage named."""
    twinkle = str(Path(sys.executable).with_name("twinkle"))
    folder = tmp_path / "ckpt"
    shutil.copytree(trained / "checkpoint-1", folder)
    truncate(folder / "adapter_model.safetensors")
    result = subprocess.run(
        [twinkle, "verify", str(trained), str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.strip().splitlines()
    assert sum(": ok (" in line for line in lines) == len(complete_checkpoints(trained)), lines
    assert re.fullmatch(
        rf"{re.escape(str(folder))}: adapter_model.safetensors is damaged \(size \d+ of \d+ bytes\)",
        lines[-1],
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    handler = _Records()
    get_logger().addHandler(handler)
    yield handler.lines
    get_logger().removeHandler(handler)


def test_a_checkpoint_without_checksums_still_loads_and_says_so_once(
    make_model, tmp_path, warnings_logged, capsys
):
    path = make_model().save("ck", output_dir=str(tmp_path / "out"), adapter_name="default")
    (path / ".twinkle-complete").write_text("complete\n")  # the marker format without a file list
    truncate(path / "tokenizer.json")  # not checkable: the marker holds no sizes
    progress = make_model().resume_from_checkpoint(str(path), adapter_name="default")
    assert progress["cur_step"] == 0
    said = [line for line in warnings_logged if "without checksums" in line]
    assert said == [f"checkpoint {path} was saved without checksums; its files are read unverified"]
    code, lines = verify_command(path, capsys=capsys)
    assert code == 0 and lines == [
        f"{path}: ok, unverified (saved without checksums: only its completion marker was checked)"
    ]


def test_a_damaged_marker_is_named(make_model, tmp_path, capsys):
    path = make_model().save("ck", output_dir=str(tmp_path / "out"), adapter_name="default")
    (path / ".twinkle-complete").write_text('{"files": ')  # cut short
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}/.twinkle-complete is damaged .*: {FIX}$"):
        make_model().resume_from_checkpoint(str(path), adapter_name="default")
    code, lines = verify_command(path, capsys=capsys)
    assert code == 1 and lines == [f"{path}: .twinkle-complete is damaged (not the file list a save writes)"]


def test_a_damaged_file_fails_the_resume_before_the_weights_change(make_model, tmp_path):
    path = make_model().save("ck", output_dir=str(tmp_path / "out"), adapter_name="default")
    flip_a_bit(path / "optimizer.pt")
    model = make_model(r=4)
    torch.manual_seed(1)
    for p in model.model.parameters():
        if p.requires_grad:
            p.data.normal_()
    before = trainable(model)
    with pytest.raises(UserError, match=r"optimizer.pt is damaged"):
        model.resume_from_checkpoint(str(path), adapter_name="default")
    after = trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_every_reader_checks_the_whole_folder_first(make_model, tmp_path):
    """Also a file the reader would not read (a tokenizer file), and also a weights-only resume."""
    path = make_model().save("ck", output_dir=str(tmp_path / "out"), adapter_name="default")
    truncate(path / "tokenizer.json")
    for read in (
        lambda: read_trainer_state(path),
        lambda: make_model().resume_from_checkpoint(
            str(path), resume_only_model=True, adapter_name="default"
        ),
    ):
        with pytest.raises(UserError, match=rf"{re.escape(str(path))}/tokenizer.json is damaged \(size"):
            read()
    flip_a_bit(path / "optimizer.pt")  # the loader itself checks what it reads, whoever calls it
    model = make_model()
    group = model.optimizer_group["default"]
    with pytest.raises(UserError, match=r"optimizer.pt is damaged"):
        load_checkpoint(
            path, model=model.model, adapter_name="default", group=group, rank=0, only_model=False
        )
