"""Twinkle never deletes or writes through what it did not create: ``twinkle export --overwrite``
replaces only an earlier export, a run file that is a link is refused (its target unchanged),
``--output-dir`` may not overlap a local ``--dataset-id``, and built folders follow the umask.

In ``tests/run`` because the one guarantee spans several packages: export, the metric writers
and the CLI's check of ``--output-dir``."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from export_models import checkpoint_fixture
from harness import assert_one_line_error, run_script

from twinkle.cli import CLI
from twinkle.cli.main import main
from twinkle.export.output import EXPORT_MARKER
from twinkle.metric.curves import draw_curves
from twinkle.metric.report import CURVES, JSONL, RUN_ARGS, RUN_FILES, RunReport, check_run_files
from twinkle.metric.sinks import SINK_FOLDERS, open_sinks
from twinkle.runtime import RunDefaults, output_lock
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import atomic_dir, atomic_write_text, open_no_follow

checkpoint = pytest.fixture(scope="module", name="checkpoint")(checkpoint_fixture)
FAST = ("--train-samples", "4", "--batch-size", "4", "--eval-samples", "4", "--eval-interval", "100")
OUTSIDE = "the user's own text\n"


def export(capsys, *argv: str) -> tuple[int, str]:
    """``twinkle export ARGV`` in this process: the exit status and its stderr."""
    capsys.readouterr()
    code = main(["export", *argv])
    return code, capsys.readouterr().err.strip()


def assert_refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# ---------------------------------------------------------------- twinkle export --overwrite
def test_overwrite_never_replaces_a_folder_of_user_files(checkpoint, tmp_path, capsys, monkeypatch):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "sub").mkdir()
    (mine / "sub" / "data.csv").write_text("1,2")
    before = tree(mine)
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", str(mine), "--overwrite")
    assert_refused(code, err, f"--output {mine} is not a folder twinkle export wrote", EXPORT_MARKER)
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", str(mine))
    assert_refused(code, err, "exists and is not empty", "choose an empty or new folder")
    monkeypatch.chdir(mine)  # the case: --output . in a folder of one's own files
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", ".", "--overwrite")
    assert_refused(code, err, "--output . is not a folder twinkle export wrote")
    assert tree(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no temporary sibling left


def test_overwrite_replaces_an_earlier_export_and_nothing_else(checkpoint, tmp_path, capsys, monkeypatch):
    out = tmp_path / "exported"
    assert export(capsys, "--adapter", str(checkpoint), "--output", str(out))[0] == 0
    record = json.loads((out / EXPORT_MARKER).read_text())
    assert record["written_by"] == "twinkle export" and record["checkpoint"] == str(checkpoint)
    assert set(record["files"]) == set(tree(out)) - {EXPORT_MARKER}
    assert "config.json" in record["files"]
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", str(out))
    assert_refused(code, err, "an earlier export", "--overwrite")
    (out / "config.json").write_text("{}")  # a file the export wrote: replaced
    assert export(capsys, "--adapter", str(checkpoint), "--output", str(out), "--overwrite")[0] == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    (out / "my-notes.md").write_text("keep me")  # a file of the user's: the folder is refused
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", str(out), "--overwrite")
    assert_refused(code, err, "holds files twinkle export did not write (my-notes.md)")
    assert (out / "my-notes.md").read_text() == "keep me"
    (out / "my-notes.md").unlink()
    monkeypatch.chdir(out)  # an export the shell is in is not swapped away under it
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", ".", "--overwrite")
    assert_refused(code, err, "is the current folder or holds it")
    assert (out / EXPORT_MARKER).is_file()


def test_a_linked_output_is_refused_and_an_empty_folder_is_written(checkpoint, tmp_path, capsys):
    target = tmp_path / "target"
    assert export(capsys, "--adapter", str(checkpoint), "--output", str(target))[0] == 0
    before = tree(target)
    link = tmp_path / "link"
    link.symlink_to(target)
    code, err = export(capsys, "--adapter", str(checkpoint), "--output", str(link), "--overwrite")
    assert_refused(code, err, f"--output {link} is a symbolic link")
    assert link.is_symlink() and tree(target) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export(capsys, "--adapter", str(checkpoint), "--output", str(empty))[0] == 0
    assert (empty / EXPORT_MARKER).is_file()


def test_exported_folder_follows_the_umask(checkpoint, tmp_path, capsys, umask_022):
    out = tmp_path / "exported"
    assert export(capsys, "--adapter", str(checkpoint), "--output", str(out), "--gguf")[0] == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "gguf").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o644
    os.umask(0o027)  # another umask, another mode: it is followed, not fixed
    with atomic_dir(tmp_path / "built") as tmp:
        atomic_write_text(tmp / "file.txt", "x")
    assert stat.S_IMODE((tmp_path / "built").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "built" / "file.txt").stat().st_mode) == 0o640


# ---------------------------------------------------------------- run files and links
def outside_file(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(OUTSIDE)
    return path


@pytest.mark.parametrize("name", [*RUN_FILES, *SINK_FOLDERS])
def test_a_linked_run_file_is_refused_before_training(name, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    precious = outside_file(tmp_path)
    (out / name).symlink_to(precious if "." in name else precious.parent)
    with pytest.raises(UserError, match=rf"--output-dir .*{name} is a symbolic link .*remove the link"):
        CLI.from_args(["--output-dir", str(out)], env={})
    assert precious.read_text() == OUTSIDE and sorted(p.name for p in precious.parent.iterdir()) == [
        "precious.txt"
    ]


def test_a_hard_linked_or_odd_run_file_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    precious = outside_file(tmp_path)
    os.link(precious, out / JSONL)
    with pytest.raises(UserError, match="has other hard links"):
        check_run_files(out)
    with pytest.raises(UserError, match="has other hard links"):
        open_no_follow(out / JSONL)
    assert precious.read_text() == OUTSIDE
    (out / JSONL).unlink()
    (out / JSONL).mkdir()
    with pytest.raises(UserError, match="is not a regular file"):
        check_run_files(out)
    with pytest.raises(UserError, match="is not a regular file"):
        open_no_follow(out / JSONL)
    os.mkfifo(out / RUN_ARGS)  # no reader: a plain open would wait for one forever
    with pytest.raises(UserError, match="is not a regular file"):
        open_no_follow(out / RUN_ARGS)


def test_the_writers_never_write_through_a_link(tmp_path):
    """A link made after the start-up check (or by a run the CLI did not parse) is refused by the
    writers themselves, and what it points to is unchanged."""
    out = tmp_path / "out"
    out.mkdir()
    precious = outside_file(tmp_path)
    (out / JSONL).symlink_to(precious)
    defaults = RunDefaults(output_dir=str(out), report_to=(), run_args={"a": 1})
    report = RunReport(defaults, torch.device("cpu"))
    with pytest.raises(UserError, match=f"{JSONL} is a symbolic link"):
        report.on_metrics({"loss": 1.0}, True, 1)
    report.finish()
    (out / JSONL).unlink()
    (out / RUN_ARGS).symlink_to(precious)
    report = RunReport(defaults, torch.device("cpu"))
    with pytest.raises(UserError, match=f"{RUN_ARGS} is a symbolic link"):
        report.on_metrics({"loss": 1.0}, True, 1)
    report.finish()
    (out / JSONL).unlink()
    (out / JSONL).write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
    (out / CURVES).symlink_to(precious)
    with pytest.raises(UserError, match=f"{CURVES} is a symbolic link"):
        draw_curves(out / JSONL, out / CURVES)
    (out / "tensorboard").symlink_to(precious.parent)
    with pytest.raises(UserError, match="tensorboard is a symbolic link"):
        open_sinks(("tensorboard",), out, {})
    (out / output_lock.LOCK_FILE).symlink_to(precious)
    with pytest.raises(UserError, match=r"\.twinkle\.lock is a symbolic link"):
        output_lock.acquire(out)
    assert precious.read_text() == OUTSIDE
    assert sorted(p.name for p in precious.parent.iterdir()) == ["precious.txt"]
    assert sorted(p.name for p in out.iterdir() if not p.is_symlink()) == [JSONL]
    assert not [p for p in out.iterdir() if p.name.startswith(f".{CURVES}")]  # no temporary picture


@pytest.mark.slow
def test_the_script_refuses_a_linked_metrics_file_in_one_line(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    out.mkdir()
    precious = outside_file(tmp_path)
    (out / JSONL).symlink_to(precious)
    result = run_script(tmp_path, tiny_model_dir, out, *FAST)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --output-dir") and f"{JSONL} is a symbolic link" in last, last
    assert precious.read_text() == OUTSIDE
    assert [p.name for p in out.iterdir()] == [JSONL] and (out / JSONL).is_symlink()


# ---------------------------------------------------------------- --output-dir and --dataset-id
def rows(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text(json.dumps({"query": "Who are you?", "response": "I am Twinkle."}) + "\n")
    return path


OVERLAPS = {
    # name -> (dataset, output dir), from the data folder d
    "equal": (lambda d: d, lambda d: d, "is the dataset"),
    "inside": (lambda d: d, lambda d: d / "out", "is inside the dataset"),
    "holds-the-folder": (lambda d: d, lambda d: d.parent, "holds the dataset"),
    "holds-the-file": (lambda d: d / "train.jsonl", lambda d: d, "holds the dataset"),
    "through-a-link": (lambda d: d.parent / "data-link", lambda d: d / "out", "is inside the dataset"),
}


@pytest.mark.parametrize("case", list(OVERLAPS))
def test_an_output_dir_overlapping_the_dataset_is_refused(case, tmp_path):
    data = tmp_path / "work" / "data"
    rows(data)
    (tmp_path / "work" / "data-link").symlink_to(data)
    dataset, output, how = OVERLAPS[case]
    argv = ["--dataset-id", str(dataset(data)), "--output-dir", str(output(data))]
    with pytest.raises(UserError) as caught:
        CLI.from_args(argv, env={})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"--output-dir {output(data)} overlaps --dataset-id {dataset(data)}"), message
    assert how in message and message.endswith("choose an output folder outside the dataset"), message
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl"]


def test_an_output_dir_beside_the_dataset_or_a_hub_id_is_fine(tmp_path, monkeypatch):
    data = tmp_path / "data"
    rows(data)
    args = CLI.from_args(["--dataset-id", str(data), "--output-dir", str(tmp_path / "out")], env={})
    assert args.training.output_dir == str(tmp_path / "out")
    monkeypatch.chdir(tmp_path)  # a name that is no local path is not checked against the output
    CLI.from_args(["--dataset-id", "hf://org/name", "--output-dir", "."], env={})
    CLI.from_args(["--output-dir", "."], env={})


@pytest.mark.slow
def test_the_script_refuses_the_overlap_in_one_line(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    rows(data)
    out = data / "out"
    result = run_script(tmp_path, tiny_model_dir, out, *FAST, "--dataset-id", str(data))
    assert_one_line_error(
        result, rf"--output-dir {out} overlaps --dataset-id {data} .*outside the dataset", out
    )
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl"]
