"""Upstream's routing-replay script in its replay-off mode: ``RouterReplayAction`` imports from
upstream's path, ``TransformersModel(enable_router_replay=False, fsdp_config={'expert_parallel':
{'enabled': False, ...}})`` builds, and a step's ``router_replay_action`` on such a model changes
nothing (as upstream's), said once; replay on a dense model or an expert-parallel router dtype
other than fp32 is one line (replay itself: ``tests/moe/test_router_replay.py``; expert
parallelism: ``tests/distributed/test_expert_parallel.py``)."""

import logging

import pytest
import torch
from peft import LoraConfig

from twinkle.model import TransformersModel, loss_inputs
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.utils.errors import UserError

ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Twinkle."}]},
    {"messages": [{"role": "user", "content": "Your name?"}, {"role": "assistant", "content": "Twinkle"}]},
]
EP_OFF = {"expert_parallel": {"enabled": False, "router_dtype": "fp32", "keep_router_logits": False}}


def _model(tiny_model_dir, **keywords):
    torch.manual_seed(0)
    model = TransformersModel(model_id=str(tiny_model_dir), mixed_precision="no", **keywords)
    model.add_adapter_to_model("default", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3)
    return model


def test_an_action_on_a_model_without_replay_changes_nothing_and_is_said_once(
    tiny_model_dir, caplog, monkeypatch
):
    monkeypatch.setattr(loss_inputs, "_said_replay_off", [])
    replayed = _model(tiny_model_dir, enable_router_replay=False, strategy="native_fsdp", fsdp_config=EP_OFF)
    plain = _model(tiny_model_dir)
    old = replayed.forward_only(inputs=ROWS, router_replay_action=RouterReplayAction.RECORD)["logps"]
    assert torch.equal(old, plain.forward_only(inputs=ROWS)["logps"])
    got = replayed.forward_backward(inputs=ROWS, router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    assert float(got) == float(plain.forward_backward(inputs=ROWS))
    said = [r for r in caplog.records if "router_replay_action" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert said[0].getMessage().startswith("router_replay_action=RECORD: nothing to replay")


@pytest.mark.parametrize(
    ("keywords", "needle"),
    [
        (
            {"enable_router_replay": True},
            r"enable_router_replay=True: the model \(llama\) has no mixture-of-experts router",
        ),
        (
            {"fsdp_config": {"expert_parallel": {"enabled": True, "router_dtype": "bf16"}}},
            r"\['router_dtype'\]='bf16': the router here is the model's own",
        ),
    ],
)
def test_replay_on_a_dense_model_or_a_bf16_expert_router_is_one_line(tiny_model_dir, keywords, needle):
    with pytest.raises(UserError, match=needle) as info:
        TransformersModel(model_id=str(tiny_model_dir), **keywords)
    assert "\n" not in str(info.value)
