"""``twinkle export``: the merged Hugging Face folder loads with plain transformers and decodes
like PEFT's base + adapter."""

import json

import pytest
import torch
from export_models import PROMPTS, checkpoint_fixture, exported_fixture, greedy, logits
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from twinkle.cli.export import DTYPE_CHOICES, GGUF_TYPE_NAMES
from twinkle.cli.main import main
from twinkle.export import GGUF_TYPES
from twinkle.export.merge import DTYPES

checkpoint = pytest.fixture(scope="module", name="checkpoint")(checkpoint_fixture)
exported = pytest.fixture(scope="module", name="exported")(exported_fixture)


@pytest.fixture(scope="module")
def peft_reference(tiny_model_dir, checkpoint):
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(checkpoint)).eval()


def test_the_folder_holds_weights_config_tokenizer_and_template(exported):
    names = {path.name for path in exported.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert any(name.endswith(".safetensors") for name in names)
    assert not any(name.endswith(".bin") for name in names)
    assert "<|im_start|>" in (exported / "chat_template.jinja").read_text()
    assert ".twinkle-export" in names  # what --overwrite checks before replacing the folder
    assert not any(name.startswith(".") for name in names - {".twinkle-export"})  # no temporary files
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]


def test_merged_model_decodes_like_peft_base_plus_adapter(exported, peft_reference, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    merged = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert merged.dtype == torch.float32  # the base's dtype by default
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        expected = greedy(peft_reference, tokenizer, prompt)
        assert greedy(merged, tokenizer, prompt) == expected
        # float32 merge: W + B A s against PEFT computing x W + (x A) B s
        torch.testing.assert_close(
            logits(merged, tokenizer, prompt), logits(peft_reference, tokenizer, prompt)
        )
    # the adapter is not a no-op: the merged logits are not the base's
    assert not torch.allclose(
        logits(merged, tokenizer, PROMPTS[0]), logits(base, tokenizer, PROMPTS[0]), atol=1e-3
    )


def test_dtype_and_shards(checkpoint, tmp_path, peft_reference):
    out = tmp_path / "bf16"
    argv = ["export", "--adapter", str(checkpoint), "--output", str(out), "--dtype", "bfloat16"]
    assert main([*argv, "--max-shard-size", "20KB"]) == 0
    shards = sorted(path.name for path in out.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert str(AutoConfig.from_pretrained(str(out)).dtype).endswith("bfloat16")
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    reference = logits(peft_reference, tokenizer, PROMPTS[0])
    # bfloat16 keeps 8 bits of mantissa: each weight within 2^-9 relative, the logits within 2e-2 here
    torch.testing.assert_close(logits(merged, tokenizer, PROMPTS[0]), reference, atol=2e-2, rtol=0)


def test_cli_lists_match_the_export_package():
    assert GGUF_TYPE_NAMES == GGUF_TYPES
    assert DTYPE_CHOICES == tuple(DTYPES)
