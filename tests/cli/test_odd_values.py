"""Odd values that used to end in a traceback: each is now one ``error: ...`` line naming the
flag or file and what to use instead, raised before any training, merge or generation.

Each case runs through the cheapest entry point that shows what the user sees: the parser
(``CLI.from_args``) for values refused there, the ``twinkle`` command in-process (exit status
and stderr) for ``chat``/``eval``/``export``, the hub functions for model folders, datasets and
the cache, and one script run per script whose traceback came from a later step."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import warm
from harness import assert_one_line_error, script_env

import twinkle.export
from twinkle.cli import CLI
from twinkle.cli.export import check_shard_size
from twinkle.cli.main import main
from twinkle.hub import check_adapter_folder, resolve_dataset, resolve_model
from twinkle.optim import build_optimizer
from twinkle.utils.errors import UserError

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook" / "transformers"
OPTIMIZER_NAMES = "ASGD, Adadelta, .*SGD$"

# ---------------------------------------------------------------- refused by the parser
# name -> (flags, regex the UserError must match).
PARSE_CASES = {
    "seed-beyond-2-64": (
        ["--seed", str(2**64)],
        r"^--seed: must be in \[0, 9223372036854775807\] \(2\*\*63 - 1: torch seeds are 64-bit and "
        r"each rank adds an offset\), got 18446744073709551616$",
    ),
    "seed-negative": (["--seed", "-1"], r"^--seed: must be in \[0, 9223372036854775807\]"),
    "adapter-name-with-a-dot": (
        ["--adapter-name", "a.b"],
        r"^--adapter-name: must be a name of letters, digits, '_' and '-' \(PEFT makes it a module "
        r"name, which cannot hold '.'\), got 'a.b'$",
    ),
    "adapter-name-empty": (["--adapter-name", ""], r"^--adapter-name: must be a name of letters"),
    "model-cls-without-lm-head": (
        ["--model-cls", "AutoModel"],
        r"^--model-cls: AutoModel has no language-model head to train .*use AutoModelForCausalLM, "
        r"a \*ForCausalLM class or a multimodal \*ForConditionalGeneration class",
    ),
    "model-cls-base-model": (["--model-cls", "LlamaModel"], r"^--model-cls: LlamaModel has no language"),
    "optimizer-lbfgs": (
        ["--optimizer-cls", "LBFGS"],
        r"^--optimizer-cls: optimizer LBFGS cannot train here \(its step\(\) needs a closure .*\); "
        rf"use one of {OPTIMIZER_NAMES}",
    ),
    "optimizer-sparse-adam": (
        ["--optimizer-cls", "SparseAdam"],
        rf"^--optimizer-cls: optimizer SparseAdam cannot train here \(it takes sparse gradients only, "
        rf"and LoRA gradients are dense\); use one of {OPTIMIZER_NAMES}",
    ),
}


@pytest.mark.parametrize("case", list(PARSE_CASES))
def test_parser_refuses_the_value_in_one_line(case, tmp_path):
    flags, pattern = PARSE_CASES[case]
    with pytest.raises(UserError, match=pattern) as info:
        CLI.from_args([*flags, "--output-dir", str(tmp_path / "out")], env={})
    assert "\n" not in str(info.value)


def test_parser_keeps_the_values_next_to_the_refused_ones(tmp_path):
    args = CLI.from_args(
        [
            *("--seed", str(2**63 - 1), "--adapter-name", "my-adapter_2"),
            *("--model-cls", "Qwen3_5ForConditionalGeneration", "--optimizer-cls", "SGD"),
            *("--output-dir", str(tmp_path / "out")),
        ],
        env={},
    )
    assert args.infra.seed == 2**63 - 1 and args.lora.adapter_name == "my-adapter_2"
    assert args.model.model_cls == "Qwen3_5ForConditionalGeneration" and args.optimizer.optimizer_cls == "SGD"
    torch.manual_seed(args.infra.seed + 1_000_003 * 4096)  # a rank's offset seed still fits torch


@pytest.mark.parametrize("cls", ["LBFGS", torch.optim.SparseAdam])
def test_build_optimizer_refuses_what_the_step_cannot_drive(cls):
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(UserError, match=r"^optimizer (LBFGS|SparseAdam) cannot train here"):
        build_optimizer(cls, params, lr=1e-3)


@pytest.mark.slow
def test_sft_own_data_refuses_lbfgs_before_reading_data(tmp_path, tiny_model_dir):
    """The case as reported: the script used to fail at the first step; the data path here does
    not exist, so an error about it would mean the optimizer was not checked first."""
    argv = [
        str(COOKBOOK / "sft_own_data.py"),
        *("--model-id", str(tiny_model_dir), "--dataset-id", str(tmp_path / "not-read.jsonl")),
        *("--output-dir", str(tmp_path / "out"), "--optimizer-cls", "LBFGS"),
    ]
    result = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert_one_line_error(
        result, r"^error: --optimizer-cls: optimizer LBFGS cannot train here", tmp_path / "out"
    )


# ---------------------------------------------------------------- model folders, data, cache
@pytest.mark.parametrize(
    ("key", "value"), [("vocab_size", 0), ("hidden_size", -8), ("num_hidden_layers", "2")]
)
def test_model_folder_with_a_size_that_cannot_build(key, value, tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    shown = json.dumps(value).replace('"', "'")
    with pytest.raises(UserError, match=rf"config.json has {key} {shown}, which must be a positive integer"):
        resolve_model(str(folder))


@pytest.mark.slow
def test_script_refuses_vocab_size_zero(tmp_path, tiny_model_dir):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 0}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"query": "Who are you?", "response": "I am {{NAME}}."}) + "\n")
    argv = [str(COOKBOOK / "fsdp2.py"), "--model-id", str(folder), "--dataset-id", str(rows)]
    argv += ["--output-dir", str(tmp_path / "out"), "--train-samples", "1"]
    result = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert_one_line_error(
        result, r"config.json has vocab_size 0, which must be a positive integer", tmp_path / "out"
    )


def _parquet(tmp_path: Path, damage: str) -> Path:
    path = tmp_path / f"{damage}.parquet"
    rows = {
        "query": [f"Who are you {i}?" for i in range(2000)],
        "response": [f"I am {i}." for i in range(2000)],
    }
    pq.write_table(pa.table(rows), path)
    data = bytearray(path.read_bytes())
    if damage == "cut-short":
        data = data[: len(data) // 2]
    elif damage == "not-parquet":
        data = bytearray(b"query,response\nhi,there\n")
    else:  # pages: the footer is intact, the column data is not
        for i in range(4, len(data) // 2, 7):
            data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        (
            "cut-short",
            r"dataset file .*cut-short.parquet is not a readable parquet file \(Parquet magic bytes",
        ),
        ("not-parquet", r"dataset file .*not-parquet.parquet is not a readable parquet file"),
        ("pages", r"could not read dataset .*pages.parquet' as parquet \(.+\); fix the file\(s\)"),
    ],
)
def test_damaged_parquet_dataset(damage, pattern, tmp_path):
    with pytest.raises(UserError, match=pattern) as info:
        resolve_dataset(str(_parquet(tmp_path, damage)))
    assert "\n" not in str(info.value) and re.search(r"download (it|them) again$", str(info.value))


def _cache_below_a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "a-file").write_text("x")
    return tmp_path / "a-file" / "cache", "a-file is a file, not a folder"


def _cache_is_a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "a-file").write_text("x")
    return tmp_path / "a-file", "a-file is a file, not a folder"


@pytest.mark.parametrize("make", [_cache_is_a_file, _cache_below_a_file])
def test_cache_that_is_a_file_with_the_default_model(make, tmp_path, monkeypatch):
    cache, text = make(tmp_path)
    monkeypatch.setenv("TWINKLE_CACHE", str(cache))
    with pytest.raises(UserError, match=rf"Twinkle cache: .*{text}; set TWINKLE_CACHE to a writable folder"):
        resolve_model(None)
    assert (tmp_path / "a-file").read_text() == "x"


def test_unwritable_cache_with_the_default_model(tmp_path, monkeypatch):
    # As root (CI) chmod does not stop writes, so the permission answer is simulated.
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode)
    )
    monkeypatch.setenv("TWINKLE_CACHE", str(locked / "cache"))
    with pytest.raises(UserError, match=r"locked is not writable; set TWINKLE_CACHE to a writable folder"):
        resolve_model(None)


# ---------------------------------------------------------------- the twinkle command
def _twinkle(capsys, *argv: str) -> str:
    """``twinkle ARGV`` in-process: exit status 2 and one ``error:`` line on stderr; returns it."""
    capsys.readouterr()
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A PEFT adapter of rank 8 (``good``) and a copy whose config says r=4 (``r-mismatch``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).save_pretrained(
        root / "good"
    )
    shutil.copytree(root / "good", root / "r-mismatch")
    config = json.loads((root / "good" / "adapter_config.json").read_text())
    (root / "r-mismatch" / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    return {"good": root / "good", "r-mismatch": root / "r-mismatch"}


RANK = r"adapter_config.json says r=4 but the weights have rank 8 \(.*lora_A.weight is \[8, \d+\]\)"


@pytest.mark.parametrize("command", ["chat", "chat-repl", "eval", "export"])
def test_adapter_whose_config_rank_is_not_its_weights(command, adapters, tiny_model_dir, capsys, tmp_path):
    argv = ["--model-id", str(tiny_model_dir), "--adapter", str(adapters["r-mismatch"])]
    if command == "chat":
        argv += ["--prompt", "hi"]
    if command == "export":
        argv += ["--output", str(tmp_path / "merged")]
    err = _twinkle(capsys, command.split("-")[0], *argv)
    assert re.search(rf"^error: adapter .*r-mismatch: {RANK}; use the", err), err


def test_adapter_check_accepts_a_matching_adapter(adapters):
    assert check_adapter_folder(adapters["good"])["r"] == 8
    config = json.loads((adapters["good"] / "adapter_config.json").read_text())
    per_module = adapters["good"].parent / "rank-pattern"
    shutil.copytree(adapters["good"], per_module)
    (per_module / "adapter_config.json").write_text(
        json.dumps({**config, "r": 4, "rank_pattern": {"q_proj": 8}})
    )
    check_adapter_folder(per_module)  # rank 8 is the config's rank for some modules


@pytest.mark.parametrize("tokens", ["-1", "0"])
@pytest.mark.parametrize("prompt", [True, False])
def test_chat_max_new_tokens_below_one(tokens, prompt, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # the conversation would read questions here
    argv = ["chat", "--model-id", str(tiny_model_dir), "--max-new-tokens", tokens]
    err = _twinkle(capsys, *argv, *(["--prompt", "hi"] if prompt else []))
    assert err == f"error: --max-new-tokens must be at least 1, got {tokens}"


def test_export_checks_max_shard_size_before_the_merge(
    adapters, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    def merge(*args, **kwargs):
        raise AssertionError("the merge started before --max-shard-size was checked")

    monkeypatch.setattr(twinkle.export, "export_checkpoint", merge)
    out = tmp_path / "out"
    argv = [
        "export",
        "--adapter",
        str(adapters["good"]),
        "--output",
        str(out),
        "--model-id",
        str(tiny_model_dir),
    ]
    for size in ("garbage", "0GB", "1.5GB"):
        err = _twinkle(capsys, *argv, "--max-shard-size", size)
        assert err == (
            f"error: --max-shard-size: '{size}' is not a positive size; write a whole number and a unit, "
            "e.g. 500MB, 5GB or 2GiB"
        )
    assert not out.exists()
    assert [check_shard_size(s) for s in ("5GB", "20KB", "2GiB", " 500 MB")] == [
        "5GB",
        "20KB",
        "2GiB",
        "500MB",
    ]


@pytest.mark.parametrize("seed", [2**64, -1, "42"])
def test_initialize_refuses_a_seed_torch_cannot_take(seed):
    import twinkle

    with pytest.raises(
        UserError, match=r"initialize\(seed=\.\.\.\): must be an integer in \[0, 2\*\*63 - 1\]"
    ):
        twinkle.initialize(seed=seed)


@pytest.mark.parametrize("name", ["a.b", "", "two words"])
def test_add_adapter_refuses_a_name_peft_cannot_hold(tiny_model_dir, name):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=str(tiny_model_dir))
    with pytest.raises(UserError, match="adapter name must be letters, digits, '_' and '-'"):
        model.add_adapter_to_model(name, LoraConfig(r=4, target_modules=["q_proj"]))
