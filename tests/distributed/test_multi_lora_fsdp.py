"""``MultiLoraTransformersModel`` under FSDP2 on 2 gloo ranks: adapters trained interleaved on one
sharded base end exactly as each trained alone, and each saves as a plain PEFT adapter.

The interleaved and the solo runs compute the same operations on the same values on the same
ranks (each adapter's optimizer steps full copies of its rank-r weights, identically on every
rank), so 1e-6 is the issue's bar, not a rounding allowance."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
]  # a 2-process run: with the other multi-process suites in `-m cluster` (CI runs both)

WORKER = Path(__file__).with_name("multi_lora_worker.py")


def test_adapters_interleaved_on_fsdp2_equal_solo_runs(tiny_model_dir, tmp_path, launcher):
    job = launcher.run(WORKER, ["--model-id", str(tiny_model_dir), "--out", str(tmp_path)], nproc=2)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    diffs = result["diffs"]
    assert diffs["a_moved"] > 1e-3 and diffs["b_moved"] > 1e-3, diffs  # both trained
    assert diffs["a"] <= 1e-6 and diffs["b"] <= 1e-6, diffs
    assert result["same_probe"]  # b's outputs did not move while a trained
    for name, r, layers in (("a", 8, 14), ("b", 4, 6)):
        folder = Path(result["folders"][name])
        weights = load_file(folder / "adapter_model.safetensors")
        a_shapes = {tuple(v.shape)[0] for k, v in weights.items() if "lora_A" in k}
        assert a_shapes == {r} and len(weights) == 2 * layers
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
        PeftModel.from_pretrained(base, str(folder))  # loads in plain PEFT
