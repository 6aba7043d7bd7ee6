"""Routing replay asked for on a model whose routes it cannot replay, in one line before any work:
a dense model has no router; a mixture of experts outside the routers it hooks (Mixtral's) is
named as such, not called dense."""

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
            transformers.MixtralConfig(**SMALL, num_local_experts=8),
            "mixtral's router is not one of them; leave routing replay off",
        ),
    ],
)
def test_a_folder_is_refused_before_loading(tmp_path, config, needle):
    with pytest.raises(UserError) as info:
        refuse_dense_folder(_folder(tmp_path, config))
    text = _one_line(info)
    assert text.startswith("enable_router_replay=True: ") and needle in text


def test_a_loaded_moe_without_a_hooked_router_is_named_as_moe():
    config = transformers.MixtralConfig(**SMALL, vocab_size=64, intermediate_size=16, num_local_experts=4)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(UserError) as info:
        RouterReplay.install(model)
    assert "mixtral's router is not one of them" in _one_line(info)


def test_a_deepseek_v4_folder_is_accepted(tmp_path):
    """DeepSeek-V4's routers (scored and hash-routed) are ones replay hooks: no refusal."""
    config = transformers.DeepseekV4Config(**SMALL, n_routed_experts=8, num_experts_per_tok=2)
    refuse_dense_folder(_folder(tmp_path, config))
