"""Model folders that cannot be used: one line naming the part and the fix, before any library
call that would fail obscurely (or, for layers the weights lack, silently start them at random).

Every case is checked in process against ``check_model_folder`` (what ``resolve_model`` calls,
and through it training, ``Dataset.set_template``, ``twinkle chat`` and ``twinkle kernels``);
the issue's case and a mismatch run through the verbatim contract script, and two through
``twinkle chat``."""

import json
import re
import shutil
from pathlib import Path

import pytest
from fake_gguf import gguf_header
from harness import assert_one_line_error, run_script

from twinkle.cli.main import main
from twinkle.hub import check_model_folder, resolve_model
from twinkle.hub import gguf as hub_gguf
from twinkle.hub.check_folder import TESTED_MODEL_TYPES
from twinkle.utils.errors import UserError

FAST = ("--train-samples", "4", "--batch-size", "4", "--eval-samples", "4", "--eval-interval", "100")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


def _no_tokenizer(folder: Path) -> None:
    for name in TOKENIZER:
        (folder / name).unlink()


def _cut(folder: Path, keep: int) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep if keep > 0 else len(data) // 2])


def _sharded_with_a_shard_missing(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def _index_naming_a_tensor_the_shard_lacks(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}
    weight_map["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00001.safetensors"
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


# name -> (how to break a copy of the tiny model, regex of the message)
CASES = {
    "no-config": (
        lambda f: (f / "config.json").unlink(),
        r"has no config.json; pass a folder with config.json",
    ),
    "config-not-json": (
        lambda f: (f / "config.json").write_text("{not json"),
        r"config.json is not valid JSON \(.*line 1 column 2.*\); restore it",
    ),
    "no-model-type": (
        lambda f: _config(f, model_type=None),
        r'config.json has no "model_type" .*tested: llama, mistral, qwen2, qwen3',
    ),
    "unknown-model-type": (
        lambda f: _config(f, model_type="foo"),
        r"model_type 'foo' is not a family transformers \S+ knows; Twinkle trains causal LMs that "
        r"transformers knows \(tested: llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, qwen3_5, "
        r"qwen3_5_moe, qwen2_vl, qwen2_5_vl, qwen3_vl\); fix model_type in config.json or upgrade transformers",
    ),
    "unknown-model-type-and-no-tokenizer": (  # the folder: the model_type is named first
        lambda f: (_config(f, model_type="foo"), _no_tokenizer(f)),
        r"model_type 'foo' is not a family transformers",
    ),
    "custom-code": (
        lambda f: _config(f, model_type="mymodel", auto_map={"AutoModelForCausalLM": "m.M"}),
        r"model_type 'mymodel' is not a family .* needs the model's own code \(auto_map\)",
    ),
    "not-a-causal-lm": (
        lambda f: _config(f, model_type="t5"),
        r"model_type 't5' is not a causal language model \(transformers has no AutoModelForCausalLM",
    ),
    "no-tokenizer": (
        _no_tokenizer,
        r"no tokenizer files \(one of tokenizer.json, tokenizer.model, spiece.model or vocab.json "
        r"\+ merges.txt\); copy them",
    ),
    "tokenizer-json-cut-short": (
        lambda f: (f / "tokenizer.json").write_text((f / "tokenizer.json").read_text()[:500]),
        r"tokenizer.json is cut short or empty",
    ),
    "no-weights": (
        lambda f: (f / "model.safetensors").unlink(),
        r"no weight files \(model.safetensors, .*\); download the weights again",
    ),
    "adapter-instead-of-a-model": (
        lambda f: (f / "model.safetensors").rename(f / "adapter_model.safetensors"),
        r"no weight files .*it holds a LoRA adapter: pass the base model as --model-id",
    ),
    "gguf-beside-a-config": (
        lambda f: ((f / "model.safetensors").unlink(), (f / "m.gguf").write_bytes(gguf_header("llama"))),
        r"no weight files .*it holds m.gguf: pass that .gguf file as --model-id",
    ),
    "index-names-a-missing-shard": (
        _sharded_with_a_shard_missing,
        r"model.safetensors.index.json names 1 of 2 shard\(s\) that are missing "
        r"\(model-00002-of-00002.safetensors\); download them again",
    ),
    "index-names-a-tensor-the-shard-lacks": (
        _index_naming_a_tensor_the_shard_lacks,
        r"lists 1 tensor\(s\) that their shard does not hold \(model.layers.9.mlp.up_proj.weight\)",
    ),
    "truncated-weights": (
        lambda f: _cut(f, 0),
        r"weight file model.safetensors is damaged or cut short \(.*\); download it again",
    ),
    "truncated-weights-header": (
        lambda f: _cut(f, 100),
        r"weight file model.safetensors is damaged or cut short \(.*invalid header length\)",
    ),
    "hidden-size-not-the-weights": (
        lambda f: _config(f, hidden_size=64, head_dim=16),
        r"the weights do not match config.json: model.embed_tokens.weight is \[600, 32\] in the weights "
        r"but \[600, 64\] by config.json \(and \d+ more tensors\); use the config.json that belongs",
    ),
    "vocab-size-not-the-weights": (
        lambda f: _config(f, vocab_size=700),
        r"model.embed_tokens.weight is \[600, 32\] in the weights but \[700, 32\] by config.json;",
    ),
    "more-layers-than-the-weights": (  # transformers would start layer 2 at random, silently
        lambda f: _config(f, num_hidden_layers=3),
        r"it describes 3 layer\(s\) \(num_hidden_layers\) but the weights hold 2 under model.layers",
    ),
    "fewer-layers-than-the-weights": (
        lambda f: _config(f, num_hidden_layers=1),
        r"it describes 1 layer\(s\) \(num_hidden_layers\) but the weights hold 2 under model.layers",
    ),
}


@pytest.fixture(scope="module")
def broken(tiny_model_dir, tmp_path_factory):
    """Each case's folder: a copy of the tiny model, broken as the case says."""
    root = tmp_path_factory.mktemp("broken-models")
    folders = {}
    for name, (damage, _) in CASES.items():
        folder = root / name
        shutil.copytree(tiny_model_dir, folder)
        damage(folder)
        folders[name] = folder
    return folders


@pytest.mark.parametrize("case", list(CASES))
def test_resolve_model_names_what_is_wrong_with_a_folder(case, broken):
    with pytest.raises(UserError) as info:
        resolve_model(str(broken[case]))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"model folder '{broken[case]}'"), message
    assert re.search(CASES[case][1], message), message


def test_a_usable_folder_passes_and_is_checked_once(tiny_model_dir, monkeypatch):
    check_model_folder(tiny_model_dir)
    from twinkle.hub import check_folder

    monkeypatch.setattr(check_folder, "read_config", lambda *a: pytest.fail("checked again"))
    check_model_folder(tiny_model_dir)  # same files, same answer: no second look
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()


def test_tokenizer_only_check(broken):
    check_model_folder(broken["no-weights"], weights=False)  # config and tokenizer are fine
    with pytest.raises(UserError, match="no tokenizer files"):
        check_model_folder(broken["no-tokenizer"], weights=False)


def test_the_tested_families_include_every_family_packing_and_kernels_name():
    from twinkle.kernel.config import DEFAULT_KERNEL_CONFIG
    from twinkle.model.packing import PACKABLE_MODEL_TYPES
    from twinkle.model.vision_packing import PACKABLE_VISION_TYPES

    assert set(PACKABLE_MODEL_TYPES) <= set(TESTED_MODEL_TYPES)
    assert set(PACKABLE_VISION_TYPES) <= set(TESTED_MODEL_TYPES)
    kernel_families = {  # Qwen3-VL's language model classes are Qwen3VLText*
        name.removesuffix("RMSNorm").removesuffix("Text").lower()
        for name in DEFAULT_KERNEL_CONFIG
        if name.endswith("RMSNorm")
    }
    normalised = {t.replace("_", "") for t in TESTED_MODEL_TYPES}
    assert {f.replace("_", "") for f in kernel_families} <= normalised


# ---------------------------------------------------------------- GGUF files
def test_a_gguf_of_an_architecture_transformers_cannot_convert(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_gguf, "convert_gguf", lambda *a: pytest.fail("converted"))
    path = tmp_path / "bert.Q8_0.gguf"
    path.write_bytes(gguf_header("bert"))
    with pytest.raises(
        UserError,
        match=r"bert.Q8_0.gguf is a GGUF of architecture 'bert', which transformers cannot convert into a "
        r"causal LM; convertible: .*llama.*qwen3.*; pass a safetensors model folder instead",
    ):
        resolve_model(str(path))
    encoder = tmp_path / "t5.gguf"  # transformers converts T5, but it is not a causal LM
    encoder.write_bytes(gguf_header("t5"))
    with pytest.raises(UserError, match=r"architecture 't5', which transformers cannot convert"):
        resolve_model(str(encoder))
    assert not (tmp_path / "twinkle-cache" / "models").exists() or not any(
        p.name.startswith(("bert", "t5")) and not p.name.endswith(".lock")
        for p in (tmp_path / "twinkle-cache" / "models").iterdir()
    )


@pytest.mark.parametrize(
    "content, pattern",
    [
        (b"PK\x03\x04 a zip", r"is not a GGUF file \(it does not start with 'GGUF'\)"),
        (gguf_header("llama")[:30], r"is cut short inside its header"),
    ],
)
def test_a_file_that_is_no_gguf(content, pattern, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(UserError, match=pattern):
        resolve_model(str(path))


def test_a_failing_conversion_is_one_line(tmp_path, monkeypatch):
    def fails(src, dst):
        raise RuntimeError("unsupported quantization type Q2_K\nmore lines")

    monkeypatch.setattr(hub_gguf, "convert_gguf", fails)
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_header("llama"))
    with pytest.raises(
        UserError, match=r"^could not convert m.gguf \(unsupported quantization type Q2_K\); pass"
    ):
        resolve_model(str(path))


# ---------------------------------------------------------------- twinkle chat
@pytest.mark.parametrize("case", ["unknown-model-type-and-no-tokenizer", "truncated-weights"])
def test_chat_reports_a_bad_folder_in_one_line(case, broken, capsys):
    assert main(["chat", "--model-id", str(broken[case]), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model folder"), err
    assert re.search(CASES[case][1], err[0]), err


# ---------------------------------------------------------------- the contract script
@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown-model-type-and-no-tokenizer", "more-layers-than-the-weights"])
def test_script_reports_a_bad_model_folder_in_one_line(case, broken, tmp_path):
    result = run_script(tmp_path, broken[case], tmp_path / "out", *FAST)
    assert_one_line_error(
        result, re.escape(f"model folder '{broken[case]}': ") + ".*" + CASES[case][1], tmp_path / "out"
    )
