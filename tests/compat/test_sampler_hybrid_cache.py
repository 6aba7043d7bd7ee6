"""The sampler on a hybrid model (Qwen3.5: linear-attention layers with a recurrent cache beside
full attention): several samples per prompt and prompts of different lengths, each sampled
token's log-probability equal to a plain forward over the whole sequence (fp32, 1e-4)."""

import shutil

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler

TOL = 1e-4  # fp32 on both sides: summation order only


@pytest.fixture(scope="module")
def hybrid_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-qwen3_5")
    config = Qwen3_5TextConfig(
        vocab_size=600,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


def test_samples_of_a_hybrid_model_score_as_a_plain_forward(hybrid_dir):
    sampler = TorchSampler(str(hybrid_dir), dtype=torch.float32)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12], [5, 6, 7, 8, 13, 14]]
    responses = sampler.sample(
        [{"input_ids": p} for p in prompts], SamplingParams(max_tokens=5, num_samples=2, logprobs=1, seed=0)
    )
    reference = Qwen3_5ForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()
    for prompt, response in zip(prompts, responses, strict=True):
        assert len(response.sequences) == 2
        for seq in response.sequences:
            ids = prompt + list(seq.tokens)
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
            got = torch.tensor([entry[0][1] for entry in seq.logprobs])
            torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
