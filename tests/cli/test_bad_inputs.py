"""The bad-input matrix: every mistake gets one actionable line, and no checkpoint is written.

Most cases run the verbatim contract script in its own process (exit status != 0, the last line
of stderr is ``error: ...`` naming the problem, no traceback, nothing in ``--output-dir``), forked
from one that has imported torch and peft (``tests/assets/warm.py``: the same run, 10 s sooner). Cases
whose API error is already tested elsewhere are listed in ``docs/reliability.md`` with that test;
the ones here through the API are those a subprocess cannot reach (a disk that fills) or that had
no test yet."""

import errno
import json
import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import warm
from harness import assert_one_line_error, no_checkpoint_written, run_script, script_env
from safetensors.torch import load_file

from twinkle.checkpoint import check_output_dir
from twinkle.cli import CLI
from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError

ROW = {"query": "Who are you?", "response": "I am {{NAME}}."}
FAST = ("--train-samples", "4", "--batch-size", "4", "--eval-samples", "4", "--eval-interval", "100")


def _jsonl(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _below_a_file(tmp_path: Path) -> str:
    (tmp_path / "a-file").write_text("x")
    return str(tmp_path / "a-file" / "out")


# ---------------------------------------------------------------- the script, one case per run
# name -> (flags built from tmp_path, regex the error line must match, extra environment).
SCRIPT_CASES = {
    "flag-of-the-wrong-type": (
        lambda t: ["--batch-size", "four"],
        r"--batch-size: expected an integer, got 'four'",
        {},
    ),
    "unknown-template-lists-valid": (
        lambda t: ["--template-cls", "ChatML"],
        r"--template-cls: 'ChatML' is not one of Template, Qwen3_5Template",
        {},
    ),
    "nonexistent-model-path": (
        lambda t: ["--model-id", str(t / "no-such-model")],
        r"model path '.*no-such-model' does not exist; pass a folder with config.json",
        {},
    ),
    "hub-id-offline-without-cache": (
        lambda t: ["--dataset-id", "hf://nobody/nothing"],
        r"dataset 'hf://nobody/nothing' is not in the local cache .*HF_HUB_OFFLINE.*--dataset-id /path/to/data.jsonl",
        {"HF_HOME": "hf-home-empty"},
    ),
    "malformed-jsonl-line": (
        lambda t: [
            "--dataset-id",
            _jsonl(t, [json.dumps(ROW), json.dumps(ROW), '{"query": "x", "response"']),
        ],
        r"rows.jsonl:3: invalid JSON",
        {},
    ),
    "row-missing-response": (
        lambda t: ["--dataset-id", _jsonl(t, [json.dumps(ROW), json.dumps({"query": "hi"})])],
        r"row 1 has no text field\(s\) response \(it has query\); every row needs query, response",
        {},
    ),
    "sample-longer-than-max-length-under-raise": (
        lambda t: ["--max-length", "8", "--truncation-strategy", "raise"],
        r"sample 0 has \d+ tokens, more than --max-length 8; raise --max-length or pass --truncation-strategy",
        {},
    ),
    "fsdp-size-not-matching-processes": (
        lambda t: ["--fsdp-size", "2"],
        r"the device mesh has 2 rank\(s\) .* but this job has 1 process\(es\); launch with torchrun "
        r"--nproc_per_node 2 or change --fsdp-size/--dp-size",
        {},
    ),
    "output-dir-below-a-file": (
        lambda t: ["--output-dir", _below_a_file(t)],
        r"--output-dir .*a-file/out: .*a-file is a file, not a folder",
        {},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SCRIPT_CASES))
def test_script_reports_bad_input_in_one_line(case, tmp_path, tiny_model_dir):
    flags, pattern, env = SCRIPT_CASES[case]
    out = tmp_path / "out"
    extra = flags(tmp_path)
    if "--output-dir" in extra:
        out = Path(extra[extra.index("--output-dir") + 1])
    env = {k: str(tmp_path / v) if k == "HF_HOME" else v for k, v in env.items()}
    result = run_script(tmp_path, tiny_model_dir, tmp_path / "out", *FAST, *extra, **env)
    assert_one_line_error(result, pattern, out)
    assert no_checkpoint_written(tmp_path / "out")


@pytest.fixture(scope="module")
def saved_by_script(tiny_model_dir, tmp_path_factory) -> Path:
    """``last-checkpoint`` of a 1-step script run with the default LoRA rank 8."""
    work = tmp_path_factory.mktemp("saved")
    result = run_script(work, tiny_model_dir, work / "out", *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "out" / "last-checkpoint"


def _torn(source: Path, tmp_path: Path) -> Path:
    torn = tmp_path / "torn"
    shutil.copytree(source, torn)
    (torn / ".twinkle-complete").unlink()
    return torn


RESUME_CASES = {
    # name -> (checkpoint folder built from (saved, tmp_path), extra flags, regex)
    "missing-path": (
        lambda s, t: t / "nowhere",
        [],
        r"checkpoint .*nowhere does not exist; check --resume-from-checkpoint",
    ),
    "torn-checkpoint": (
        _torn,
        [],
        r"checkpoint .*torn is incomplete \(its save was interrupted\); resume from an earlier one",
    ),
    "different-lora-rank": (
        lambda s, t: s,
        ["--r", "4"],
        r"was trained with LoRA \{'r': 8, .*this run uses \{'r': 4, .*use the same LoRA flags",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_script_refuses_a_bad_resume(case, saved_by_script, tmp_path, tiny_model_dir):
    folder, flags, pattern = RESUME_CASES[case]
    before = {p.name: p.read_bytes() for p in saved_by_script.iterdir()}
    result = run_script(
        tmp_path,
        tiny_model_dir,
        tmp_path / "out",
        *FAST,
        *flags,
        "--resume-from-checkpoint",
        str(folder(saved_by_script, tmp_path)),
    )
    assert_one_line_error(result, pattern, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in saved_by_script.iterdir()} == before  # left untouched


# ---------------------------------------------------------------- through the API
def test_train_samples_zero_is_rejected_by_the_cli():
    with pytest.raises(UserError, match=r"--train-samples: must be >= 1, got 0"):
        CLI.from_args(["--train-samples", "0"], env={})


def test_output_dir_checked_before_training(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        CLI.from_args(["--output-dir", str(tmp_path / "a-file" / "deeper" / "out")], env={})
    check_output_dir(tmp_path / "new" / "deeper")  # missing folders below a writable one are fine
    assert not (tmp_path / "new").exists()  # the check creates nothing


def test_read_only_output_dir(tmp_path, monkeypatch):
    # As root (CI) chmod does not stop writes, so the permission answer is simulated.
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if str(path) == str(locked) else real_access(path, mode)
    )
    with pytest.raises(UserError, match="is not writable"):
        check_output_dir(locked / "out")


def test_model_save_below_a_file_is_a_user_error(make_model, tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match=r"cannot create --output-dir .*a-file/out \(Not a directory\)"):
        make_model().save("ck", output_dir=str(tmp_path / "a-file" / "out"), adapter_name="default")


def test_resume_refuses_a_different_base_model(make_model, tmp_path):
    from tiny import build_tiny_model

    path = make_model().save("ck", output_dir=str(tmp_path / "out"), adapter_name="default")
    other = TransformersModel(str(build_tiny_model(tmp_path / "other-model", seed=1)))
    from peft import LoraConfig

    other.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with pytest.raises(UserError, match=r"was trained on .*; pass that --model-id"):
        other.resume_from_checkpoint(str(path), adapter_name="default")


def _train_one_step(model, dataset) -> None:
    from twinkle.dataloader import DataLoader

    batch = next(iter(DataLoader(dataset, batch_size=2, world_size=1, rank=0)))
    model.forward_backward(inputs=batch)
    assert model.clip_grad_and_step()


def test_disk_full_during_save_keeps_the_previous_checkpoint(make_model, dataset, tmp_path, monkeypatch):
    model = make_model()
    out = tmp_path / "out"
    _train_one_step(model, dataset)
    path = model.save("ck", output_dir=str(out), adapter_name="default", consumed_train_samples=2)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    saved_weights = load_file(path / "adapter_model.safetensors")
    _train_one_step(model, dataset)  # the next save would hold different weights

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # the second file of the save finds the disk full
        full_disk.calls += 1
        if full_disk.calls >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    full_disk.calls = 0
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        UserError, match=r"could not write checkpoint .*ck \(No space left on device\); nothing was replaced"
    ):
        model.save("ck", output_dir=str(out), adapter_name="default", consumed_train_samples=4)
    monkeypatch.undo()

    assert sorted(p.name for p in out.iterdir()) == ["ck"]  # no temporary folder left
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # the old one, byte for byte
    fresh = make_model()
    assert fresh.resume_from_checkpoint(str(path), adapter_name="default")["consumed_train_samples"] == 2
    state = {n.replace(".default", ""): p for n, p in fresh.model.named_parameters() if p.requires_grad}
    for key, value in saved_weights.items():
        assert torch.equal(state[key], value), key


WRITE_FAILS = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from peft import LoraConfig
    from twinkle.model import TransformersModel
    from twinkle.utils.errors import UserError

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    model = TransformersModel(model_dir)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    model.save("ck", output_dir=str(out), adapter_name="default", consumed_train_samples=1)
    # From now on no file may grow past 1 kB: every real write of the next save fails (EFBIG),
    # raised by the serialisers themselves, as a full disk would be.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    try:
        model.save("ck", output_dir=str(out), adapter_name="default", consumed_train_samples=2)
        print(json.dumps({"error": None}))
    except UserError as exc:
        print(json.dumps({"error": str(exc)}))
    """
)


@pytest.mark.slow
def test_real_write_failure_is_a_user_error_and_leaves_the_old_checkpoint(tiny_model_dir, tmp_path):
    """Not a patched function: the real safetensors/torch writers hit a file-size limit."""
    out = tmp_path / "out"
    script = tmp_path / "write_fails.py"
    script.write_text(WRITE_FAILS)
    result = warm.run([str(script), str(tiny_model_dir), str(out)], cwd=tmp_path, env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    error = json.loads(result.stdout.strip().splitlines()[-1])["error"]
    assert error and re.search(
        r"could not write checkpoint .*ck \(File too large\); nothing was replaced", error
    )
    assert sorted(p.name for p in out.iterdir()) == ["ck"]
    assert json.loads((out / "ck" / "trainer_state.json").read_text())["consumed_train_samples"] == 1
    load_file(out / "ck" / "adapter_model.safetensors")  # still loadable


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path, tiny_model_dir):
    result = run_script(
        tmp_path, tiny_model_dir, tmp_path / "out", *FAST, "--model-id", str(tmp_path / "nope"), "--debug"
    )
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "UserError: model path" in result.stderr
    assert no_checkpoint_written(tmp_path / "out")
