"""``cookbook/moe/ep_lora.py``: started with no launcher it starts 2 ranks itself (ep_size 2 over 2
FSDP2 shards) and trains LoRA on attention and the experts of the mixture-of-experts checkpoint
``moe_checkpoint.py`` makes from the bundled SmolLM2; and that checkpoint starts as SmolLM2 does."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook" / "moe"
sys.path.insert(0, str(COOKBOOK))
import moe_checkpoint  # noqa: E402  (the cookbook's own module)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A Twinkle cache holding the made checkpoint where the cookbook looks for it."""
    from twinkle.hub.cache import ensure_converted

    root = tmp_path_factory.mktemp("ep-cookbook-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TWINKLE_CACHE", str(root))  # where resolve_model converts the bundled SmolLM2
        ensure_converted(root / "cookbook" / moe_checkpoint.NAME, moe_checkpoint.build)
    return root


@pytest.mark.cluster  # its fixture converts SmolLM2 into a fresh cache (about 45 s): with the long suites
def test_the_made_checkpoint_computes_smollm2(cache, monkeypatch):
    """Every expert is a copy of the layer's MLP and the two chosen weights sum to one, so the
    MoE model's logits are SmolLM2's up to rounding (the bound: fp32 rounding of 30 layers,
    far below the O(1) logits a wrong weight would move)."""
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model

    monkeypatch.setenv("TWINKLE_CACHE", str(cache))  # SmolLM2 as converted there
    moe = AutoModelForCausalLM.from_pretrained(
        str(cache / "cookbook" / moe_checkpoint.NAME), dtype=torch.float32
    )
    smol = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=torch.float32)
    assert type(moe).__name__ == "Qwen2MoeForCausalLM"
    sparse = [i for i, layer in enumerate(moe.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == [6, 13, 20, 27]
    ids = torch.tensor([[1, 504, 3459, 314, 253, 5248, 28, 1117, 54, 1552, 47, 42]])
    with torch.no_grad():
        a, b = moe(input_ids=ids).logits, smol(input_ids=ids).logits
    assert b.abs().max() > 5  # real logits, not a degenerate model
    assert (a - b).abs().max() <= 1e-3 * b.abs().max(), (a - b).abs().max()


@pytest.mark.cluster  # 2 processes, with the other `-m cluster` suites
def test_no_flags_start_two_expert_parallel_ranks_that_train_and_save(cache, tmp_path):
    out = tmp_path / "out"
    flags = ["--max-steps", "3", "--train-samples", "4", "--batch-size", "4", "--log-interval", "1"]
    env = {**os.environ, "TWINKLE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, str(COOKBOOK / "ep_lora.py"), *flags, "--output-dir", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "starting 2 ranks: ep_size 2, FSDP2 over 2" in log
    assert "expert parallelism: experts 0..3 of 8 on this rank" in log, log[-4000:]
    losses = [float(x) for x in re.findall(r"step \d/3: loss ([0-9.]+)", log)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # the same 4 samples each step
    adapter = out / "last-checkpoint"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert set(config["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    weights = load_file(adapter / "adapter_model.safetensors")
    experts = [n for n in weights if ".experts." in n and "lora_A" in n]
    assert len(experts) == 8  # 2 fused weights x 4 MoE layers, each saved whole (r x 8 experts)
    assert all(weights[n].shape[0] == 8 * 8 for n in experts)
    assert any(".self_attn.q_proj.lora_A" in n for n in weights)
