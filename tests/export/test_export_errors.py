"""``twinkle export`` on bad input: one line on stderr (exit 2, no traceback), and nothing
half-written left behind."""

import shutil

import pytest
from export_models import build_family_model, checkpoint_fixture, save_checkpoint, save_peft_adapter

from twinkle.cli.main import main
from twinkle.export import export as export_module
from twinkle.utils.errors import UserError

checkpoint = pytest.fixture(scope="module", name="checkpoint")(checkpoint_fixture)


def run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()  # drop what earlier steps printed
    code = main(["export", *argv])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def leftovers(folder) -> list[str]:
    """Temporary siblings an export would leave beside its output."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_folder_without_an_adapter(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    code, err = run(capsys, "--adapter", str(tmp_path / "ck"), "--output", str(tmp_path / "out"))
    assert_one_line_error(code, err, "holds no LoRA adapter", "adapter_config.json")
    code, err = run(capsys, "--adapter", str(tmp_path / "missing"), "--output", str(tmp_path / "out"))
    assert_one_line_error(code, err, "does not exist")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_damaged_checkpoint(checkpoint, tmp_path, capsys):
    damaged = tmp_path / "ck"
    shutil.copytree(checkpoint, damaged)
    weights = damaged / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, err = run(capsys, "--adapter", str(damaged), "--output", str(tmp_path / "out"))
    assert_one_line_error(code, err, "adapter_model.safetensors")
    assert not (tmp_path / "out").exists()


def test_a_base_model_that_cannot_be_found(tiny_model_dir, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    checkpoint = save_checkpoint(base, tmp_path / "run")
    shutil.rmtree(base)  # the base the checkpoint records is gone
    argv = ["--adapter", str(checkpoint), "--output", str(tmp_path / "out")]
    code, err = run(capsys, *argv)
    assert_one_line_error(code, err, "base model", "cannot be found", "--model-id")
    code, err = run(capsys, *argv, "--model-id", str(tmp_path / "nowhere"))
    assert_one_line_error(code, err, "nowhere", "does not exist")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    # --model-id names another copy of the base: the export works
    shutil.copytree(tiny_model_dir, base)
    assert main(["export", *argv, "--model-id", str(base)]) == 0


def test_an_output_folder_that_is_not_empty(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run(capsys, "--adapter", str(checkpoint), "--output", str(out))
    assert_one_line_error(code, err, "exists and is not empty", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    # --overwrite replaces only an earlier export (tests/run/test_data_safety.py)
    code, err = run(capsys, "--adapter", str(checkpoint), "--output", str(out), "--overwrite")
    assert_one_line_error(code, err, "is not a folder twinkle export wrote")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert not leftovers(tmp_path)
    (tmp_path / "file").write_text("x")
    code, err = run(capsys, "--adapter", str(checkpoint), "--output", str(tmp_path / "file"), "--overwrite")
    assert_one_line_error(code, err, "is a file")
    code, err = run(capsys, "--adapter", str(checkpoint), "--output", str(checkpoint.parent), "--overwrite")
    assert_one_line_error(code, err, "is not a folder twinkle export wrote")
    assert checkpoint.is_dir()


def test_overwrite_replaces_only_after_the_new_export_is_complete(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_module.export_checkpoint(str(checkpoint), str(out))  # an earlier export, which may be replaced
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "write_gguf", fail)
    with pytest.raises(UserError, match="No space left on device"):
        export_module.export_checkpoint(str(checkpoint), str(out), gguf_types=("f16",), overwrite=True)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # the old folder, untouched
    assert not leftovers(tmp_path)  # and no half-written new one beside it
    with pytest.raises(UserError):
        export_module.export_checkpoint(str(checkpoint), str(tmp_path / "fresh"), gguf_types=("f16",))
    assert not (tmp_path / "fresh").exists() and not leftovers(tmp_path)


def test_a_gguf_type_the_architecture_does_not_support(checkpoint, tmp_path, capsys):
    code, err = run(
        capsys, "--adapter", str(checkpoint), "--output", str(tmp_path / "out"), "--gguf-type", "f16,q4_k"
    )
    assert_one_line_error(code, err, "q4_k", "llama", "f32, f16, bf16, q8_0")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_an_architecture_gguf_cannot_write(tiny_model_dir, tmp_path, capsys):
    base = build_family_model("mistral", tiny_model_dir, tmp_path / "mistral")
    adapter = save_peft_adapter(base, tmp_path / "adapter")
    code, err = run(capsys, "--adapter", str(adapter), "--output", str(tmp_path / "out"), "--gguf")
    assert_one_line_error(code, err, "'mistral'", "llama, qwen2, qwen3")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    # without --gguf the Hugging Face folder is written
    assert main(["export", "--adapter", str(adapter), "--output", str(tmp_path / "out")]) == 0
