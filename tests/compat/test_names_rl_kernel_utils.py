"""Upstream's names in the kernel, advantage, reward and utils packages, in the call shapes its
scripts use: ``liger_builtin``/``npu_builtin`` through ``kernelize`` on a tiny Llama,
``GRPOAdvantage()(..., scale='group').tolist()``, ``GSM8KAccuracyReward`` and a user's
``Reward`` subclass over trajectories, and the utils helpers."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from twinkle.advantage import Advantage, GRPOAdvantage
from twinkle.kernel import kernelize, liger_builtin, npu_builtin
from twinkle.kernel.kernelize import MARK
from twinkle.reward import GSM8KAccuracyReward
from twinkle.reward.base import Reward
from twinkle.utils import (
    align_logps_to_mask,
    deep_getattr,
    pad_and_stack_tensors,
    pad_sequence_to_length,
    selective_log_softmax,
)


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def test_liger_builtin_falls_through_to_torch_where_liger_cannot_run():
    model = kernelize(tiny_llama(), liger_builtin(None))
    marks = {type(m).__name__: getattr(m, MARK, None) for m in model.modules()}
    assert marks["LlamaRMSNorm"][0] == "rms_norm" and marks["LlamaMLP"][0] == "swiglu_mlp"
    if not torch.cuda.is_available():
        assert marks["LlamaRMSNorm"][1] == "torch"
    assert marks["LlamaAttention"] is None  # the bundle names Liger's ops only


def test_npu_builtin_is_gated_on_the_device():
    bundle = npu_builtin(None)
    assert all(set(value) == {"npu"} for value in bundle.values())
    model = kernelize(tiny_llama(), {**bundle})
    assert all(getattr(m, MARK, None) is None for m in model.modules())  # a CPU model: untouched
    merged = {**npu_builtin(None), **liger_builtin(None)}  # upstream's composition: later wins
    assert merged["LlamaRMSNorm"] == liger_builtin(None)["LlamaRMSNorm"]


def test_grpo_advantage_in_the_scripts_shape():
    advantages = GRPOAdvantage()([1.0, 0.0, 0.0, 0.0, 2.0, 2.0], num_generations=2, scale="group")
    assert isinstance(GRPOAdvantage(), Advantage)
    root_half = 1 / math.sqrt(0.5)  # a pair (1, 0): deviations 0.5 over the unbiased std sqrt(0.5)
    want = [0.5 * root_half, -0.5 * root_half, 0.0, 0.0, 0.0, 0.0]
    assert advantages.tolist() == pytest.approx(want, rel=1e-6)


def trajectory(answer: str, truth: str) -> dict:
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "user_data": [("ground_truth", truth)]}


def test_gsm8k_accuracy_reward_reads_the_messages():
    trajs = [trajectory("so \\boxed{4}", "4"), trajectory("#### 5", "4"), trajectory("no answer", "4")]
    assert GSM8KAccuracyReward()(trajs) == [1.0, 0.0, 0.0]


def test_a_users_reward_subclass_overrides_call():
    class Brevity(Reward):
        def __call__(self, trajectories, **kwargs):
            return [1.0 / len(t["messages"][-1]["content"]) for t in trajectories]

    assert Brevity()([trajectory("abcd", "0")]) == [0.25]


def test_utils_helpers():
    assert deep_getattr({"a": {"b": 3}}, "a.b") == 3 and deep_getattr(object(), "x.y", "none") == "none"
    padded = pad_sequence_to_length(torch.ones(1, 2), 4, pad_value=-1.0, left_pad=True)
    assert padded.tolist() == [[-1.0, -1.0, 1.0, 1.0]]
    stacked = pad_and_stack_tensors([torch.ones(2), torch.ones(1, 3)], pad_value=0)
    assert stacked.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    logps, entropy = selective_log_softmax(logits, torch.tensor([1]), return_entropy=True)
    assert logps.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    mask = torch.tensor([[False, True, True]])
    assert align_logps_to_mask([[0.5, 0.3]], mask, torch.float64).tolist() == [[0.0, 0.5, 0.3]]
    assert align_logps_to_mask([2.0], mask, torch.float64).tolist() == [[0.0, 2.0, 2.0]]
