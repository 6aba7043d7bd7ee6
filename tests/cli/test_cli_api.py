"""Upstream's CLI surface: the fields ``max_grad_norm``, ``max_steps``, ``save_steps``,
``padding_free``, ``model_cls``; ``CLI.from_args(config_file=, env_file=)`` and its precedence;
the ``get_<group>_args()`` helpers."""

import inspect
import os

import pytest

import twinkle
from twinkle.cli import CLI
from twinkle.cli.cli import format_help
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.runtime import RunDefaults
from twinkle.utils.errors import UserError


def parse(*argv: str, env: dict | None = None, **kwargs):
    return CLI.from_args(list(argv), env={} if env is None else env, **kwargs)


def one_line_error(*argv: str, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        parse(*argv, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_new_fields_parse_from_flags_env_and_files(tmp_path):
    args = parse(
        "--max-steps",
        "30",
        "--save-steps",
        "10",
        "--max-grad-norm",
        "0.5",
        "--model-cls",
        "AutoModelForCausalLM",
    )
    assert (args.training.max_steps, args.training.save_steps) == (30, 10)
    assert args.optimizer.max_grad_norm == 0.5 and args.model.model_cls == "AutoModelForCausalLM"
    assert args.training.padding_free is True and parse("--padding-free").training.padding_free is True
    defaults = parse()
    assert (defaults.training.max_steps, defaults.training.save_steps, defaults.optimizer.max_grad_norm) == (
        None,
        None,
        1.0,
    )
    assert defaults.model.model_cls is None
    env = {"TWINKLE_MAX_STEPS": "7", "TWINKLE_MAX_GRAD_NORM": "2"}
    assert (parse(env=env).training.max_steps, parse(env=env).optimizer.max_grad_norm) == (7, 2.0)
    config = tmp_path / "c.yaml"
    config.write_text("training: {max_steps: 5, save_steps: 2}\noptimizer: {max_grad_norm: 0.1}\n")
    args = parse("--config", str(config))
    assert (args.training.max_steps, args.training.save_steps, args.optimizer.max_grad_norm) == (5, 2, 0.1)
    for name in ("--max-steps", "--save-steps", "--max-grad-norm", "--model-cls", "--padding-free"):
        assert name in format_help()


def test_the_run_defaults_carry_max_grad_norm_and_model_cls():
    parse("--max-grad-norm", "0.25", "--model-cls", "Qwen3ForCausalLM")
    defaults = twinkle.initialize().defaults
    assert (defaults.max_grad_norm, defaults.model_cls) == (0.25, "Qwen3ForCausalLM")
    assert defaults.seed == RunDefaults().seed  # the rest as parsed by default


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--max-steps", "0"], ["--max-steps", ">= 1"]),
        (["--save-steps", "-1"], ["--save-steps", ">= 1"]),
        (["--max-grad-norm", "0"], ["--max-grad-norm", "> 0"]),
        (["--max-grad-norm", "big"], ["--max-grad-norm", "a number"]),
        (["--no-padding-free"], ["--no-padding-free", "padding-free", "drop the option"]),
        (["--padding-free", "false"], ["--padding-free", "drop the option"]),
        (["--model-cls", "AutoModelForCausalLMM"], ["--model-cls", "AutoModelForCausalLM"]),
        (["--model-cls", "my.module:Cls"], ["--model-cls", "a transformers class name"]),
    ],
)
def test_bad_values_of_the_new_fields(argv, needles):
    message = one_line_error(*argv)
    assert all(n in message for n in needles), message


def test_padding_free_false_from_the_environment_is_refused_too():
    assert "TWINKLE_PADDING_FREE" in one_line_error(env={"TWINKLE_PADDING_FREE": "0"})


def test_precedence_env_file_then_config_file_then_config_then_env_then_flags(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text(
        "# a dotenv file\nexport TWINKLE_BATCH_SIZE=2\nTWINKLE_SEED='11'\nTWINKLE_LR=1e-4  # peak\n"
        'TWINKLE_OUTPUT_DIR="out #1"\nTWINKLE_LOG_INTERVAL=3\nTWINKLE_EVAL_INTERVAL=4\nOTHER_TOOL_TOKEN=ignored\n\n'
    )
    assert parse(env_file=env_file).to_dict()["training"]["batch_size"] == 2
    args = parse(env_file=str(env_file))
    assert (args.infra.seed, args.optimizer.learning_rate, args.training.output_dir) == (11, 1e-4, "out #1")
    assert "OTHER_TOOL_TOKEN" not in os.environ  # the file feeds the parse, never the process environment
    shipped = tmp_path / "shipped.json"
    shipped.write_text('{"batch_size": 3, "seed": 12, "log_interval": 5, "training": {"max_steps": 9}}')
    user = tmp_path / "user.yaml"
    user.write_text("batch_size: 4\nseed: 13\n")
    env = {"TWINKLE_BATCH_SIZE": "5", "TWINKLE_LOG_INTERVAL": "6"}
    args = parse("--config", str(user), "--batch-size", "6", env=env, config_file=shipped, env_file=env_file)
    assert args.training.batch_size == 6  # flag > env > --config > config_file > env_file
    assert args.training.log_interval == 6  # env > config_file
    assert args.infra.seed == 13  # --config > config_file
    assert args.training.max_steps == 9 and args.training.eval_interval == 4  # lower sources still fill in
    assert parse(config_file=shipped, env_file=env_file).infra.seed == 12  # config_file > env_file


def test_config_and_env_file_errors_are_one_line(tmp_path):
    assert "env_file: file not found" in one_line_error(env_file=tmp_path / "missing.env")
    bad = tmp_path / "bad.env"
    bad.write_text("TWINKLE_SEED=1\njust words\n")
    assert "line 2: expected KEY=VALUE" in one_line_error(env_file=bad)
    value = tmp_path / "value.env"
    value.write_text("TWINKLE_BATCH_SIZE=many\n")
    assert "TWINKLE_BATCH_SIZE" in one_line_error(env_file=value) and "an integer" in one_line_error(
        env_file=value
    )
    broken = tmp_path / "broken.json"
    broken.write_text('{"batch_size": 1,}')
    assert "not valid JSON at line 1" in one_line_error(config_file=broken)
    assert "config_file: file not found" in one_line_error(config_file=tmp_path / "none.yaml")
    with pytest.raises(UserError, match="env_file="):
        CLI.from_args([], ".env")  # upstream's positional order is (argv, env_file, config_file)


def test_an_unknown_config_key_names_the_nearest_field(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("batch_size: 2\nlearning_rat: 1e-4\n")
    message = one_line_error("--config", str(config))
    assert "unknown key 'learning_rat'" in message and "nearest field: learning_rate" in message
    config.write_text("training: {max_step: 3}\n")
    assert "nearest field: max_steps" in one_line_error(config_file=config)
    config.write_text("model_name: bot\nextra: {anything: 1}\n")  # the cookbook's keys and extra: pass
    assert parse("--config", str(config)).extra == {"model_name": "bot", "anything": 1}
    config.write_text("checkpoint: {save_optimizer: false}\nsampler: {tensor_parallel_size: 2}\n")
    grouped = parse("--config", str(config))
    assert (grouped.checkpoint.save_optimizer, grouped.sampler.tensor_parallel_size) == (False, 2)
    config.write_text("server: {port: 1}\n")
    assert "not supported yet: the 'server' group" in one_line_error("--config", str(config))
    config.write_text("loss: {beta: 0.5}\nrl: {num_generations: 4}\n")
    assert (parse("--config", str(config)).loss.beta, parse("--config", str(config)).rl.num_generations) == (
        0.5,
        4,
    )


def test_get_group_args_follow_upstreams_groups():
    args = parse("--model-id", "m", "--dataset-id", "d", "--seed", "3", "--lr", "2e-4", "--max-steps", "4")
    assert args.get_model_args() == {
        "model_id": "m",
        "enable_liger": False,
        "enable_fused_ce": True,
        "dtype": "auto",
        "activation_checkpointing": "auto",
        "strategy": "native_fsdp",
    }  # model_cls is None: left out, so a **kwargs call keeps the callee's default
    assert args.get_dataset_args() == {"dataset_id": "d", "split": "train"}
    assert args.get_template_args() == {
        "template_cls": "Template",
        "max_length": 1024,
        "truncation_strategy": "right",
        "model_id": "m",
    }
    training = args.get_training_args()
    assert training["seed"] == 3 and training["max_steps"] == 4 and training["padding_free"] is True
    assert "seed" not in args.get_infra_args() and args.get_infra_args()["mode"] == "local"
    assert args.get_optimizer_args() == {"optimizer_cls": "AdamW", "lr": 2e-4, "max_grad_norm": 1.0}
    assert args.get_scheduler_args() == {"scheduler_cls": "CosineWarmupScheduler", "num_warmup_steps": 5}


def test_the_group_dicts_fit_the_calls_they_configure():
    args = parse("--model-id", "m", "--dataset-id", "d", "--subset-name", "s")
    assert set(args.get_template_args()) <= set(inspect.signature(Dataset.set_template).parameters)
    assert set(args.get_dataset_args()) <= set(inspect.signature(DatasetMeta).parameters)
    assert set(args.get_scheduler_args()) <= set(
        inspect.signature(TransformersModel.set_lr_scheduler).parameters
    )


def test_the_preference_and_rl_groups_upstreams_scripts_read():
    args = parse(
        "--beta", "0.2", "--loss-type", "ipo", "--sft-weight", "0.5", "--num-generations", "4",
        "--max-new-tokens", "64", "--temperature", "0.7", "--top-p", "0.9",
        "--mini-batch-size", "8", "--micro-batch-size", "2", "--default-system", "Be brief.",
        "--model-gpus", "2", "--sampler-gpus", "1",
    )  # fmt: skip
    assert args.get_loss_args() == {
        "loss_type": "ipo",
        "beta": 0.2,
        "sft_weight": 0.5,
        "label_smoothing": 0.0,
        "epsilon": 0.2,
    }  # epsilon_high is None: left out
    assert args.get_sampling_args() == {
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "num_samples": 1,
    }
    assert args.get_rl_args() == {
        "num_generations": 4,
        "advantage_scale": "group",
        "advantage_type": "GRPOAdvantage",
        "gkd_beta": 0.5,
        "gkd_temperature": 1.0,
        "gkd_topk": 64,
        "router_replay_mode": "disabled",
    }  # the model ids and reward names are None: left out
    assert (args.training.mini_batch_size, args.training.micro_batch_size) == (8, 2)
    assert (args.template.default_system, args.infra.model_gpus, args.infra.sampler_gpus) == (
        "Be brief.",
        2,
        1,
    )
    assert "--beta" in format_help() and "--num-generations" in format_help()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--beta", "-1"], "--beta"),
        (["--loss-type", "kto"], "--loss-type"),
        (["--top-p", "0"], "--top-p"),
        (["--top-k", "-2"], "--top-k"),
        (["--label-smoothing", "0.5"], "--label-smoothing"),
    ],
)
def test_bad_preference_and_rl_values_are_one_line(argv, needle):
    assert needle in one_line_error(*argv)


@pytest.mark.parametrize("group", ["server"])
def test_groups_without_our_fields_are_not_supported_yet(group):
    with pytest.raises(UserError) as info:
        getattr(parse(), f"get_{group}_args")()
    assert str(info.value).startswith(f"not supported yet: get_{group}_args()") and "\n" not in str(
        info.value
    )
