"""LoRA on experts: ``LoraConfig(target_parameters=[...])`` reaches the fused 3-D expert weights of
a Qwen3-MoE model, trains them, and saves an adapter that plain PEFT loads on the Hugging Face
class with the logits of the model that trained it, and that a sampler with its own copy of the
model receives; a model without those weights refuses in one line before anything is wrapped."""

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.model.expert_lora import EXPERT_PARAMETERS
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Twinkle."}]},
    {
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "France, my friend"},
        ]
    },
]


def _expert_lora(path) -> TransformersModel:
    model = TransformersModel(model_id=str(path))
    torch.manual_seed(0)
    config = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules="all-linear",
        target_parameters=list(EXPERT_PARAMETERS),
        init_lora_weights=False,  # B random too: every factor has a gradient, the adapter a visible effect
    )
    model.add_adapter_to_model("default", config)
    model.set_optimizer("AdamW", lr=1e-2)
    return model


def test_expert_lora_trains_and_loads_in_peft_with_the_same_logits(qwen3_moe_dir, tmp_path):
    model = _expert_lora(qwen3_moe_dir)
    expert = {n: p for n, p in model.model.named_parameters() if p.requires_grad and ".experts." in n}
    assert len(expert) == 2 * 2 * 2  # 2 layers x (gate_up_proj, down_proj) x (lora_A, lora_B)
    before = {n: p.detach().clone() for n, p in expert.items()}
    for _ in range(2):
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
    assert all(not torch.equal(p, before[n]) for n, p in expert.items())  # every expert LoRA trained

    folder = model.save("experts", output_dir=str(tmp_path))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert sum(".experts." in k for k in saved) == len(expert)

    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 13, 64, 300, 8]])
    base = AutoModelForCausalLM.from_pretrained(str(qwen3_moe_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        model.model.eval()
        ours = model.model(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
        b_factors = [p for n, p in expert.items() if "lora_B" in n]
        kept = [p.clone() for p in b_factors]
        for p in b_factors:
            p.zero_()
        without_experts = model.model(input_ids=ids).logits
        for p, k in zip(b_factors, kept, strict=True):
            p.copy_(k)
    # fp32, the same products (the linear LoRA layers as one fused node here, PEFT's layers there):
    # summation order only, far below what the experts' LoRA moves
    assert (ours - without_experts).abs().max() > 1e-3
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_lora_on_experts_of_a_dense_model_is_one_line(tiny_model_dir):
    model = TransformersModel(model_id=str(tiny_model_dir))
    config = LoraConfig(r=2, target_modules="all-linear", target_parameters=list(EXPERT_PARAMETERS))
    with pytest.raises(
        UserError, match=r"target_parameters \[.*\]: the model \(llama\) has no such parameter"
    ) as info:
        model.add_adapter_to_model("default", config)
    assert "\n" not in str(info.value)


def test_a_sampler_synced_with_expert_lora_samples_as_the_trainer(qwen3_moe_dir):
    """``CheckpointEngineManager.sync_weights`` carries the experts' LoRA to a sampler with its own
    copy of the model, which then draws what the trainer's own modules draw."""
    model = _expert_lora(qwen3_moe_dir)
    model.forward_backward(inputs=ROWS)
    model.clip_grad_and_step()
    assert sum(".experts." in k for k in model.get_state_dict("default")) == 2 * 2 * 2
    own = TorchSampler(str(qwen3_moe_dir))
    assert CheckpointEngineManager(model=model, sampler=own).sync_weights()["mode"] == "lora"
    params = SamplingParams(max_tokens=6, num_samples=2, seed=3, logprobs=1)
    prompt = [{"input_ids": [5, 6, 7, 8, 9]}]
    theirs = own.sample(prompt, params)[0].sequences
    ours = TorchSampler(model).sample(prompt, params)[0].sequences
    for a, b in zip(theirs, ours, strict=True):
        assert a.tokens == b.tokens
        got, want = [x[0][1] for x in a.logprobs], [x[0][1] for x in b.logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
