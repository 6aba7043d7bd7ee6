"""Expert parallelism on DeepSeek-V3, on 2 gloo ranks (ep_size 2 over 2 FSDP2 shards), equals one
process: a tiny random checkpoint of 3 layers, the first dense (``first_k_dense_replace``), the
other two of 8 routed experts (top-2 of 2 groups of 4, one group kept: the family's sigmoid
router with its group-limited choice and ``routed_scaling_factor``) and a shared expert, with
multi-head latent attention.

``ep_worker.py`` runs 3 LoRA steps on 4 chat samples, LoRA on the attention (q_proj, o_proj) and on
the experts (``target_parameters``); the per-step losses, gradient norms and an evaluation pass's
logps agree within ``run_loss_rtol`` (``tests/assets/tolerances.py``), the saved adapters within
``adamw_weight_atol``, and each rank holds exactly its own 4 of the 8 experts of each MoE layer,
as one process loads them (gpt-oss: ``test_ep_gpt_oss.py``)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from ep_runs import assert_ep_equals_one_process, run_ep_worker

from twinkle.model.expert_parallel import check_folder
from twinkle.utils.errors import UserError

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

STEPS, LR, EXPERTS = 3, 1e-2, 8  # as ep_worker.py runs them; the checkpoint's routed experts


def build_deepseek_v3(tiny_model_dir: Path, out: Path) -> Path:
    ids = json.loads((tiny_model_dir / "config.json").read_text())
    config = transformers.DeepseekV3Config(
        vocab_size=ids["vocab_size"], eos_token_id=ids.get("eos_token_id"), pad_token_id=ids.get("pad_token_id"),
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


def test_deepseek_v3_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    model_dir = build_deepseek_v3(tiny_model_dir, tmp_path / "deepseek_v3")
    one = run_ep_worker(launcher, model_dir, tmp_path / "one", 1, STEPS)
    two = run_ep_worker(launcher, model_dir, tmp_path / "two", 2, STEPS)
    assert_ep_equals_one_process(
        one, two, "deepseek_v3", LR, STEPS, EXPERTS, (1, 2), tmp_path / "one", tmp_path / "two"
    )


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


def test_deepseek_v3_expert_count_is_read_from_its_folder(tiny_model_dir, tmp_path):
    """Its config.json names the experts n_routed_experts: an ep_size that does not divide them is
    one line before the weights load."""
    folder = tmp_path / "seven"
    folder.mkdir()
    config = transformers.DeepseekV3Config(n_routed_experts=7, n_group=1, topk_group=1).to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as info:
        check_folder(str(folder), None, 2)
    assert "ep_size=2 does not divide the model's 7 experts" in _one_line(info)
