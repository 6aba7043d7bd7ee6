"""The command-line fields upstream's scripts read, under upstream's names, and ``CLISource``."""

import pytest

from twinkle.cli import CLI, CLISource
from twinkle.utils.errors import UserError


def parse(*argv):
    return CLI.from_args(list(argv), env={})


def test_upstreams_scripts_take_the_transformers_path_by_default():
    args = parse()
    assert args.model.strategy == "native_fsdp"  # their `USE_MEGATRON = args.model.strategy != 'native_fsdp'`
    assert parse("--strategy", "accelerate").model.strategy != "native_fsdp"


def test_upstream_field_names():
    args = parse(
        "--lora-rank", "16", "--lora-path", "/tmp/adapter", "--adapter-name", "pol",
        "--tp-size", "2", "--pp-size", "1", "--ulysses-size", "2", "--ep-size", "4", "--no-lazy-collect",
        "--model-gpus", "4", "--sampler-gpus", "2", "--num-samples", "3", "--max-tokens", "64",
        "--no-save-optimizer", "--lora-sync-dir", "sync", "--tensor-parallel-size", "2",
        "--teacher-model-id", "t", "--student-model-id", "s", "--gkd-beta", "0.3", "--gkd-topk", "8",
        "--router-replay-mode", "R3", "--num-generations", "4",
        "--beta", "0.2", "--sft-weight", "1.0", "--loss-type", "hinge", "--max-length", "512",
        "--default-system", "Be brief.", "--mini-batch-size", "8", "--micro-batch-size", "2",
        "--save-steps", "10", "--max-steps", "20", "--gradient-accumulation-steps", "2", "--batch-size", "4",
        "--lr", "1e-5",
    )  # fmt: skip
    assert (args.lora.lora_r, args.lora.lora_rank, args.lora.lora_path, args.lora.adapter_name) == (
        16,
        16,
        "/tmp/adapter",
        "pol",
    )
    infra = args.infra
    assert (infra.tp_size, infra.pp_size, infra.ulysses_size, infra.ep_size, infra.lazy_collect) == (
        2,
        1,
        2,
        4,
        False,
    )
    assert (infra.model_gpus, infra.sampler_gpus) == (4, 2)
    assert (args.sampling.num_samples, args.sampling.max_tokens) == (3, 64)
    assert (args.checkpoint.save_optimizer, args.checkpoint.lora_sync_dir) == (False, "sync")
    assert args.sampler.tensor_parallel_size == 2
    rl = args.rl
    assert (rl.teacher_model_id, rl.student_model_id, rl.gkd_beta, rl.gkd_topk) == ("t", "s", 0.3, 8)
    assert (rl.router_replay_mode, rl.num_generations) == ("R3", 4)
    assert (args.loss.beta, args.loss.sft_weight, args.loss.loss_type) == (0.2, 1.0, "hinge")
    assert (args.template.max_length, args.template.default_system) == (512, "Be brief.")
    training = args.training
    assert (training.mini_batch_size, training.micro_batch_size, training.save_steps, training.max_steps) == (
        8,
        2,
        10,
        20,
    )
    assert (training.gradient_accumulation_steps, training.batch_size, args.optimizer.learning_rate) == (
        2,
        4,
        1e-5,
    )
    assert args.get_lora_args()["r"] == 16


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tp-size", "0"], "--tp-size"),
        (["--num-samples", "0"], "--num-samples"),
        (["--router-replay-mode", "R4"], "--router-replay-mode"),
        (["--gkd-beta", "2"], "--gkd-beta"),
    ],
)
def test_bad_values_are_one_line(argv, needle):
    with pytest.raises(UserError, match=needle) as info:
        parse(*argv)
    assert "\n" not in str(info.value)


def test_cli_source_is_the_raw_command_line():
    argv = [
        "--model_id",
        "Qwen/Qwen2.5",
        "--lr=1e-4",
        "--padding_free",
        "--no_cache",
        "--no-sync",
        "--n",
        "2",
        "x",
    ]
    assert CLISource(argv).load() == {
        "model_id": "Qwen/Qwen2.5",
        "lr": "1e-4",
        "padding_free": True,
        "cache": False,
        "sync": False,
        "n": "2",
    }
