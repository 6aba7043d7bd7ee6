"""Tests for ``twinkle.cli``: sources, precedence, syntax, errors and help."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import twinkle
from twinkle.cli import CLI, TEMPLATE_NAMES, Args
from twinkle.cli.fields import SPECS
from twinkle.runtime import RunDefaults, run_defaults
from twinkle.utils.errors import UserError

REPO = Path(__file__).resolve().parents[2]
GROUP_NAMES = ["infra", "dataset", "template", "model", "training", "lora", "optimizer", "scheduler"]

UPSTREAM = (
    "--model-id ms://Qwen/Qwen3.5-4B --dataset-id ms://swift/self-cognition --template-cls Qwen3_5Template "
    "--fsdp-size 2 --dp-size 1 --batch-size 8 --lr 1e-4 --gradient-accumulation-steps 2 --log-interval 5 "
    "--eval-interval 40 --eval-samples 100 --output-dir out --adapter-name default "
    "--scheduler-cls CosineWarmupScheduler --num-warmup-steps 5 --train-samples 1000 "
    "--model-name twinkle大模型 --model-author ModelScope社区 --max-length 2048 --truncation-strategy right "
    "--enable-liger --no-fused-ce --resume-from-checkpoint ckpt --resume-only-model --ignore-data-skip "
    "--mode local"
).split()


def parse(*argv: str, env: dict | None = None) -> Args:
    return CLI.from_args(list(argv), env={} if env is None else env)


def test_defaults():
    args = parse()
    assert args.to_dict() == Args().to_dict()
    assert args.infra.fsdp_size is None and args.infra.mode == "local" and args.infra.seed == 42
    assert args.infra.process_group_timeout == 600 and args.infra.debug is False
    assert args.dataset.dataset_id is None and args.dataset.split == "train"
    assert (args.template.template_cls, args.template.max_length) == ("Template", 1024)
    assert args.template.truncation_strategy == "right"
    assert args.model.model_id is None and args.model.enable_fused_ce and not args.model.enable_liger
    assert args.training.batch_size == 4 and args.training.output_dir == "output"
    assert args.training.eval_interval is None
    assert (args.lora.lora_rank, args.lora.lora_alpha, args.lora.target_modules) == (8, 32, "all-linear")
    assert args.optimizer.learning_rate == 1e-3
    assert args.scheduler.scheduler_cls == "CosineWarmupScheduler" and args.scheduler.num_warmup_steps == 5
    assert args.extra == {}


def test_a_parse_hands_the_run_defaults_to_initialize():
    assert run_defaults() == RunDefaults()
    CLI.from_args(
        [
            "--seed",
            "7",
            "--process-group-timeout",
            "30",
            "--dtype",
            "bfloat16",
            "--activation-checkpointing",
            "on",
        ],
        env={},
    )
    assert run_defaults() == RunDefaults()  # parsed, not applied
    parsed = twinkle.initialize().defaults
    assert parsed is run_defaults()
    assert parsed.run_args["infra"]["seed"] == 7  # the command line, saved with the metrics
    assert parsed == RunDefaults(
        seed=7,
        process_group_timeout_s=30,
        dtype="bfloat16",
        activation_checkpointing="on",
        lock_output_dir=True,  # a CLI run owns its output dir
        report_to=(),  # a CLI run records metrics.jsonl
        run_args=parsed.run_args,
    )
    assert twinkle.initialize().defaults == RunDefaults()  # handed over once


def test_upstream_run_line():
    args = parse(*UPSTREAM)
    d = args.to_dict()
    assert d["infra"] == {
        "fsdp_size": 2,
        "dp_size": 1,
        "mode": "local",
        "seed": 42,
        "debug": False,
        "process_group_timeout": 600,
        "max_restarts": 0,
        "ray_address": None,
        "ray_placement": "pack",
        "model_gpus": None,
        "sampler_gpus": None,
        "ref_model_gpus": None,
        "tp_size": None,
        "pp_size": None,
        "cp_size": None,
        "ep_size": None,
        "ulysses_size": None,
        "sequence_parallel": False,
        "lazy_collect": True,
    }
    assert d["dataset"] == {
        "dataset_id": "ms://swift/self-cognition",
        "subset_name": None,
        "split": "train",
        "skip_bad_rows": False,
    }
    assert d["template"] == {
        "template_cls": "Qwen3_5Template",
        "max_length": 2048,
        "truncation_strategy": "right",
        "default_system": None,
    }
    assert d["model"] == {
        "model_id": "ms://Qwen/Qwen3.5-4B",
        "enable_liger": True,
        "enable_fused_ce": False,
        "dtype": "auto",
        "activation_checkpointing": "auto",
        "strategy": "native_fsdp",
        "model_cls": None,
    }
    assert d["training"] == {
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
        "train_samples": 1000,
        "eval_samples": 100,
        "log_interval": 5,
        "eval_interval": 40,
        "output_dir": "out",
        "report_to": "none",
        "resume_from_checkpoint": "ckpt",
        "resume_only_model": True,
        "ignore_data_skip": True,
        "max_steps": None,
        "save_steps": None,
        "padding_free": True,
        "mini_batch_size": None,
        "micro_batch_size": None,
    }
    assert d["lora"]["adapter_name"] == "default"
    assert d["optimizer"] == {"learning_rate": 1e-4, "optimizer_cls": "AdamW", "max_grad_norm": 1.0}
    assert d["scheduler"] == {"scheduler_cls": "CosineWarmupScheduler", "num_warmup_steps": 5}
    assert args.extra == {"model_name": "twinkle大模型", "model_author": "ModelScope社区"}


def test_equals_syntax_and_aliases():
    args = parse("--batch-size=16", "--learning-rate=3e-4", "--r", "16", "--output-dir=a=b")
    assert args.training.batch_size == 16 and args.optimizer.learning_rate == 3e-4
    assert args.lora.lora_rank == 16 and args.training.output_dir == "a=b"
    assert parse("--lora-r=2").lora.lora_rank == 2
    assert parse("--lora-rank", "4").lora.lora_rank == 4


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--no-ignore-data-skip"], False),
        (["--ignore-data-skip"], True),
        (["--ignore-data-skip", "false"], False),
        (["--ignore-data-skip", "0"], False),
        (["--ignore-data-skip", "no"], False),
        (["--ignore-data-skip", "YES"], True),
        (["--ignore-data-skip=false"], False),
        (["--ignore-data-skip=1"], True),
        (["--no-ignore-data-skip", "--ignore-data-skip"], True),
    ],
)
def test_booleans(argv, expected):
    assert parse(*argv).training.ignore_data_skip is expected


def test_fused_ce_aliases():
    assert parse("--no-fused-ce").model.enable_fused_ce is False
    assert parse("--no-enable-fused-ce").model.enable_fused_ce is False
    assert parse("--no-fused-ce", "--fused-ce").model.enable_fused_ce is True


def test_optional_none_and_extra():
    args = parse("--eval-interval", "none", "--model-id", "None", "--foo-bar", "3", "--ratio", "0.5")
    assert args.training.eval_interval is None and args.model.model_id is None
    args = parse(
        "--foo-bar", "3", "--ratio=0.5", "--name", "007", "--on", "--no-off", "--x", "true", "--neg", "-2"
    )
    assert args.extra == {
        "foo_bar": 3,
        "ratio": 0.5,
        "name": "007",
        "on": True,
        "off": False,
        "x": True,
        "neg": -2,
    }


def test_config_flat_grouped_and_cli_override(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text(
        "batch_size: 8\nlr: 1e-3\nmodel_name: bot\nenable-liger: true\ntarget_modules: [q_proj, v_proj]\n"
    )
    args = parse("--config", str(flat))
    assert args.training.batch_size == 8 and args.optimizer.learning_rate == 1e-3
    assert args.model.enable_liger is True and args.extra == {"model_name": "bot"}
    assert args.get_lora_args()["target_modules"] == ["q_proj", "v_proj"]

    grouped = tmp_path / "grouped.yaml"
    grouped.write_text(
        "training:\n  batch_size: 8\n  log_interval: 2\nlora: {lora_rank: 4}\nextra: {model_author: me}\n"
    )
    args = parse(f"--config={grouped}", "--batch-size", "2")
    assert args.training.batch_size == 2  # the flag beats the file
    assert args.training.log_interval == 2 and args.lora.lora_rank == 4
    assert args.extra == {"model_author": "me"}


def test_config_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(UserError, match="nope.yaml"):
        parse("--config", str(missing))
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: [1,\n")
    with pytest.raises(UserError, match="bad.yaml"):
        parse("--config", str(bad))
    wrong_group = tmp_path / "group.yaml"
    wrong_group.write_text("model: {batch_size: 3}\n")
    with pytest.raises(UserError, match="training"):
        parse("--config", str(wrong_group))
    bad_value = tmp_path / "value.yaml"
    bad_value.write_text("batch_size: x\n")
    with pytest.raises(UserError, match="batch_size: expected an integer"):
        parse("--config", str(bad_value))


def test_env_precedence_and_no_leaks(tmp_path):
    env = {
        "WORLD_SIZE": "4",
        "PORT": "29500",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "SEED": "1",
        "BATCH_SIZE": "99",
        "TWINKLE_BATCH_SIZE": "8",
        "TWINKLE_TORCH_BASELINE": "1",
        "TWINKLE_ENABLE_LIGER": "1",
    }
    args = parse(env=env)
    assert args.training.batch_size == 8 and args.model.enable_liger is True
    assert args.infra.seed == 42 and args.extra == {}
    assert args.to_dict() == parse("--batch-size", "8", "--enable-liger").to_dict()

    config = tmp_path / "c.yaml"
    config.write_text("batch_size: 2\nseed: 5\n")
    args = parse("--config", str(config), env={"TWINKLE_BATCH_SIZE": "8"})
    assert args.training.batch_size == 8 and args.infra.seed == 5  # env beats the file
    assert parse("--batch-size", "3", env={"TWINKLE_BATCH_SIZE": "8"}).training.batch_size == 3
    with pytest.raises(UserError, match="TWINKLE_BATCH_SIZE.*expected an integer"):
        parse(env={"TWINKLE_BATCH_SIZE": "many"})


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--batch-size", "x"], ["--batch-size: expected an integer, got 'x'"]),
        (
            ["--truncation-strategy", "foo"],
            ["--truncation-strategy: 'foo' is not one of raise, left, right, delete"],
        ),
        (["--template-cls", "Qwen"], ["--template-cls", *TEMPLATE_NAMES]),
        (["--mode", "mpi"], ["--mode", "local, ray"]),
        (["--mode", "cluster"], ["--mode", "local, ray"]),
        (["--batch-size", "0"], ["--batch-size", ">= 1"]),
        (["--gradient-accumulation-steps", "0"], ["--gradient-accumulation-steps", ">= 1"]),
        (["--log-interval", "0"], ["--log-interval", ">= 1"]),
        (["--max-length", "0"], ["--max-length", ">= 1"]),
        (["--lora-rank", "0"], ["--lora-rank", ">= 1"]),
        (["--r", "-1"], ["--r", ">= 1"]),
        (["--lr", "0"], ["--lr", "> 0"]),
        (["--lr", "fast"], ["--lr", "a number"]),
        (["--fsdp-size", "0"], ["--fsdp-size", ">= 1"]),
        (["--dp-size", "x"], ["--dp-size", "an integer"]),
        (["--ignore-data-skip=maybe"], ["--ignore-data-skip", "boolean"]),
        (["--batch-size"], ["--batch-size", "expected an integer"]),
        (["--target-modules", ","], ["--target-modules", "all-linear"]),
        (["train.py"], ["'train.py'"]),
        (["--batch-size", "4", "8"], ["'8'"]),
        (["--debug", "stray"], ["'stray'"]),
        (["--=3"], ["'--=3'"]),
        (["--no-eval-interval"], ["--no-eval-interval", "--eval-interval none"]),
        (["--no-ignore-data-skip=true"], ["--no-ignore-data-skip", "takes no value"]),
    ],
)
def test_bad_values(argv, needles):
    with pytest.raises(UserError) as info:
        parse(*argv)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_lora_args_build_a_real_lora_config():
    from peft import LoraConfig

    config = LoraConfig(**parse().get_lora_args())
    assert config.r == 8 and config.lora_alpha == 32 and config.target_modules == "all-linear"
    args = parse("--r", "4", "--lora-alpha", "8", "--lora-dropout", "0", "--target-modules", "q_proj, v_proj")
    config = LoraConfig(**args.get_lora_args())
    assert config.r == 4 and config.lora_alpha == 8 and config.lora_dropout == 0.0
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert (
        str(config.task_type.value if hasattr(config.task_type, "value") else config.task_type) == "CAUSAL_LM"
    )


def test_help_lists_every_group_and_flag(capsys):
    with pytest.raises(SystemExit) as info:
        CLI.from_args(["--help"], env={})
    assert info.value.code == 0
    out = capsys.readouterr().out
    for group in GROUP_NAMES:
        assert f"{group}:" in out
    for spec in SPECS.values():
        assert f"--{spec.flag}" in out
    for needle in ("--no-fused-ce", "--model-name", "--model-author", "--config", "TWINKLE_", "--lr", "--r"):
        assert needle in out
    with pytest.raises(SystemExit):
        CLI.from_args(["-h"], env={})


def test_bad_flag_from_sys_argv_exits_2_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    code = "from twinkle.cli import CLI; CLI.from_args()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "--batch-size", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: --batch-size: expected an integer, got 'x'"]


def test_env_accepts_flag_aliases():
    args = CLI.from_args(
        [], env={"TWINKLE_LR": "2e-5", "TWINKLE_LORA_R": "16", "TWINKLE_TORCH_BASELINE": "1"}
    )
    assert args.optimizer.learning_rate == 2e-5 and args.lora.lora_rank == 16
    assert CLI.from_args(["--lr", "3e-5"], env={"TWINKLE_LR": "2e-5"}).optimizer.learning_rate == 3e-5


def test_dtype_flag_and_variable():
    assert parse().model.dtype == "auto"
    assert parse("--dtype", "bfloat16").model.dtype == "bfloat16"
    assert parse(env={"TWINKLE_DTYPE": "float32"}).model.dtype == "float32"
    with pytest.raises(UserError, match="'fp16' is not one of auto, float32, bfloat16"):
        parse("--dtype", "fp16")


def test_activation_checkpointing_flag_and_variable():
    assert parse().model.activation_checkpointing == "auto"
    assert parse("--activation-checkpointing", "on").model.activation_checkpointing == "on"
    env = {"TWINKLE_ACTIVATION_CHECKPOINTING": "off"}
    assert parse(env=env).model.activation_checkpointing == "off"
    with pytest.raises(UserError, match="'sometimes' is not one of auto, on, off"):
        parse("--activation-checkpointing", "sometimes")


def test_a_collective_cut_off_by_a_dead_rank_is_one_line(capsys):
    from twinkle.cli.cli import _one_line_user_errors

    error = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
    )
    _one_line_user_errors(RuntimeError, error, None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: another rank of this job stopped")
    assert "Connection closed by peer" in err and "--resume-from-checkpoint auto" in err
