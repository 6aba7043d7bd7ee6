"""FSDP2's mixed precision follows the model's dtype (``--dtype``), not the device alone."""

import pytest
import torch
from torch import nn

from twinkle.distributed.fsdp import precision_policy


def _model(base: torch.dtype) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4).to(base), nn.Linear(4, 2))  # a fp32 "adapter" beside it
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("device", ["cuda", "xpu"])
def test_accelerator_with_a_bf16_model_computes_in_bf16_and_reduces_in_fp32(device):
    policy = precision_policy(torch.device(device), _model(torch.bfloat16))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_fp32_model_and_any_cpu_model_keep_each_weight_dtype(device):
    # --dtype float32 on a GPU really computes in fp32; on the CPU a bf16 base keeps fp32 LoRA
    for base in (torch.float32, torch.bfloat16) if device == "cpu" else (torch.float32,):
        policy = precision_policy(torch.device(device), _model(base))
        assert (policy.param_dtype, policy.reduce_dtype) == (None, None), (device, base)
