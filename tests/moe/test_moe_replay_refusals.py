"""Routing replay asked for on a model whose routes it cannot replay, in one line before any work:
a dense model has no router; a mixture of experts outside the routers it hooks (DeepSeek-V3's
group-limited sigmoid router, gpt-oss's) is named as such, not called dense."""

import json

import pytest
import torch
import transformers

from twinkle.model.router_replay import RouterReplay, refuse_dense_folder
from twinkle.utils.errors import UserError

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)


def _folder(tmp_path, config) -> str:
    folder = tmp_path / config.model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return str(folder)


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (transformers.LlamaConfig(**SMALL), "the model (llama) has no mixture-of-experts router to replay"),
        (
            transformers.DeepseekV3Config(**SMALL, n_routed_experts=8, n_group=1, topk_group=1),
            "deepseek_v3's router is not one of them; leave routing replay off",
        ),
        (
            transformers.GptOssConfig(**SMALL, num_local_experts=8),
            "gpt_oss's router is not one of them; leave routing replay off",
        ),
    ],
)
def test_a_folder_is_refused_before_loading(tmp_path, config, needle):
    with pytest.raises(UserError) as info:
        refuse_dense_folder(_folder(tmp_path, config))
    text = _one_line(info)
    assert text.startswith("enable_router_replay=True: ") and needle in text


def test_a_loaded_moe_without_a_hooked_router_is_named_as_moe():
    config = transformers.DeepseekV3Config(
        **SMALL, vocab_size=64, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=0,
        moe_intermediate_size=8, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with pytest.raises(UserError) as info:
        RouterReplay.install(model)
    assert "deepseek_v3's router is not one of them" in _one_line(info)
