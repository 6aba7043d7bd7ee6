import subprocess
import sys

from twinkle.cli.main import main


def test_kernels_without_a_model_reports_the_machine(capsys):
    assert main(["kernels", "--no-model"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ")
    assert "packed_attention: native -> pooled -> batched -> sdpa" in out
    assert "LlamaRMSNorm -> rms_norm" in out


def test_kernels_for_a_model_says_what_each_module_class_got(tiny_model_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "twinkle.cli.main", "kernels", "--model-id", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TWINKLE_LORA_MLP": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "x LlamaRMSNorm -> rms_norm [torch]" in done.stdout
    assert "x LlamaAttention -> lora_attention [torch]" in done.stdout
    assert "switched off (TWINKLE_LORA_MLP=off)" in done.stdout
    assert "cpu_gemm per fp32 weight shape" in done.stdout


def test_a_bad_switch_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "twinkle.cli.main", "kernels", "--no-model"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TWINKLE_ONEDNN": "maybe", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: TWINKLE_ONEDNN='maybe' is not a switch: set it to one of auto, on, off, or unset it"
    ]


def test_kernels_none_reports_every_op_on_its_plain_backend(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "twinkle.cli.main", "kernels", "--no-model"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TWINKLE_KERNELS": "none", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "TWINKLE_KERNELS=none: each op's plain backend only" in out
    assert "packed_attention: native -> pooled -> batched -> sdpa  (in effect: sdpa)" in out
    assert "cpu_gemm: packed -> onednn -> torch  (in effect: torch)" in out
    assert "lora_linear: fused -> peft  (in effect: peft)" in out
    assert "off (TWINKLE_KERNELS=none: only 'peft' runs)" in out
    assert "none patched (TWINKLE_KERNELS=none)" in out
    assert "TWINKLE_KERNELS=none  (default default)" in out
