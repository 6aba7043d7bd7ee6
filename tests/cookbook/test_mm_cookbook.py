"""``cookbook/mm/fsdp2.py``: LoRA on a vision-language model over the bundled digits and shapes.

On the tests' tiny Qwen2.5-VL with tiny settings it runs to the end, logs the held-out loss and
answer accuracy before and after training, and saves an adapter that holds the vision tower
when asked to train it (``--train-vision true``). The checkpoint it makes with no ``--model-id``
(``cookbook/mm/vl_checkpoint.py``) runs text as SmolLM2's first layers do: the same logits."""

import sys
from pathlib import Path

import pytest
import torch
import warm
from harness import script_env
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cookbook" / "mm" / "fsdp2.py"
FLAGS = ("--max-steps", "2", "--eval-interval", "2", "--log-interval", "1", "--batch-size", "4",
         "--train-samples", "8", "--eval-samples", "4")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "multimodal"))
    from tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.mark.slow  # a subprocess that trains: over 10 s
def test_the_cookbook_trains_and_reports_held_out_accuracy(tiny_vl, tmp_path):
    out = tmp_path / "out"
    argv = [str(SCRIPT), "--model-id", str(tiny_vl), "--output-dir", str(out), *FLAGS,
            "--train-vision", "true"]  # fmt: skip
    done = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)  # its own process
    assert done.returncode == 0, done.stderr[-4000:]
    assert "before training: held-out loss" in done.stderr
    assert "step 2: held-out loss" in done.stderr and "answer accuracy" in done.stderr
    assert "step 2/2: loss" in done.stderr
    saved = load_file(out / "last-checkpoint" / "adapter_model.safetensors")
    assert any(".visual." in k and "lora" not in k for k in saved)  # the tower trained whole
    assert any(".language_model." in k and "lora_A" in k for k in saved)
    assert not any(".visual." in k and "lora" in k for k in saved)  # LoRA on the language model only


@pytest.mark.slow  # converts the bundled model unless an earlier test did: about 30 s
def test_the_made_checkpoint_speaks_as_smollm2_on_text():
    from transformers import AutoTokenizer, LlamaForCausalLM, Qwen2_5_VLForConditionalGeneration

    from twinkle.hub import resolve_model

    # the tests' shared cache (conftest): the bundled model is converted once for the whole run
    sys.path.insert(0, str(SCRIPT.parent))
    from vl_checkpoint import LAYERS, vl_checkpoint

    folder = vl_checkpoint()
    smol_dir = resolve_model(None)
    smol = LlamaForCausalLM.from_pretrained(
        str(smol_dir), dtype=torch.float32, num_hidden_layers=LAYERS
    ).eval()
    vl = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        expected, got = smol(input_ids=ids).logits, vl(input_ids=ids).logits
    assert got.shape[-1] == expected.shape[-1] + 4  # Qwen's four vision tokens added
    torch.testing.assert_close(got[..., : expected.shape[-1]], expected, atol=0, rtol=0)
