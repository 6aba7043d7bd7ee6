"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Qwen3.5-MoE) with the tiny tokenizer,
built offline from configs, and the helpers the MoE tests share (a module of its own: ``from
conftest import`` would pick whichever ``conftest`` loaded first)."""

import json
import shutil
from pathlib import Path

import torch
import transformers

EXPERTS, TOP_K = 8, 2
SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=16,
    tie_word_embeddings=True,
)


def _save(model: torch.nn.Module, tokenizer_dir: Path, out: Path) -> Path:
    model.save_pretrained(out)
    for path in tokenizer_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


def _ids(tokenizer_dir: Path) -> dict:
    config = json.loads((tokenizer_dir / "config.json").read_text())
    return {k: config.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")}


def build_qwen3_moe(tiny_model_dir: Path, out: Path) -> Path:
    """2 layers, each a mixture of 8 experts, top-2, renormalised (as Qwen3-MoE checkpoints are)."""
    config = transformers.Qwen3MoeConfig(
        **SHAPE, **_ids(tiny_model_dir), intermediate_size=64, norm_topk_prob=True
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    return _save(model, tiny_model_dir, out)


def build_qwen2_moe(tiny_model_dir: Path, out: Path) -> Path:
    """2 layers of 8 experts, top-2, not renormalised (Qwen2-MoE's default), and a shared expert."""
    shape = {k: v for k, v in SHAPE.items() if k != "head_dim"}
    config = transformers.Qwen2MoeConfig(
        **shape, **_ids(tiny_model_dir), intermediate_size=64, shared_expert_intermediate_size=16
    )
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config)
    return _save(model, tiny_model_dir, out)


def build_qwen3_5_moe(tiny_model_dir: Path, out: Path) -> Path:
    """A hybrid layer pair (linear attention, then full attention), each with 8 experts and a
    shared expert."""
    config = transformers.Qwen3_5MoeTextConfig(
        **SHAPE,
        **_ids(tiny_model_dir),
        shared_expert_intermediate_size=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config)
    return _save(model, tiny_model_dir, out)


def shift_routers(lm: torch.nn.Module, scale: float = 1.0, seed: int = 1) -> None:
    """Move every router's weights (a step between sampling and training, made large), so the
    routers choose other experts for many tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lm.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.add_(scale * torch.randn(module.weight.shape, generator=g))
